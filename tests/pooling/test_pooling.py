"""Pooling models offline (issue #21, acceptance 1 and 2): `LLM.embed` / `encode` / `score`.

Every vector is checked against Hugging Face `AutoModel` (float32 last hidden state, pooled
LAST / MEAN / CLS, truncated, normalized; pooling_helpers.hf_embedding) on tiny random-weight
bare `LlamaModel`, `Qwen2Model` (q/k/v bias), `Qwen3Model` (q/k norm) checkpoints and a
`LlamaForCausalLM` run with task="embed": cosine >= 0.99999 and close values, on `uni` for
every pooling type with normalize on and off, and on `mp` TP=2, `mp` PP=2 and `ray` (one LLM
each: they take seconds to start). Sentence-transformers directories built here (as the
installed library saves them, and in the older hub layout) must give what
`SentenceTransformer(dir).encode` gives, with the pooler read from the checkpoint. Also: score
is the embeddings' cosine, Matryoshka `dimensions`, task resolution and the errors for the
wrong task, a too-long input, an unsupported sentence-transformers module.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from pooling_helpers import (
    assert_same_vector,
    cosine,
    hf_embedding,
    make_legacy_st_checkpoint,
    make_model_checkpoint,
    make_st_checkpoint,
    st_encode,
)

from fleetllm import LLM, SamplingParams
from fleetllm.errors import ConfigurationError, InvalidRequestError
from fleetllm.pooling_params import PoolingParams

pytestmark = pytest.mark.timeout(300)

ARCHS = ("LlamaModel", "Qwen2Model", "Qwen3Model", "LlamaForCausalLM")
MATRYOSHKA = [16, 32]  # in the Qwen3Model checkpoint's config.json
# 1 token, a block of 16 exactly, one token over it, several blocks
LENGTHS = (1, 5, 16, 17, 48, 130)
TEXT = "def fibonacci(n):\n    return n"


def token_prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in LENGTHS]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    paths = {arch: make_model_checkpoint(
        root / arch, arch, seed=i,
        extra_config={"matryoshka_dimensions": MATRYOSHKA} if arch == "Qwen3Model" else None)
        for i, arch in enumerate(ARCHS)}
    return paths


def check_outputs(outputs, prompts, path, pooling_type: str, normalize: bool,
                  dimensions: int | None = None) -> None:
    """Every output (encode's or embed's) is finished, error-free, the reference's vector."""
    assert len(outputs) == len(prompts)
    for out, prompt in zip(outputs, prompts, strict=True):
        assert out.finished and out.error is None, out.error
        if isinstance(prompt, dict):
            assert out.prompt_token_ids == prompt["prompt_token_ids"]
        vector = out.outputs.embedding if hasattr(out.outputs, "embedding") else out.outputs.data
        want = hf_embedding(path, out.prompt_token_ids, pooling_type, normalize, dimensions)
        assert_same_vector(vector, want, f"{pooling_type} normalize={normalize} "
                           f"{len(out.prompt_token_ids)} tokens", normalized=normalize)


# ------------------------------------------------------------------------- parity: uni


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_uni_matches_hf_for_every_pooling_type(ckpts, arch, pooling_type):
    # normalize from the override alternates over the grid; each request flips it too, so
    # every (type, normalize) pair is checked through both the engine and the request setting
    normalize = (ARCHS.index(arch) + ["LAST", "MEAN", "CLS"].index(pooling_type)) % 2 == 0
    prompts = [*token_prompts(ARCHS.index(arch)), TEXT]
    with LLM(ckpts[arch], task="embed", override_pooler_config={
            "pooling_type": pooling_type, "normalize": normalize}) as llm:
        cfg = llm.llm_engine.model_config
        assert (cfg.task, cfg.pooler_config.pooling_type, cfg.pooler_config.normalize) == \
            ("embed", pooling_type, normalize)
        check_outputs(llm.embed(prompts, use_tqdm=False), prompts, ckpts[arch], pooling_type,
                      normalize)
        check_outputs(llm.encode(prompts, PoolingParams(normalize=not normalize),
                                 use_tqdm=False), prompts, ckpts[arch], pooling_type,
                      not normalize)


def test_encode_returns_the_tensor_and_embed_the_same_as_floats(ckpts):
    path = ckpts["Qwen2Model"]
    with LLM(path) as llm:  # task auto: a bare XModel embeds, LAST + normalize by default
        assert llm.llm_engine.model_config.task == "embed"
        [pooled] = llm.encode(TEXT, use_tqdm=False)
        [embedded] = llm.embed(TEXT, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    assert isinstance(pooled.outputs.data, torch.Tensor)
    assert pooled.outputs.data.dtype == torch.float32 and pooled.outputs.data.shape == (64,)
    assert pooled.prompt_token_ids == tokenizer.encode(TEXT) and pooled.finished
    assert isinstance(embedded.outputs.embedding, list) and embedded.outputs.hidden_size == 64
    assert embedded.outputs.embedding == pooled.outputs.data.tolist()
    assert_same_vector(pooled.outputs.data, hf_embedding(path, tokenizer.encode(TEXT), "LAST",
                                                         True), "default pooler", True)


# ------------------------------------------------------------- parity: mp TP/PP and ray

DISTRIBUTED = {
    # backend kwargs, checkpoint, pooling type, normalize
    "mp-tp2": (dict(tensor_parallel_size=2), "Qwen2Model", "MEAN", False),
    "mp-pp2": (dict(pipeline_parallel_size=2), "Qwen3Model", "CLS", True),
    "ray-tp2": (dict(tensor_parallel_size=2, distributed_executor_backend="ray",
                     ray_cpus_per_worker=0.5), "LlamaForCausalLM", "LAST", True),
}


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_backends_match_hf(ckpts, name):
    if name.startswith("ray"):
        pytest.importorskip("ray")
    kwargs, arch, pooling_type, normalize = DISTRIBUTED[name]
    prompts = [*token_prompts(7), TEXT]
    with LLM(ckpts[arch], task="embed", max_num_seqs=4, override_pooler_config={
            "pooling_type": pooling_type, "normalize": normalize}, **kwargs) as llm:
        check_outputs(llm.encode(prompts, use_tqdm=False), prompts, ckpts[arch],
                      pooling_type, normalize)
        check_outputs(llm.embed(prompts, PoolingParams(normalize=not normalize),
                                use_tqdm=False), prompts, ckpts[arch], pooling_type,
                      not normalize)


# ------------------------------------------------------------------- score, Matryoshka


def test_score_is_the_cosine_of_the_embeddings(ckpts):
    texts = ["def f(x):", "import os", "hello world", "x"]
    with LLM(ckpts["Qwen3Model"], task="embed",
             override_pooler_config={"normalize": False}) as llm:  # cosine, not a dot product
        vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
        one = llm.score(texts[0], texts[1], use_tqdm=False)
        one_to_n = llm.score(texts[0], texts[1:], use_tqdm=False)
        n_to_n = llm.score(texts[:2], texts[2:], use_tqdm=False)
        with pytest.raises(InvalidRequestError):
            llm.score(texts[:2], texts[1:], use_tqdm=False)  # 2 against 3
    assert [len(one), len(one_to_n), len(n_to_n)] == [1, 3, 2]
    pairs = [(0, 1), (0, 1), (0, 2), (0, 3), (0, 2), (1, 3)]
    for out, (a, b) in zip(one + one_to_n + n_to_n, pairs, strict=True):
        assert abs(out.outputs.score - cosine(vectors[a], vectors[b])) < 1e-6, (a, b)
    assert len({round(o.outputs.score, 6) for o in one_to_n}) == 3  # not one constant


def test_matryoshka_dimensions_truncate_then_normalize(ckpts, tmp_path):
    path = ckpts["Qwen3Model"]
    prompts = token_prompts(3)
    with LLM(path, task="embed", override_pooler_config={"pooling_type": "MEAN"}) as llm:
        for dims in MATRYOSHKA:
            check_outputs(llm.embed(prompts, PoolingParams(dimensions=dims), use_tqdm=False),
                          prompts, path, "MEAN", True, dims)
        check_outputs(llm.encode(prompts, PoolingParams(dimensions=16, normalize=False),
                                 use_tqdm=False), prompts, path, "MEAN", False, 16)
        for bad in (8, 65):  # not listed; wider than the model
            [out] = llm.embed(prompts[1], PoolingParams(dimensions=bad), use_tqdm=False)
            assert out.error and "dimensions" in out.error and not out.outputs.embedding
            with pytest.raises(InvalidRequestError, match="dimensions"):
                llm.llm_engine.add_request("bad", prompts[1], PoolingParams(dimensions=bad))
    with LLM(ckpts["LlamaModel"], task="embed") as llm:  # no matryoshka_dimensions
        with pytest.raises(InvalidRequestError, match="dimensions"):
            llm.llm_engine.add_request("bad", prompts[1], PoolingParams(dimensions=16))
        assert llm.embed(prompts[1], PoolingParams(dimensions=16), use_tqdm=False)[0].error
    # is_matryoshka: true allows any width up to the hidden size
    any_width = make_model_checkpoint(tmp_path / "m", "LlamaModel", seed=5,
                                      extra_config={"is_matryoshka": True})
    with LLM(any_width, task="embed") as llm:
        check_outputs(llm.embed(prompts, PoolingParams(dimensions=24), use_tqdm=False),
                      prompts, any_width, "LAST", True, 24)


# --------------------------------------------------------- tasks, limits and refusals


def test_the_wrong_task_is_refused_naming_it(ckpts):
    prompt = token_prompts()[2]
    with LLM(ckpts["LlamaModel"], task="embed") as llm:
        with pytest.raises(InvalidRequestError, match="embed"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="embed"):
            llm.llm_engine.add_request("g", prompt, SamplingParams(max_tokens=2))
        assert not llm.llm_engine.has_unfinished_requests()
    with LLM(ckpts["LlamaForCausalLM"]) as llm:  # task auto: a causal LM generates
        assert llm.llm_engine.model_config.task == "generate"
        for call in (llm.embed, llm.encode):
            with pytest.raises(InvalidRequestError, match="embed"):
                call(prompt, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="embed"):
            llm.score("a", "b", use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="generate"):
            llm.llm_engine.add_request("p", prompt, PoolingParams())
        [out] = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2  # still generates


@pytest.mark.parametrize("kwargs", [dict(task="auto"), dict(task="embedding"),
                                    dict(runner="pooling"), dict(task="generate")])
def test_task_resolution(ckpts, kwargs):
    if kwargs.get("task") == "generate":  # a bare XModel has no LM head
        with pytest.raises(ConfigurationError, match="embed"):
            LLM(ckpts["Qwen2Model"], **kwargs)
        return
    with LLM(ckpts["Qwen2Model"], pooler_config={"pooling_type": "CLS"}, **kwargs) as llm:
        cfg = llm.llm_engine.model_config
        assert cfg.task == "embed" and cfg.pooler_config.pooling_type == "CLS"
        assert cfg.pooler_config.normalize  # the fields the override leaves out: defaults


def test_an_input_over_max_model_len_gets_an_error_and_the_rest_complete(ckpts):
    path = ckpts["LlamaModel"]
    prompts = token_prompts(5)  # the longest has 130 tokens
    with LLM(path, task="embed", max_model_len=64) as llm:
        outs = llm.embed(prompts, use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        ids = prompt["prompt_token_ids"]
        if len(ids) > 64:
            assert out.error and "max_model_len" in out.error and not out.outputs.embedding
        else:
            assert out.error is None
            assert_same_vector(out.outputs.embedding, hf_embedding(path, ids, "LAST", True),
                               f"{len(ids)} tokens", normalized=True)
    assert sum(o.error is not None for o in outs) == 1


# --------------------------------------------------------------- sentence-transformers

ST_TEXTS = ["def fibonacci(n):", "x", "The quick brown fox jumps over the lazy dog. " * 3,
            "import os\nimport sys\n", "hello world, hello engine!"]


@pytest.mark.parametrize("layout,pooling_type,normalize", [
    ("saved", "MEAN", True), ("saved", "MEAN", False), ("saved", "LAST", True),
    ("saved", "LAST", False), ("saved", "CLS", True),
    ("legacy", "LAST", True), ("legacy", "MEAN", False), ("legacy", "CLS", False)])
def test_sentence_transformers_checkpoint_matches_the_library(ckpts, tmp_path, layout,
                                                              pooling_type, normalize):
    make = make_st_checkpoint if layout == "saved" else make_legacy_st_checkpoint
    path = make(ckpts["Qwen2Model"], tmp_path / "st", pooling_type, normalize)
    if layout == "saved":  # what the test relies on the library writing
        assert (path / "modules.json").is_file() and (path / "1_Pooling/config.json").is_file()
        assert (path / "sentence_bert_config.json").is_file()
        assert (path / "model.safetensors").is_file()
        assert not list(path.glob("*.bin")) and not list(path.glob("*.pt"))
    want = st_encode(path, ST_TEXTS)
    with LLM(path) as llm:  # task auto (modules.json), no override: the pooler is read
        cfg = llm.llm_engine.model_config
        assert (cfg.task, cfg.pooler_config.pooling_type, cfg.pooler_config.normalize) == \
            ("embed", pooling_type, normalize)
        if layout == "legacy":  # sentence_bert_config.json's max_seq_length
            assert cfg.max_model_len == 512
        outs = llm.embed(ST_TEXTS, use_tqdm=False)
    for out, text, vector in zip(outs, ST_TEXTS, want, strict=True):
        assert out.error is None, out.error
        assert_same_vector(out.outputs.embedding, vector, f"{layout} {pooling_type} {text!r}",
                           normalized=normalize)


@pytest.mark.parametrize("layout", ["saved", "legacy"])
def test_a_dense_module_is_refused_naming_it(ckpts, tmp_path, layout):
    path = tmp_path / "st"
    if layout == "saved":
        make_st_checkpoint(ckpts["Qwen2Model"], path, "MEAN", True, dense=True)
    else:
        make_legacy_st_checkpoint(ckpts["Qwen2Model"], path, "MEAN", True)
        modules = json.loads((path / "modules.json").read_text())
        modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                           "type": "sentence_transformers.models.Dense"})
        (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigurationError, match="Dense"):
        LLM(path)
