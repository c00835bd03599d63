"""Randomized differential test of the scheduler, block manager and engine.

Each workload draws requests (prompts of 1-300 tokens often sharing prefixes, n 1-4, greedy,
seeded or unseeded, stop strings, prompt logprobs), an engine shape (token and sequence
budgets, a KV pool from barely enough up, recompute or swap, block size 4 or 16, prefix
caching, a fifth each with n-gram/draft-model speculation or multi-step), aborts at random
steps and executor faults (errors, crashes, OOM steps). Against each request run alone it
checks: one terminal output each and nothing after; greedy and seeded tokens identical (but at
logprob ties within TIE); text only grows; prompt logprobs match; after every step each block
is free, evictable or owned exactly as the tables say, and at the end none is owned; shared
prefixes are found; no exception escapes but the injected ones; with multi-step, aborts and
interrupts inside a call, and greedy_passes.py's lean path taken now and then.
`make test` runs 60 workloads, `make soak` (--soak) 800; FLEETLLM_RANDOM_WORKLOADS=N runs N,
FLEETLLM_RANDOM_SEED picks another series, FLEETLLM_RANDOM_ONLY=index replays one workload.
"""

from __future__ import annotations

import os
import random

import pytest
from conftest import series_size
from workload_helpers import (
    check,
    check_blocks,
    draw_requests,
    engines,  # noqa: F401  (the module's fixture)
    reference,
    run_workload,
)

ONLY = os.environ.get("FLEETLLM_RANDOM_ONLY")
SERIES = int(os.environ.get("FLEETLLM_RANDOM_SEED", "20261123"))


pytestmark = pytest.mark.soak


def test_random_workloads_match_requests_run_alone(engines, soak):  # noqa: F811
    totals = {"requests": 0, "preemptions": 0, "faults": 0, "restarts": 0, "aborted": 0,
              "prefix_hit_tokens": 0, "mid_call_aborts": 0, "greedy_passes": 0}
    indices = [int(ONLY)] if ONLY else \
        range(series_size(soak, 60, 800, "FLEETLLM_RANDOM_WORKLOADS"))
    multi_step_calls = 0
    for index in indices:
        rng = random.Random(f"{SERIES}-{index}")
        kind = rng.choice([4, 16, "spec", "draft", "multi-step"])
        llm = engines[kind]
        reqs = draw_requests(rng, index)
        refs = {r.rid: reference(engines[4] if isinstance(kind, str) else llm, r)
                for r in reqs}
        scheduler, faults, multi, mid_call = run_workload(llm, reqs, rng)
        for req in reqs:
            check(req, refs[req.rid], scheduler)
        bm = scheduler.block_manager
        check_blocks(bm)
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks, "device blocks leaked"
        assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, "CPU blocks leaked"
        assert not bm.block_tables and not bm.cpu_tables
        if bm.prefix_cache:
            totals["prefix_hit_tokens"] += bm.prefix_cache.hit_tokens
        totals["requests"] += len(reqs)
        totals["preemptions"] += scheduler.num_preemptions
        totals["faults"] += faults
        totals["restarts"] += llm.llm_engine.worker_restarts
        totals["aborted"] += sum(r.aborted_at is not None for r in reqs)
        multi_step_calls += multi
        totals["mid_call_aborts"] += mid_call[0]
        totals["greedy_passes"] += mid_call[1]  # multi-step's lean path (greedy_passes.py)
    spec = engines["spec"].llm_engine.spec_decode_metrics
    totals["spec_accepted_tokens"] = spec.accepted_tokens if spec else 0
    draft = engines["draft"].llm_engine.spec_decode_metrics
    totals["draft_accepted_tokens"] = draft.accepted_tokens if draft else 0
    totals["multi_step_calls"] = multi_step_calls
    print(f"{len(indices)} workloads: {totals}")
    if not ONLY:  # the series must exercise what it claims to
        assert all(totals.values()), totals
