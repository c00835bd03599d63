"""SharedStorageConnector end to end on one worker: a prefix cache that outlives the instance,
shared by instances, never read by an incompatible one, safe against damaged files, capped
(issue 74)."""

from __future__ import annotations

import pytest
from kv_transfer_helpers import (
    KV,
    assert_no_leak,
    block_files,
    damage,
    greedy_tokens,
    prompts_sharing_prefixes,
    store_config,
)

from fleetllm import LLM

BS = 16


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def prompts():
    return prompts_sharing_prefixes(8, seed=3)


@pytest.fixture(scope="module")
def reference(model, prompts):
    with LLM(model, kv_cache_memory=KV) as llm:
        return greedy_tokens(llm, prompts)


def stored_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS  # whole blocks, the last token left to compute


def test_a_restarted_instance_computes_only_what_the_store_lacks(model, prompts, reference,
                                                                 tmp_path):
    kt = store_config(tmp_path)
    # no local prefix cache: every block not computed comes from the store
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt,
             enable_prefix_caching=False) as first:
        assert greedy_tokens(first, prompts) == reference
        stats = first.llm_engine.kv_transfer_stats
        assert stats["blocks_loaded"] == 0
        assert stats["prompt_tokens_computed"] == sum(map(len, prompts))
    distinct = {tuple(p[:(i + 1) * BS]) for p in prompts for i in range(len(p) // BS)}
    assert len(block_files(tmp_path)) == len(distinct) == stats["blocks_saved"]
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt,
             enable_prefix_caching=False) as second:
        assert greedy_tokens(second, prompts) == reference
        stats = second.llm_engine.kv_transfer_stats
        assert_no_leak(second)
    loaded = sum(stored_blocks(p) for p in prompts)
    assert stats["blocks_loaded"] == loaded and stats["blocks_saved"] == 0
    # 2 layers x (K, V) x 16 slots x 2 KV heads x 16 dims, float32
    assert stats["bytes_loaded"] == loaded * 2 * 2 * BS * 2 * 16 * 4
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts)) - loaded * BS
    assert stats["load_failures"] == 0


def test_two_instances_share_one_store(model, prompts, reference, tmp_path):
    kt = store_config(tmp_path)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt) as a, \
            LLM(model, kv_cache_memory=KV, kv_transfer_config=kt) as b:
        assert greedy_tokens(a, prompts[:4]) == reference[:4]
        assert greedy_tokens(b, prompts) == reference  # reads what a wrote, writes the rest
        assert b.llm_engine.kv_transfer_stats["blocks_loaded"] > 0
        assert greedy_tokens(a, prompts[4:]) == reference[4:]  # reads what b wrote
        assert a.llm_engine.kv_transfer_stats["blocks_loaded"] > 0
        assert_no_leak(a)
        assert_no_leak(b)


@pytest.mark.parametrize("change", [{"block_size": 32}, {"dtype": "bfloat16"},
                                    {"kv_cache_dtype": "bfloat16"}])
def test_an_incompatible_instance_never_reads_the_store(model, prompts, tmp_path, change):
    kt = store_config(tmp_path)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt) as llm:
        greedy_tokens(llm, prompts)
    before = set(block_files(tmp_path))
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt, **change) as other:
        greedy_tokens(other, prompts)
        stats = other.llm_engine.kv_transfer_stats
    assert stats["blocks_loaded"] == 0 and stats["blocks_saved"] > 0
    assert before < set(block_files(tmp_path))  # its own files, in its own directory
    assert {p.parent.parent for p in before}.isdisjoint(
        {p.parent.parent for p in set(block_files(tmp_path)) - before})


@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_damaged_blocks_are_recomputed_or_fail_their_request(model, prompts, reference,
                                                             tmp_path, how, policy):
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=store_config(tmp_path)) as llm:
        greedy_tokens(llm, prompts)
    files = block_files(tmp_path)
    for path in files[::3]:
        damage(path, how)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=store_config(tmp_path, policy),
             enable_prefix_caching=True) as llm:
        got = greedy_tokens(llm, prompts)
        stats = llm.llm_engine.kv_transfer_stats
        assert stats["load_failures"] > 0
        assert_no_leak(llm)
        if policy == "recompute":
            assert got == reference
        else:
            assert got.count(None) == stats["load_failures"]
            assert all(g == r for g, r in zip(got, reference, strict=True) if g is not None)
        # The damaged files were deleted and the bad blocks never entered the prefix cache:
        # the same prompts again (local cache hits, re-saved blocks) answer as the reference.
        assert greedy_tokens(llm, prompts) == reference
        assert_no_leak(llm)


def test_the_store_stays_under_its_cap(model, tmp_path):
    prompts = prompts_sharing_prefixes(12, seed=5, prefixes=12)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=store_config(tmp_path)) as llm:
        greedy_tokens(llm, prompts[:1])
    one = block_files(tmp_path)[0].stat().st_size
    for path in block_files(tmp_path):
        path.unlink()
    cap = 5 * one
    with LLM(model, kv_cache_memory=KV,
             kv_transfer_config=store_config(tmp_path, max_bytes=cap)) as llm:
        for prompt in prompts:  # one at a time: the cap holds after every step
            greedy_tokens(llm, [prompt])
            assert sum(p.stat().st_size for p in block_files(tmp_path)) <= cap
        assert llm.llm_engine.kv_transfer_stats["blocks_saved"] > 5


def test_a_producer_only_writes_and_a_consumer_only_reads(model, prompts, reference,
                                                          tmp_path):
    def role(name: str) -> dict:
        return {**store_config(tmp_path), "kv_role": name}

    with LLM(model, kv_cache_memory=KV, kv_transfer_config=role("kv_consumer")) as llm:
        assert greedy_tokens(llm, prompts) == reference
    assert block_files(tmp_path) == []
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=role("kv_producer")) as llm:
        greedy_tokens(llm, prompts)
        greedy_tokens(llm, prompts)  # its own blocks: local prefix-cache hits, never the store
        assert llm.llm_engine.kv_transfer_stats["blocks_loaded"] == 0
    written = block_files(tmp_path)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=role("kv_consumer"),
             enable_prefix_caching=False) as llm:
        assert greedy_tokens(llm, prompts) == reference
        assert llm.llm_engine.kv_transfer_stats["blocks_loaded"] > 0
    assert block_files(tmp_path) == written


def test_a_step_that_fails_before_its_loads_loads_them_again(model, prompts, reference,
                                                            tmp_path):
    from fleetllm.worker.faults import inject_fault

    kt = store_config(tmp_path)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt) as llm:
        greedy_tokens(llm, prompts)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt) as llm:
        # out of memory in the first step, before the workers load anything: the engine
        # retries with a smaller budget, and the groups admitted with loads load again
        inject_fault(llm.llm_engine.model_executor, rank=0, kind="oom", at_call=1)
        assert greedy_tokens(llm, prompts) == reference
        stats = llm.llm_engine.kv_transfer_stats
        assert stats["load_failures"] == 0
        assert stats["blocks_loaded"] > sum((len(p) - 1) // 16 for p in prompts[:1])
        assert_no_leak(llm)
