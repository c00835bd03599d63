"""The randomized differential series' machinery (test_random_workloads.py's docstring says
what it draws and checks): random requests and engine shapes, executor faults, aborts inside
multi-step calls, each request's reference run alone, and the checks. The pooling and
structured-output series use it too, from their own folders: so it is a helper module, not a
test module.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.config import CacheConfig, SchedulerConfig
from fleetllm.core.scheduler import Scheduler
from fleetllm.errors import (
    InvalidRequestError,
    OutOfMemoryError,
    RemoteWorkerError,
    WorkerCrashedError,
)
from fleetllm.model import fused
from fleetllm.worker import greedy_passes

TIE = 1e-5
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
STOP_POOL = ["e", "s ", "(", "in", "ar", ":\n", "the", "xyz", "lo w", ")\n    "]


@dataclass
class Req:
    rid: str
    prompt: dict
    params: SamplingParams
    abort_at: int | None = None  # step index at which it is aborted
    outputs: list = field(default_factory=list)  # (step, RequestOutput)
    aborted_at: int | None = None

    @property
    def reproducible(self) -> bool:
        return self.params.greedy or self.params.seed is not None


def draw_requests(rng: random.Random, index: int) -> list[Req]:
    reqs = []
    shared = [rng.randrange(3, 500) for _ in range(rng.randint(1, 120))]  # a common prefix
    for i in range(rng.randint(1, 8)):
        length = rng.choice([rng.randint(1, 20), rng.randint(1, 80), rng.randint(1, 300)])
        kind = rng.choice(["greedy", "greedy", "seeded", "seeded", "random"])
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3, 4]),
            temperature=0.0 if kind == "greedy" else rng.choice([0.7, 1.0, 1.3]),
            top_p=rng.choice([1.0, 1.0, 0.9]), top_k=rng.choice([-1, -1, 20]),
            seed=rng.randrange(1000) if kind == "seeded" else None,
            max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.7,
            stop=rng.sample(STOP_POOL, rng.randint(1, 3)) if rng.random() < 0.3 else None,
            include_stop_str_in_output=rng.random() < 0.3,
            presence_penalty=rng.choice([0.0, 0.0, 0.0, 0.5]),
            logprobs=rng.choice([None, None, 2]),
            prompt_logprobs=rng.choice([None] * 6 + [1]))
        tokens = [rng.randrange(3, 500) for _ in range(length)]
        shape = rng.random()
        if shape < 0.4:  # shares the workload's prefix
            tokens = shared + tokens[:rng.randint(0, 40)]
        elif shape < 0.55 and reqs:  # repeats an earlier prompt, perhaps cut short
            earlier = reqs[rng.randrange(len(reqs))].prompt["prompt_token_ids"]
            tokens = earlier[:rng.randint(1, len(earlier))]
        elif shape < 0.7:  # repeats itself: n-gram drafts find matches
            tokens = (tokens[:rng.randint(2, 12)] * 40)[:max(length, 24)]
        prompt = {"prompt_token_ids": tokens}
        abort_at = rng.randrange(30) if rng.random() < 0.15 else None
        reqs.append(Req(f"w{index}-r{i}", prompt, params, abort_at))
    return reqs


def completions(output) -> list[tuple[list[int], str, str | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for c in output.outputs]


def check_blocks(bm) -> None:
    """Every device block is exactly one of free, cached-and-evictable, owned; reference
    counts equal the tables' references; the CPU pool likewise (no cache there)."""
    evictable = set(bm.prefix_cache.evictable) if bm.prefix_cache else set()
    for pool, tables, parked in ((bm.gpu, bm.block_tables, evictable),
                                 (bm.cpu, bm.cpu_tables, set())):
        refs = Counter(b for table in tables.values() for b in table)
        free = set(pool.free)
        assert len(pool.free) == len(free), "a block is twice on the free list"
        assert not free & parked, "a block is both free and cached"
        for block in range(pool.num_blocks):
            assert pool.ref[block] == refs[block], (pool.name, block)
            state = (block in free) + (block in parked) + (refs[block] > 0)
            assert state == 1, f"{pool.name} block {block} is leaked or double-booked"
    if bm.prefix_cache:
        cache = bm.prefix_cache
        assert {cache.cached[h] for h in cache.hash_of.values()} == set(cache.hash_of)
        assert evictable <= set(cache.hash_of)


def check_lookahead(scheduler: Scheduler, lookahead: int) -> None:
    """A sequence holds blocks for its tokens and `lookahead` slots past them, no more: the
    slots of rejected drafts are reused, never piled up."""
    bm = scheduler.block_manager
    for group in scheduler.running:
        for seq in group.unfinished_seqs():
            table = bm.block_tables.get(seq.seq_id, [])
            assert len(table) <= bm.num_blocks_for(seq.get_len() + lookahead), seq.seq_id


class Faults:
    """Replaces execute_model: some calls fail, before or after the workers ran. A plain error
    propagates from step(); a worker crash makes the engine replace its workers (really: the
    uni executor restarts) and recompute every request; out of memory shrinks the step."""

    def __init__(self, executor, rng: random.Random, rate: float):
        self.inner, self.rng, self.rate = executor.execute_model, rng, rate
        self.count = self.crashes = 0
        self.multi_step = 0  # calls that ran several passes (num_scheduler_steps)

    def _error(self, request) -> Exception:
        groups = request.seq_group_metadata_list
        smallest = len(groups) == 1 and groups[0].token_chunk_size == 1
        kind = self.rng.random()
        if kind < 0.1 and self.crashes < 2:  # max_worker_restarts is 3
            self.crashes += 1
            return WorkerCrashedError("injected worker crash", rank=0)
        if kind < 0.3 and not smallest:  # alone at its smallest step it would fail for good
            return OutOfMemoryError("injected out of memory")
        return RemoteWorkerError("injected fault")

    def __call__(self, request):
        self.multi_step += request.num_steps > 1
        if self.rng.random() >= self.rate:
            return self.inner(request)
        self.count += 1
        error = self._error(request)
        if self.rng.random() < 0.5:
            self.inner(request)  # the workers ran it; its results are lost
        raise error


class MidCallAborts:
    """Multi-step decoding: during a call, now and then abort a random live request, as
    another thread would (the engine defers the abort and interrupts the call after the pass
    under way), or only interrupt the call: at a pass of the model runner's forward (the
    wrapped worker's passes, and greedy_passes' Python loop), or as greedy_passes' one C call
    begins (it then ends after its first pass). Counts the passes greedy_passes ran."""

    def __init__(self, engine, reqs: list, rng: random.Random):
        self.engine, self.reqs, self.rng = engine, reqs, rng
        self.step = self.aborts = self.interrupts = self.lean_passes = 0
        self.runner = engine.model_executor.driver_worker.worker.worker.model_runner
        self.inner = self.runner._forward
        self.runner._forward = self
        self.lean_run, self.one_call = greedy_passes.run, fused.run_passes

        def counted(*args, **kwargs):
            tokens = self.lean_run(*args, **kwargs)
            self.lean_passes += len(tokens)
            return tokens

        def one_call(*args, **kwargs):
            self._maybe_abort(0.3)
            return self.one_call(*args, **kwargs)

        greedy_passes.run, fused.run_passes = counted, one_call

    def _maybe_abort(self, chance: float) -> None:
        if self.rng.random() < chance:
            live = [r for r in self.reqs if r.aborted_at is None
                    and r.rid in self.engine.seq_groups]
            if live and self.rng.random() < 0.5:
                req = self.rng.choice(live)
                self.engine.abort_request(req.rid)
                req.aborted_at = self.step
                self.aborts += 1
            else:
                self.engine.interrupt_step()
                self.interrupts += 1

    def __call__(self, batch, kv_caches):
        self._maybe_abort(0.05)
        return self.inner(batch, kv_caches)

    def remove(self) -> None:  # a worker restart may have replaced the worker meanwhile
        self.runner.__dict__.pop("_forward", None)
        greedy_passes.run, fused.run_passes = self.lean_run, self.one_call


@pytest.fixture(scope="module")
def engines(tiny_models):
    """One LLM per block size, each with a large pool; workloads install small schedulers.
    "spec", "draft", "multi-step": speculative decoding (n-gram drafts; the model as its own
    draft model) and multi-step decoding, block size 4; their workloads are compared with
    requests run alone on the block-size-4 engine without them."""
    llms = {bs: LLM(tiny_models["llama_gqa"], kv_cache_memory=64 << 20, block_size=bs,
                    swap_space=16 << 20, max_num_seqs=256) for bs in (4, 16)}
    llms["spec"] = LLM(tiny_models["llama_gqa"], kv_cache_memory=64 << 20, block_size=4,
                       swap_space=16 << 20, max_num_seqs=256, speculative_config=SPEC)
    llms["draft"] = LLM(tiny_models["llama_gqa"], kv_cache_memory=64 << 20, block_size=4,
                        swap_space=16 << 20, max_num_seqs=256, speculative_config={
                            "method": "draft_model", "model": str(tiny_models["llama_gqa"]),
                            "num_speculative_tokens": 2})
    llms["multi-step"] = LLM(tiny_models["llama_gqa"], kv_cache_memory=64 << 20, block_size=4,
                             swap_space=16 << 20, max_num_seqs=256, num_scheduler_steps=4)
    yield llms
    for llm in llms.values():
        llm.shutdown()


@dataclass
class Reference:
    completions: list  # as completions() gives them
    logprobs: list  # per completion: per position {token: logprob} (top 2 and the chosen)
    prompt_logprobs: list | None


def reference(llm: LLM, req: Req) -> Reference:
    """The request alone, in the engine's own large pool, no faults. (Logprobs do not change
    what is drawn: asked for here to tell a float tie from a difference.)"""
    params = dataclasses.replace(req.params, logprobs=max(req.params.logprobs or 0, 2))
    [out] = llm.generate(req.prompt, params, use_tqdm=False)
    return Reference(completions(out),
                     [[{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
                      for c in out.outputs], out.prompt_logprobs)


def _tied(ref: Reference, index: int, position: int, ours: int) -> bool:
    """Is `ours` within TIE of the reference's choice at this greedy step?"""
    row = ref.logprobs[index][position]
    want = ref.completions[index][0][position]
    return ours in row and abs(row[ours] - row[want]) <= TIE


def run_workload(llm: LLM, reqs: list[Req], rng: random.Random
                 ) -> tuple[Scheduler, int, int]:
    engine = llm.llm_engine
    cc = engine.config.cache_config
    bs = cc.block_size
    need = max(r.params.n * -(-(len(r.prompt["prompt_token_ids"]) + r.params.max_tokens) // bs)
               for r in reqs)
    swap_blocks = rng.choice([0, rng.randint(1, need), min(cc.num_cpu_blocks, 4 * need)])
    lookahead = engine.config.scheduler_config.num_lookahead_slots
    # Speculative decoding: a decoding sequence also holds its lookahead slots.
    need += -(-lookahead // bs) * max(r.params.n for r in reqs)
    num_blocks = min(cc.num_gpu_blocks, need + rng.choice([0, 1, rng.randint(0, 3 * need)]))
    sc = SchedulerConfig(max_num_seqs=rng.randint(1, 16),
                         max_num_batched_tokens=rng.choice([8, 16, 32, 64, 128, 256]),
                         max_model_len=engine.model_config.max_model_len,
                         preemption_mode=rng.choice(["recompute", "swap"]))
    sc.num_lookahead_slots = lookahead
    scheduler = Scheduler(
        sc, CacheConfig(block_size=bs, num_gpu_blocks=num_blocks, num_cpu_blocks=swap_blocks,
                        enable_prefix_caching=rng.random() < 0.6))
    saved_scheduler, saved_execute = engine.scheduler, engine.model_executor.execute_model
    engine.scheduler = scheduler
    faults = Faults(engine.model_executor, rng, rng.choice([0.0, 0.0, 0.05, 0.2]))
    engine.model_executor.execute_model = faults
    engine.worker_restarts = 0
    mid_call = MidCallAborts(engine, reqs, random.Random(reqs[0].rid)) \
        if engine.config.scheduler_config.num_scheduler_steps > 1 else None
    try:
        pending = list(reqs)
        for req in list(pending):
            try:
                engine.add_request(req.rid, req.prompt, req.params)
            except InvalidRequestError:
                assert req.params.n > scheduler.config.max_num_seqs
                pending.remove(req)
                req.outputs.append((-1, None))
        step = 0
        while engine.has_unfinished_requests():
            for req in pending:
                if req.abort_at == step and req.aborted_at is None:
                    engine.abort_request(req.rid)
                    req.aborted_at = step
            if mid_call is not None:
                mid_call.step = step
            try:
                outs = engine.step()
            except RemoteWorkerError as e:  # the only fault the engine does not absorb
                assert "injected" in str(e)
                continue
            finally:
                step += 1
                assert step < 5000, "no progress"
            by_id = {r.rid: r for r in pending}
            for out in outs:
                by_id[out.request_id].outputs.append((step, out))
            check_blocks(scheduler.block_manager)
            check_lookahead(scheduler, lookahead)
        assert not engine.seq_groups
    finally:
        if mid_call is not None:
            mid_call.remove()
        engine.scheduler = saved_scheduler
        engine.model_executor.__dict__.pop("execute_model", None)
        assert engine.model_executor.execute_model == saved_execute
        # This workload wrote into blocks the engine's own scheduler may have cached.
        saved_scheduler.block_manager.reset_prefix_cache()
    return scheduler, faults.count, faults.multi_step, \
        (0, 0) if mid_call is None else (mid_call.aborts + mid_call.interrupts,
                                         mid_call.lean_passes)


def check(req: Req, ref: Reference, scheduler: Scheduler) -> None:
    if req.outputs and req.outputs[0][1] is None:  # rejected at add_request: n too wide
        return
    outs = [o for _, o in req.outputs]
    if req.aborted_at is not None:
        assert all(step <= req.aborted_at for step, _ in req.outputs), "output after abort"
    finished = [o for o in outs if o.finished]
    if req.aborted_at is None or finished:
        assert len(finished) == 1 and outs[-1].finished, f"{req.rid}: terminal outputs"
        assert len(outs[-1].outputs) == req.params.n, f"{req.rid}: lost samples"
        assert outs[-1].error is None, outs[-1].error
    texts: dict[int, str] = {}
    tied: set[int] = set()  # completions that took the other side of a float tie
    for out in outs:
        for c in out.outputs:
            assert c.text.startswith(texts.get(c.index, "")), f"{req.rid}: text shrank"
            texts[c.index] = c.text
            if not req.reproducible or c.index in tied:
                continue
            ref_tokens = ref.completions[c.index][0]
            diff = next((i for i, (a, b) in enumerate(zip(c.token_ids, ref_tokens, strict=False))
                         if a != b), None)
            if diff is not None and req.params.greedy and \
                    _tied(ref, c.index, diff, c.token_ids[diff]):
                tied.add(c.index)
                continue
            assert c.token_ids == ref_tokens[:len(c.token_ids)], f"{req.rid}: tokens"
            assert ref.completions[c.index][1].startswith(c.text), f"{req.rid}: text"
    if finished and req.params.prompt_logprobs is not None and finished[0].outputs[0].token_ids:
        got, want = finished[0].prompt_logprobs, ref.prompt_logprobs
        assert len(got) == len(want) == len(req.prompt["prompt_token_ids"]), req.rid
        for a, b in zip(got[1:], want[1:], strict=True):
            assert a.keys() == b.keys(), req.rid
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-4 for k in a), req.rid
    if finished and req.reproducible:
        for index, (mine, want) in enumerate(zip(completions(finished[0]), ref.completions,
                                                 strict=True)):
            assert index in tied or mine == want, f"{req.rid}: differs from the reference"
    elif finished:  # unseeded sampling: only the shape can be compared
        for c in finished[0].outputs:
            assert 1 <= len(c.token_ids) <= req.params.max_tokens
