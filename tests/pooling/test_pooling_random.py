"""Randomized differential test of pooling requests through LLMEngine.step().

Each workload draws an engine shape (token budget, max_num_seqs, max_model_len, pooling type,
normalize) and requests (prompts of 1-200 tokens, random PoolingParams, some late, some
aborted, some invalid), steps until nothing is left and checks, against Hugging Face AutoModel
per request (pooling_helpers.hf_embedding): exactly the invalid requests are refused
(InvalidRequestError, nothing queued); every other one not aborted gets one finished output
with the reference's vector, an aborted one nothing after its abort; no block leaks; over the
series steps batched several requests and requests waited for room.
`make test` runs 60 workloads, `make soak` (--soak) 600; FLEETLLM_POOLING_WORKLOADS=N runs N;
FLEETLLM_RANDOM_SEED picks another series; FLEETLLM_RANDOM_ONLY=i replays workload i.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
from conftest import series_size
from pooling_helpers import assert_same_vector, hf_embedding, make_model_checkpoint
from workload_helpers import check_blocks

from fleetllm import LLM
from fleetllm.engine.outputs import PoolingRequestOutput
from fleetllm.errors import InvalidRequestError
from fleetllm.pooling_params import PoolingParams

ONLY = os.environ.get("FLEETLLM_RANDOM_ONLY")
SERIES = int(os.environ.get("FLEETLLM_RANDOM_SEED", "20261125"))
VOCAB, HIDDEN, MATRYOSHKA = 512, 64, [16, 32]

pytestmark = [pytest.mark.soak, pytest.mark.timeout(300)]


@dataclass
class Req:
    rid: str
    token_ids: list[int]
    params: PoolingParams
    add_at: int
    abort_at: int | None
    valid: bool
    outputs: list = field(default_factory=list)  # (step, output)


@dataclass
class Shape:
    budget: int
    max_num_seqs: int
    max_model_len: int
    pooling_type: str
    normalize: bool


def draw(rng: random.Random, index: int) -> tuple[Shape, list[Req]]:
    shape = Shape(rng.choice([128, 200, 256, 320]), rng.choice([1, 2, 4, 4, 8]),
                  rng.choice([150, 1024, 1024]), rng.choice(["LAST", "MEAN", "CLS"]),
                  rng.random() < 0.5)
    limit = min(shape.budget, shape.max_model_len)
    reqs = []
    for i in range(rng.randint(1, 12)):
        n = rng.choice([rng.randint(1, 20), rng.randint(1, 80), rng.randint(1, 200)])
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        kind = rng.random()
        if kind < 0.05:
            ids = []
        elif kind < 0.1:
            ids[rng.randrange(n)] = VOCAB + rng.randrange(100)
        dims = rng.choice([None, None, None, 16, 32, 8])
        params = PoolingParams(dimensions=dims, normalize=rng.choice([None, None, True, False]))
        valid = 1 <= len(ids) <= limit and max(ids, default=0) < VOCAB and \
            dims in (None, *MATRYOSHKA)
        add_at = 0 if rng.random() < 0.7 else rng.randint(1, 6)
        abort_at = rng.randint(add_at, add_at + 6) if rng.random() < 0.2 else None
        reqs.append(Req(f"w{index}-r{i}", ids, params, add_at, abort_at, valid))
    return shape, reqs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_checkpoint(tmp_path_factory.mktemp("poolrand") / "qwen3", "Qwen3Model",
                                 seed=11, extra_config={"matryoshka_dimensions": MATRYOSHKA})


def run(llm: LLM, reqs: list[Req], stats: dict) -> None:
    engine = llm.llm_engine
    scheduler = engine.scheduler
    bm, execute = scheduler.block_manager, engine.model_executor.execute_model

    def counting(request):  # blocks held while a step runs: the leak check checks something
        stats["blocks_held"] = max(stats["blocks_held"],
                                   bm.num_gpu_blocks - bm.num_free_gpu_blocks)
        return execute(request)

    engine.model_executor.execute_model = counting
    try:
        _steps(engine, reqs, stats)
    finally:
        engine.model_executor.__dict__.pop("execute_model", None)


def _steps(engine, reqs: list[Req], stats: dict) -> None:
    scheduler = engine.scheduler
    step = 0
    while step <= max(r.add_at for r in reqs) or engine.has_unfinished_requests():
        for req in reqs:
            if req.add_at == step:
                try:
                    engine.add_request(req.rid, {"prompt_token_ids": req.token_ids},
                                       req.params)
                except InvalidRequestError:
                    assert not req.valid, f"{req.rid}: refused"
                    req.outputs.append((step, None))
                    assert req.rid not in engine.seq_groups
                else:
                    assert req.valid, f"{req.rid}: accepted"
            if req.abort_at == step:
                engine.abort_request(req.rid)
        outs = engine.step()
        stats["max_batch"] = max(stats["max_batch"], len(outs))
        stats["waited"] += bool(outs) and bool(scheduler.waiting)
        by_id = {r.rid: r for r in reqs}
        for out in outs:
            by_id[out.request_id].outputs.append((step, out))
        check_blocks(scheduler.block_manager)
        step += 1
        assert step < 500, "no progress"


def check(req: Req, shape: Shape, path) -> bool:
    """Checks one request; returns whether it was aborted before it finished."""
    if not req.valid:
        assert [o for _, o in req.outputs] == [None], f"{req.rid}: outputs of a refused one"
        return False
    assert len(req.outputs) <= 1, f"{req.rid}: {len(req.outputs)} outputs"
    if req.abort_at is not None:
        assert all(step < req.abort_at for step, _ in req.outputs), f"{req.rid}: after abort"
        if not req.outputs:
            return True
    assert len(req.outputs) == 1, f"{req.rid}: no output"
    [(_, out)] = req.outputs
    assert isinstance(out, PoolingRequestOutput) and out.finished, req.rid
    assert out.error is None, f"{req.rid}: {out.error}"
    assert out.prompt_token_ids == req.token_ids
    normalize = shape.normalize if req.params.normalize is None else req.params.normalize
    want = hf_embedding(path, req.token_ids, shape.pooling_type, normalize,
                        req.params.dimensions)
    assert_same_vector(out.outputs.data, want, f"{req.rid} ({len(req.token_ids)} tokens, "
                       f"{shape}, {req.params})", normalized=normalize)
    return False


def test_random_pooling_workloads_match_requests_run_alone(model, soak):
    stats = {"requests": 0, "invalid": 0, "aborted_unfinished": 0, "max_batch": 0,
             "waited": 0, "blocks_held": 0}
    indices = [int(ONLY)] if ONLY else \
        range(series_size(soak, 60, 600, "FLEETLLM_POOLING_WORKLOADS"))
    for index in indices:
        rng = random.Random(f"{SERIES}-{index}")
        shape, reqs = draw(rng, index)
        with LLM(model, task="embed", max_num_batched_tokens=shape.budget,
                 max_num_seqs=shape.max_num_seqs, max_model_len=shape.max_model_len,
                 override_pooler_config={"pooling_type": shape.pooling_type,
                                         "normalize": shape.normalize}) as llm:
            run(llm, reqs, stats)
            engine = llm.llm_engine
            bm = engine.scheduler.block_manager
            assert bm.num_free_gpu_blocks == bm.num_gpu_blocks, f"workload {index}: leaked"
            assert not bm.block_tables and not engine.seq_groups
            assert not engine.scheduler.has_unfinished_seqs()
        for req in reqs:
            stats["aborted_unfinished"] += check(req, shape, model)
        stats["requests"] += len(reqs)
        stats["invalid"] += sum(not r.valid for r in reqs)
    print(f"{len(indices)} pooling workloads: {stats}")
    if not ONLY:  # the series must exercise what it claims to
        assert stats["max_batch"] >= 2 and all(stats.values()), stats
