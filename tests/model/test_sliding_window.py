"""Sliding-window attention (Mistral): greedy tokens and logprobs match transformers' Mistral
for prompts and outputs longer than the window, through batched prefill, chunked prefill over a
cached prefix, and paged decode; and through LLM.generate with a small token budget (chunked
prefill by the scheduler)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import check_close, check_logprobs_close, greedy_run, hf_greedy

from fleetllm import LLM, SamplingParams
from fleetllm.config import EngineConfig
from fleetllm.executor import Executor

WINDOW = 20  # not a multiple of the block size: windows straddle blocks at any offset
NEW_TOKENS = 40


def make_mistral_checkpoint(path, seed: int = 3, **overrides):
    """A tiny random-weight MistralForCausalLM (conftest's make_checkpoint knows Llama and Qwen
    only); weights widened the same way so logits are not all near-equal."""
    import transformers

    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  head_dim=16, sliding_window=WINDOW)
    kwargs.update(overrides)
    config = transformers.MistralConfig(**kwargs)
    config.architectures = ["MistralForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_mistral_checkpoint(tmp_path_factory.mktemp("mistral") / "m")


@pytest.fixture(scope="module")
def hf(mistral):
    import transformers

    # eager: the reference implementation of the mask (kv > q - window and kv <= q)
    return transformers.MistralForCausalLM.from_pretrained(
        mistral, dtype=torch.float32, attn_implementation="eager").eval()


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (40, 57, 83, 120)]


@pytest.fixture(scope="module")
def reference(hf):
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def test_window_changes_hf_results(hf, reference):
    """The prompts exercise the window: without it, HF's own results differ."""
    hf.config.sliding_window = None
    try:
        full = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]
    finally:
        hf.config.sliding_window = WINDOW
    assert any(a[0] != b[0] for a, b in zip(full, reference, strict=True))


def test_max_model_len_is_not_capped_to_the_window(mistral):
    cfg = EngineConfig.from_kwargs(model=str(mistral))
    assert cfg.model_config.max_model_len == 1024


@pytest.mark.parametrize("chunk", [None, 13])
def test_prefill_and_decode_match_hf(mistral, reference, chunk):
    cfg = EngineConfig.from_kwargs(model=str(mistral), kv_cache_memory=16 << 20)
    with Executor.get_class(cfg)(cfg) as executor:
        executor.initialize_cache(*executor.determine_num_available_blocks())
        ours = greedy_run(executor, prompts(), NEW_TOKENS, chunk=chunk)
    for result, ref in zip(ours, reference, strict=True):
        check_close(result, ref, top=5, atol=1e-3)


def test_llm_with_small_token_budget_matches_hf(mistral, reference):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    with LLM(str(mistral), kv_cache_memory=16 << 20, block_size=8,
             max_num_batched_tokens=24) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                               use_tqdm=False)
    for out, (ref_tokens, ref_rows) in zip(outputs, reference, strict=True):
        [completion] = out.outputs
        lps = [{k: v.logprob for k, v in d.items()} for d in completion.logprobs]
        assert check_logprobs_close(completion.token_ids, lps, ref_tokens, ref_rows)
        for lp, row in zip(lps, ref_rows, strict=True):
            assert all(abs(v - row[k].item()) < 1e-3 for k, v in lp.items())
