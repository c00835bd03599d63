"""SharedStorageConnector with several workers (mp TP=2 and PP=2, ray TP=2): each rank stores
and loads its own shard, and a load that fails only on a rank that does not sample is seen
(the executor merges every rank's KVConnectorOutput) (issue 74)."""

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

MP_TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
MP_PP2 = dict(pipeline_parallel_size=2, distributed_executor_backend="mp")
RAY_TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="ray",
               ray_cpus_per_worker=0.5)


@pytest.mark.parametrize("layout, policy", [(MP_TP2, "recompute"), (MP_TP2, "fail"),
                                            (MP_PP2, "recompute"), (RAY_TP2, "fail")],
                         ids=["mp-tp2-recompute", "mp-tp2-fail", "mp-pp2-recompute",
                              "ray-tp2-fail"])
def test_ranks_store_their_shards_and_a_non_output_ranks_failure_is_seen(
        tiny_models, tmp_path, layout, policy):
    if layout["distributed_executor_backend"] == "ray":
        pytest.importorskip("ray")
    # The output rank (the last stage's first TP rank) samples; the other one only reports.
    quiet = 0 if layout.get("pipeline_parallel_size", 1) > 1 else 1
    model = tiny_models["llama_gqa"]
    prompts = prompts_sharing_prefixes(6, seed=7)
    with LLM(model, kv_cache_memory=KV, **layout) as llm:
        reference = greedy_tokens(llm, prompts)
    kt = store_config(tmp_path, policy)
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt, **layout) as llm:
        assert greedy_tokens(llm, prompts) == reference
    rank0, rank1 = block_files(tmp_path, 0), block_files(tmp_path, 1)
    assert len(rank0) == len(rank1) > 0
    assert [p.name.replace(".r0.", ".r1.") for p in rank0] == [p.name for p in rank1]
    # No local prefix cache: the second run below loads from the store again.
    with LLM(model, kv_cache_memory=KV, kv_transfer_config=kt, enable_prefix_caching=False,
             **layout) as llm:
        assert greedy_tokens(llm, prompts) == reference  # every block from the store
        stats = llm.llm_engine.kv_transfer_stats
        assert stats["blocks_loaded"] > 0 and stats["load_failures"] == 0
        # every rank's half counted: the whole model's 2 layers x 2 KV heads, float32
        assert stats["bytes_loaded"] == stats["blocks_loaded"] * 2 * 2 * 16 * 2 * 16 * 4
        for path in (rank0, rank1)[quiet]:  # the other rank's halves stay good
            damage(path, "flip")
        got = greedy_tokens(llm, prompts)
        stats = llm.llm_engine.kv_transfer_stats
        assert_no_leak(llm)
    assert stats["load_failures"] > 0
    if policy == "recompute":
        assert got == reference
    else:
        assert got.count(None) == stats["load_failures"]
        assert all(g == r for g, r in zip(got, reference, strict=True) if g is not None)
