"""Randomized differential test of structured outputs through the engine's recovery paths.

The workloads of test_random_workloads (random prompts, n, greedy/seeded/random sampling, a
small KV pool with recompute or swap preemption, prefix caching, aborts at random steps, and
executor faults: plain errors, worker crashes the engine recovers from by replacing its
workers, out-of-memory steps it retries smaller), with a share of the requests given a random
JSON schema, regex or choice. Checked against each request run alone with no faults, as there:
one terminal output each, identical tokens for greedy and seeded requests, no block leaked;
and here also: every grammar request that finished ("stop") satisfies its constraint, none
ended any other way than stop or its abort. (The grammar state lives on the engine's
Sequence, replayed from its tokens: a replaced worker, a recompute or a failed step leaves
nothing to repair; this test is what shows it.)

`make test` runs 25 workloads, `make soak` (--soak) 250; FLEETLLM_STRUCTURED_WORKLOADS=N runs
N; FLEETLLM_RANDOM_SEED / FLEETLLM_RANDOM_ONLY as in test_random_workloads.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from conftest import series_size
from structured_helpers import check_output, random_constraint
from workload_helpers import (
    check,
    check_blocks,
    draw_requests,
    engines,  # noqa: F401  (the module's fixture, shared)
    reference,
    run_workload,
)

from fleetllm import StructuredOutputsParams

ONLY = os.environ.get("FLEETLLM_RANDOM_ONLY")
SERIES = int(os.environ.get("FLEETLLM_RANDOM_SEED", "20261125"))

pytestmark = [pytest.mark.soak, pytest.mark.timeout(600)]


def constrain(rng: random.Random, reqs) -> None:
    """Give about half the requests a constraint: no stop strings (they would cut the output
    before the grammar completes), compact JSON (a random-weight model fills optional
    whitespace), room to complete or (max_tokens 40: the pool is sized from max_tokens, and a
    tight one preempts) not."""
    for req in reqs:
        if rng.random() < 0.5:
            continue
        so = random_constraint(rng)
        if so.json is not None:
            so = StructuredOutputsParams(json=so.json, disable_any_whitespace=True)
        req.params = dataclasses.replace(req.params, structured_outputs=so, stop=None,
                                         max_tokens=rng.choice([40, 300]), min_tokens=0,
                                         ignore_eos=rng.random() < 0.3)


def test_structured_outputs_survive_preemption_faults_and_restarts(engines, soak):  # noqa: F811
    totals = {"grammar requests": 0, "validated": 0, "preemptions": 0, "faults": 0,
              "restarts": 0}
    indices = [int(ONLY)] if ONLY else \
        range(series_size(soak, 25, 250, "FLEETLLM_STRUCTURED_WORKLOADS"))
    for index in indices:
        rng = random.Random(f"{SERIES}-structured-{index}")
        llm = engines[rng.choice([4, 16])]
        reqs = draw_requests(rng, index)
        constrain(rng, reqs)
        refs = {r.rid: reference(llm, r) for r in reqs}
        scheduler, faults, *_ = run_workload(llm, reqs, rng)
        for req in reqs:
            check(req, refs[req.rid], scheduler)
            so = req.params.structured_outputs
            if so is None:
                continue
            totals["grammar requests"] += 1
            finished = [o for _, o in req.outputs if o is not None and o.finished]
            for c in (finished[0].outputs if finished else []):
                if req.aborted_at is None and len(c.token_ids) < req.params.max_tokens:
                    assert c.finish_reason == "stop", (req.rid, c.finish_reason, c.text)
                if c.finish_reason == "stop":
                    check_output(so, c.text)
                    totals["validated"] += 1
        bm = scheduler.block_manager
        check_blocks(bm)
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks, "device blocks leaked"
        assert not llm.llm_engine.seq_groups
        totals["preemptions"] += scheduler.num_preemptions
        totals["faults"] += faults
        totals["restarts"] += llm.llm_engine.worker_restarts
    print(f"{len(indices)} workloads: {totals}")
    if not ONLY:
        assert all(totals.values()), totals
