"""Logprob tokens with a SentencePiece-style tokenizer (issue 16, item 11): "▁world" decoded
alone is "world", after another token " world". The tokens of a response must join into its
text, and text_offset must say where each starts. The tokenizer is built here (a `tokenizers`
BPE with the Metaspace pre-tokenizer and decoder, as Llama-2 and Mistral use), no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import _CORPUS, make_checkpoint
from serving_helpers import CHAT_TEMPLATE, KV, AppClient

from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.entrypoints.openai.api_server import build_app

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over"


def make_sentencepiece_tokenizer(path: Path) -> int:
    """Save a Llama-style (▁ for spaces) tokenizer at path; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    for stale in [*path.glob("tokenizer*"), *path.glob("special_tokens_map.json")]:
        stale.unlink()
    LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                       unk_token="<unk>", add_bos_token=True).save_pretrained(path)
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "llama_sp"
    path.mkdir()
    vocab = make_sentencepiece_tokenizer(path)  # the model's vocabulary is the tokenizer's
    make_checkpoint(path, "LlamaForCausalLM", vocab_size=vocab)
    make_sentencepiece_tokenizer(path)  # make_checkpoint wrote its byte-level one
    engine = AsyncLLMEngine.from_engine_args(str(path), kv_cache_memory=KV, max_model_len=256)
    tokenizer = engine.tokenizer
    alone = [tokenizer.decode([t]) for t in tokenizer.encode(PROMPT)]
    assert "".join(alone) != PROMPT  # the defect this file is about: ids decoded alone
    client = AppClient(build_app(engine, ["sp"], chat_template=CHAT_TEMPLATE))
    yield client
    client.close()
    engine.shutdown()


SAMPLED = {"temperature": 1.0, "seed": 1, "ignore_eos": True, "max_tokens": 24}


def assert_tokens_make_the_text(logprobs: dict, text: str) -> None:
    tokens = logprobs["tokens"]
    assert "".join(tokens) == text, (tokens, text)
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert sum(t.startswith(" ") for t in tokens) >= 2, tokens  # spaces are really there


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprob_tokens_join_into_the_text(app, echo):
    body = {"prompt": PROMPT, "logprobs": 3, "echo": echo, **SAMPLED}
    r = app.request("POST", COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"].startswith(PROMPT) == echo
    assert_tokens_make_the_text(choice["logprobs"], choice["text"])
    # The alternatives are decoded in context too: the chosen token is among them, as it is.
    for token, top in zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"],
                          strict=True):
        assert top is None or token in top, (token, top)

    streamed: dict = {"text": "", "tokens": [], "text_offset": []}
    data = [line[6:] for line in app.request("POST", COMPLETIONS, json={
        **body, "stream": True}).text.splitlines() if line.startswith("data: ")]
    for event in data[:-1]:
        for c in json.loads(event)["choices"]:
            streamed["text"] += c["text"]
            streamed["tokens"] += c["logprobs"]["tokens"]
            streamed["text_offset"] += c["logprobs"]["text_offset"]
    assert streamed["text"] == choice["text"]
    assert streamed["tokens"] == choice["logprobs"]["tokens"]
    assert streamed["text_offset"] == choice["logprobs"]["text_offset"]


def test_prompt_scoring_tokens_join_into_the_prompt(app):
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1}
    [choice] = app.request("POST", COMPLETIONS, json=body).json()["choices"]
    assert choice["text"] == PROMPT
    assert_tokens_make_the_text(choice["logprobs"], PROMPT)


def test_chat_logprob_tokens_join_into_the_content(app):
    body = {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True,
            "top_logprobs": 2, **SAMPLED}
    r = app.request("POST", CHAT, json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert "".join(tokens) == choice["message"]["content"]
    assert sum(t.startswith(" ") for t in tokens) >= 2, tokens
    assert all(t["bytes"] == list(t["token"].encode()) for t in choice["logprobs"]["content"])
