"""The request-level flow of disaggregated prefill/decode (vLLM's kv_transfer_params), in one
process: a kv_producer's prefill leg (max_tokens=1, do_remote_decode) stores the prompt's KV
and returns the params; a kv_consumer's decode leg given them loads that KV (required: a
missing block applies kv_load_failure_policy) and samples what one instance would (issue 74)."""

from __future__ import annotations

import pytest
from kv_transfer_helpers import KV, assert_no_leak, block_files, store_config

from fleetllm import LLM, SamplingParams

BS = 16
PROMPTS = [list(range(3, 100)), [7] * 40 + list(range(50, 120))]  # 6 and 6 whole blocks
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


def role(store, kv_role: str, policy: str = "recompute") -> dict:
    return {**store_config(store, policy), "kv_role": kv_role}


def params(max_tokens: int, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0 if seed is None else 0.8, seed=seed,
                          max_tokens=max_tokens, ignore_eos=True, **kw)


def prefill(model, store, prompts) -> list[dict]:
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=role(store, "kv_producer")) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            params(1, kv_transfer_params=dict(PREFILL)))
        assert_no_leak(llm)
    return [o.kv_transfer_params for o in outs]


def decode(model, store, prompts, answers, policy="recompute", seed=None):
    with LLM(model, kv_cache_memory=KV,
             kv_transfer_config=role(store, "kv_consumer", policy)) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], params(8, seed, kv_transfer_params=a))[0]
                for p, a in zip(prompts, answers, strict=True)]
        stats = llm.llm_engine.kv_transfer_stats
        assert_no_leak(llm)
    return outs, stats


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_prefill_then_decode_gives_one_instances_tokens(model, tmp_path, seed):
    with LLM(model, kv_cache_memory=KV) as one:
        reference = [o.outputs[0].token_ids for o in one.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params(8, seed))]
    answers = prefill(model, tmp_path, PROMPTS)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
        assert len(answer["remote_block_ids"]) == len(prompt) // BS
        assert {"remote_engine_id", "remote_host", "remote_port"} <= set(answer)
    outs, stats = decode(model, tmp_path, PROMPTS, answers, seed=seed)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.kv_transfer_params is None for o in outs)  # a consumer keeps nothing
    loaded = sum((len(p) - 1) // BS for p in PROMPTS)
    assert stats["blocks_loaded"] == loaded and stats["load_failures"] == 0
    assert stats["prompt_tokens_computed"] == sum(map(len, PROMPTS)) - loaded * BS


def test_a_request_without_do_remote_decode_returns_no_params(model, tmp_path):
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=role(tmp_path, "kv_producer")) as llm:
        [out] = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params(1))
    assert out.kv_transfer_params is None


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_missing_block_on_the_decode_leg_applies_the_policy(model, tmp_path, policy):
    answers = prefill(model, tmp_path, PROMPTS[:1])
    files = block_files(tmp_path)
    assert len(files) == len(PROMPTS[0]) // BS
    files[2].unlink()  # evicted, or never arrived
    with LLM(model, kv_cache_memory=KV) as one:
        [ref] = one.generate([{"prompt_token_ids": PROMPTS[0]}], params(8))
    [out], stats = decode(model, tmp_path, PROMPTS[:1], answers, policy)
    assert stats["load_failures"] == 1
    if policy == "fail":
        assert out.outputs[0].finish_reason == "error" and "could not be loaded" in out.error
    else:
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_the_decode_leg_loads_required_blocks_even_when_absent_at_admission(model, tmp_path):
    """Not a cache lookup: without the files the consumer still expects them (and fails),
    where a plain request would silently compute the prompt."""
    answers = prefill(model, tmp_path, PROMPTS[:1])
    for f in block_files(tmp_path):
        f.unlink()
    [out], stats = decode(model, tmp_path, PROMPTS[:1], answers, "fail")
    assert out.outputs[0].finish_reason == "error"
    [plain], _ = decode(model, tmp_path, PROMPTS[:1], [None], "fail")
    assert plain.outputs[0].finish_reason == "length"


def test_past_the_producers_blocks_the_decode_leg_takes_what_the_store_holds(model, tmp_path):
    """A producer that stored fewer blocks than the store holds (a kv_both prefill leg that
    loaded its prefix lists none): the rest is looked up as for any prompt."""
    answers = prefill(model, tmp_path, PROMPTS[:1])
    fewer = {**answers[0], "remote_block_ids": answers[0]["remote_block_ids"][:2]}
    with LLM(model, kv_cache_memory=KV) as one:
        [ref] = one.generate([{"prompt_token_ids": PROMPTS[0]}], params(8))
    [out], stats = decode(model, tmp_path, PROMPTS[:1], [fewer])
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert stats["blocks_loaded"] == (len(PROMPTS[0]) - 1) // BS


def test_kv_transfer_params_must_be_an_object():
    from fleetllm.errors import ConfigurationError

    for bad in ([1], "do_remote_decode", {1: True}):
        with pytest.raises(ConfigurationError, match="kv_transfer_params"):
            SamplingParams(kv_transfer_params=bad)
