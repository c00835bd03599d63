"""Multi-step decoding (num_scheduler_steps=k): a decode-only batch runs k passes per call to
the workers and gives the same tokens as one pass per call (greedy, seeded sampling with
penalties and n > 1, stop strings and max_tokens ending sequences mid-call), on uni, mp (TP=2,
PP=2) and ray; prompts, waiting requests and grammars still go one pass at a time; every
block comes back. Batches of plain greedy rows take the lean path (greedy_passes.py: all
passes in one C call on the CPU), checked here by a randomized differential test of its own;
the randomized differential test of the whole engine with multi-step on is in
test_random_workloads.py."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import simulate_no_onednn_bf16, simulate_onednn_amx
from serving_helpers import KV

from fleetllm import LLM, SamplingParams
from fleetllm.engine.arg_utils import DEMO_MODEL
from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.errors import ConfigurationError
from fleetllm.kernels import cpu_kernels
from fleetllm.kernels.cpu_kernels import LinearKind
from fleetllm.model import fused
from fleetllm.sampling_params import StructuredOutputsParams
from fleetllm.worker import greedy_passes

PROMPTS = ["def add(a, b):\n", "The cat sat on the", "import os\n", "class Engine:\n"]
PARAMS = [SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=30, stop=["\n"]),
          SamplingParams(temperature=0.6, seed=1, presence_penalty=0.5,
                         repetition_penalty=1.1, max_tokens=50, logprobs=2)]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


class StepLog:
    """Wraps the executor's execute_model: each call's num_steps and whether it held a
    prompt chunk."""

    def __init__(self, llm: LLM):
        executor = llm.llm_engine.model_executor
        self.inner, self.calls = executor.execute_model, []

        def execute_model(request):
            self.calls.append((request.num_steps,
                               any(g.is_prompt for g in request.seq_group_metadata_list)))
            return self.inner(request)

        executor.execute_model = execute_model


@pytest.fixture(scope="module")
def reference():
    with LLM(str(DEMO_MODEL), kv_cache_memory=64 << 20) as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("steps", [2, 8])
def test_same_tokens_in_fewer_calls(reference, steps):
    with LLM(str(DEMO_MODEL), kv_cache_memory=64 << 20, num_scheduler_steps=steps) as llm:
        log = StepLog(llm)
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        bm = llm.llm_engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks and not bm.block_tables
    assert tokens(got) == tokens(reference)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in reference]
    assert [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in reference]
    for a, b in zip(got[3].outputs[0].logprobs, reference[3].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert all(n == 1 for n, prompt in log.calls if prompt)  # prompts go one pass at a time
    assert any(n == steps for n, _ in log.calls)
    # 50 tokens at most: the prefill, then ceil(49 / steps) calls
    assert len(log.calls) <= 1 + -(-49 // steps)


def test_waiting_requests_and_grammars_go_one_pass_at_a_time(tiny_models):
    """max_num_seqs=2 with 4 requests: while two wait, the running ones decode one pass per
    call (a waiting request is admitted as soon as a slot frees); a request with a grammar
    keeps the whole batch at one pass."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 17]} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 10 * i, ignore_eos=True)
              for i in range(4)]
    with LLM(tiny_models["llama_gqa"]) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], num_scheduler_steps=4, max_num_seqs=2) as llm:
        log = StepLog(llm)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(got) == tokens(want)
        assert log.calls[:3] == [(1, True), (1, False), (1, False)]  # two wait meanwhile
        assert (4, False) in log.calls  # the last ones, alone, run 4 passes per call
        log.calls.clear()
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        grammar = SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(json=schema))
        llm.generate(["x", "y"], [grammar, SamplingParams(max_tokens=20)], use_tqdm=False)
        assert all(n == 1 for n, _ in log.calls[:3])


def test_distributed_backends_same_tokens(tiny_models, distributed):
    """Each rank feeds the output rank's tokens (broadcast) back into its own copy."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33] * (1 + i)} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=19, ignore_eos=True,
                             presence_penalty=0.4)] * 2
    params.append(SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=16,
                                 ignore_eos=True))
    with LLM(tiny_models["llama_gqa"]) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], num_scheduler_steps=8, **distributed) as llm:
        log = StepLog(llm)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert len(log.calls) <= 4  # the prefill, then 8 + 8 + 4 passes


def slow_passes(llm: LLM, seconds: float) -> None:
    """Every forward pass on every rank sleeps `seconds` first (in the model runner's forward,
    which greedy passes run too, without the wrapped worker's execute_model); called again,
    it changes the sleep. While passes sleep, the fused layers are off (the modules compute
    the same bits): greedy passes then run one forward at a time, not all in one C call."""
    def install(worker):
        import time as clock

        from fleetllm.model import fused

        runner = worker.worker.model_runner
        if not hasattr(runner, "pass_delay"):
            run = runner._forward

            def forward(batch, kv_caches):
                clock.sleep(runner.pass_delay)
                return run(batch, kv_caches)

            runner._forward = forward
        runner.pass_delay = seconds
        fused.forget(runner.model)
        if seconds:
            runner.model._fused_stack = None  # (cached: the fused path does not apply)

    llm.llm_engine.model_executor.collective_rpc(install)


LAYOUTS = {"uni": {}, "mp-tp2": dict(tensor_parallel_size=2),
           "ray-tp2": dict(tensor_parallel_size=2, distributed_executor_backend="ray",
                           ray_cpus_per_worker=0.5)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_abort_ends_a_multi_step_call_after_the_current_pass(tiny_models, layout):
    """A request aborted (from another thread) while an 8-pass call runs: the call ends
    after the pass under way (Executor.interrupt_step reaches the output rank, which tells
    the others with its tokens), the aborted request gets no output, the other one keeps its
    tokens (the same as without multi-step) and every block is freed. Passes sleep 0.15 s so
    that the abort, 0.4 s in, lands mid-call."""
    if layout == "ray-tp2":
        pytest.importorskip("ray")
    kwargs = LAYOUTS[layout]
    prompt = {"prompt_token_ids": [5, 9, 17, 33]}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"]) as base:
        [want] = base.generate([prompt], params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], num_scheduler_steps=8, **kwargs) as llm:
        engine = llm.llm_engine
        engine.add_request("keep", prompt, params)
        engine.add_request("abort", prompt, params)
        engine.step()  # both prefills: one pass
        slow_passes(llm, 0.15)
        timer = threading.Timer(0.4, engine.abort_request, args=("abort",))
        timer.start()
        start = time.monotonic()
        outputs = engine.step()  # decode-only: an 8-pass call, 1.2 s uninterrupted
        took = time.monotonic() - start
        timer.join()
        assert [o.request_id for o in outputs] == ["keep"]
        passes = len(outputs[0].outputs[0].token_ids) - 1
        # 8 passes sleep 1.2 s alone: any less is a call cut short (1.09 s was seen for 2
        # passes of ray's, under the suite's load, where the bound had been 1.0)
        assert 1 <= passes < 8 and took < 8 * 0.15, (passes, took)
        slow_passes(llm, 0.0)
        done = None
        while engine.has_unfinished_requests():
            done = next((o for o in engine.step() if o.finished), done)
        assert done.outputs[0].token_ids == want.outputs[0].token_ids
        bm = engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks and not bm.block_tables


@pytest.mark.parametrize("front", ["in-process", "engine-core"])
def test_an_abort_through_a_server_front_end_ends_the_multi_step_call(tiny_models, front,
                                                                       monkeypatch):
    """What a server does: AsyncLLMEngine (the engine on a thread) and EngineCoreClient (the
    engine in its own process) apply aborts between steps; the abort also interrupts the
    8-pass call under way, so the request still running gets its next output after fewer
    than 8 passes (each pass sleeps 0.1 s: serving_helpers.SlowWorker)."""
    monkeypatch.setenv("FLEETLLM_TEST_STEP_DELAY", "0.1")
    kwargs = dict(kv_cache_memory=KV, worker_cls="serving_helpers.SlowWorker",
                  num_scheduler_steps=8)
    model = str(tiny_models["llama_gqa"])
    engine = AsyncLLMEngine.from_engine_args(model, **kwargs) if front == "in-process" else \
        EngineCoreClient(model, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 17, 33]}

    async def run():
        seen: list[tuple[float, int]] = []
        aborted_at = []

        async def keep():
            async for out in engine.generate(prompt, params, "keep"):
                seen.append((time.monotonic(), len(out.outputs[0].token_ids)))

        async def drop():
            outputs = 0
            async for _ in engine.generate(prompt, params, "drop"):
                outputs += 1
                if outputs == 2:  # the first 8-pass call is done; the next one has begun
                    await asyncio.sleep(0.25)
                    aborted_at.append(time.monotonic())
                    engine.abort("drop")

        results = await asyncio.gather(keep(), drop(), return_exceptions=True)
        return seen, aborted_at[0], results

    try:
        seen, aborted_at, results = asyncio.run(run())
    finally:
        engine.shutdown()
    assert results[0] is None, results
    counts = [n for _, n in seen]
    after = next(i for i, (t, _) in enumerate(seen) if t > aborted_at)
    assert 1 <= counts[after] - counts[after - 1] < 8, counts
    assert counts[-1] == 33


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_passes_random_workloads_match_one_pass_a_call(tiny_models, dtype,
                                                              monkeypatch):
    """Randomized differential test of the lean path (greedy_passes.py): batches of mostly
    plain greedy requests (prompts of 1-90 tokens, max_tokens 1-40, stop token ids, min_tokens
    holding them back, n 1-2, EOS on or off), now and then one with logprobs or a penalty
    (its batch's passes then go one by one through the worker, until it ends), k 2-8 and
    max_num_seqs 2-6 (requests wait, so prompts and decodes alternate), against the same
    requests at one pass a call: identical tokens, finish reasons and stop reasons, every
    block back, and the lean path ran (it is what ran most passes)."""
    lean = {"calls": 0, "passes": 0, "one_c_call": 0}
    run, run_passes = greedy_passes.run, fused.run_passes

    def counted(*args, **kwargs):
        tokens = run(*args, **kwargs)
        lean["calls"] += 1
        lean["passes"] += len(tokens)
        return tokens

    def c_counted(*args, **kwargs):
        tokens = run_passes(*args, **kwargs)
        lean["one_c_call"] += tokens is not None
        return tokens

    monkeypatch.setattr(greedy_passes, "run", counted)
    monkeypatch.setattr(fused, "run_passes", c_counted)
    from fleetllm.model import linear_kernels as lk

    # The two engines' decode batches differ over time (prompts are admitted between passes
    # at one pass a call, between calls here), and bf16 tokens follow a batch's size where the
    # kernels switch within these batches (up to 12 rows): the copy by pairs for up to 4 rows
    # beside oneDNN on AMX, where the kernels have no AMX GEMM (FLEETLLM_CPU_ISA=avx2 on an
    # AMX CPU). There the kernels' own GEMM takes every size (docs/spec_decode.md).
    if dtype == "bfloat16" and lk.onednn_amx() and not cpu_kernels.amx_available():
        monkeypatch.setenv("FLEETLLM_BATCH_INVARIANT", "1")
    model = tiny_models["llama_gqa"]
    ref_llm = LLM(model, dtype=dtype, kv_cache_memory=KV)
    llms = {k: LLM(model, dtype=dtype, kv_cache_memory=KV, num_scheduler_steps=k)
            for k in (3, 8)}
    try:
        for index in range(20):
            rng = random.Random(f"greedy-passes-{dtype}-{index}")
            prompts, params = [], []
            for _ in range(rng.randint(1, 6)):
                prompts.append({"prompt_token_ids": [rng.randrange(3, 512)
                                                     for _ in range(rng.randint(1, 90))]})
                plain, most = rng.random() < 0.85, rng.randint(1, 40)
                params.append(SamplingParams(
                    temperature=0, n=rng.choice([1, 1, 1, 2]), max_tokens=most,
                    ignore_eos=rng.random() < 0.5,
                    stop_token_ids=rng.sample(range(3, 512), 25) if rng.random() < 0.5 else None,
                    min_tokens=rng.choice([0, 0, rng.randint(0, most)]),
                    logprobs=None if plain or rng.random() < 0.5 else 1,
                    presence_penalty=0.0 if plain else 0.5))
            llm = llms[rng.choice([3, 8])]
            llm.llm_engine.scheduler.config.max_num_seqs = rng.randint(2, 6)
            want = ref_llm.generate(prompts, params, use_tqdm=False)
            got = llm.generate(prompts, params, use_tqdm=False)
            assert [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                    for o in got] == \
                [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                 for o in want], index
            bm = llm.llm_engine.scheduler.block_manager
            assert bm.num_free_gpu_blocks == bm.num_gpu_blocks and not bm.block_tables
    finally:
        for engine in (ref_llm, *llms.values()):
            engine.shutdown()
    print(f"{dtype}: {lean}")
    assert lean["calls"] >= 20 and lean["passes"] >= 200, lean
    assert lean["one_c_call"] == lean["calls"], lean  # all of them in the C loop here


HEADS = {"float32": ("float32", {}), "bfloat16": ("bfloat16", {}),
         "float32-dense": ("float32", {"FLEETLLM_LINEAR": "dense"}),
         "bfloat16-beside-onednn": ("bfloat16", {"amx": True}),
         "bfloat16-avx2": ("bfloat16", {"no_bf16_packing": True})}


@pytest.mark.parametrize("case", list(HEADS))
def test_greedy_passes_in_one_c_call_read_every_kind_of_lm_head(tiny_models, monkeypatch,
                                                                 case):
    """The C loop (cpu_kernels.greedy_passes) computes the LM head as its kernel does at the
    batch's rows, from the tensor and kind fused._head picks, which depend on the CPU
    (_head_kind): the GEMV kernel on the dense weight up to its row limit, then MKL's or
    oneDNN's packed copy (float32); for bf16 the copy by pairs (AVX-512 without AMX), the
    small batches' copy beside oneDNN's (where oneDNN runs on AMX; also simulated, as in
    test_attention.py), or the GEMV up to 16 rows beside oneDNN's float32 copy (AVX2-only
    CPUs, also simulated: oneDNN packs no bf16 there, and the dense bf16 weight with a
    float32 copy was the faster pair, kernel_choice._plan); where nothing is packed
    (FLEETLLM_LINEAR=dense), past the GEMV's rows the passes run one forward at a time (the
    fused layers need the packed weights there). 3 and 11 sequences, 4 passes a call: the
    tokens of one pass a call."""
    from fleetllm.model import linear_kernels as lk

    dtype, setting = HEADS[case]
    if setting.get("amx"):
        simulate_onednn_amx(monkeypatch, "pairs")
    if setting.get("no_bf16_packing"):  # an AVX2-only CPU's oneDNN: no bf16 packing, no AMX
        simulate_no_onednn_bf16(monkeypatch)
        monkeypatch.setattr(lk, "onednn_amx", lambda: False)
    for name, value in setting.items():
        if name.isupper():
            monkeypatch.setenv(name, value)
    seen = []
    greedy = cpu_kernels.greedy_passes

    def counted(ids, *args, head_kind, **kwargs):
        seen.append((ids.shape[0], head_kind))
        return greedy(ids, *args, head_kind=head_kind, **kwargs)

    monkeypatch.setattr(cpu_kernels, "greedy_passes", counted)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    model = tiny_models["llama_gqa"]
    for count in (3, 11):
        prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(count)]
        with LLM(model, dtype=dtype, kv_cache_memory=KV) as base:
            want = base.generate(prompts, params, use_tqdm=False)
        with LLM(model, dtype=dtype, kv_cache_memory=KV, num_scheduler_steps=4) as llm:
            got = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(got) == tokens(want), count
    kinds = dict(seen)
    if case == "float32-dense":
        assert kinds == {3: LinearKind.GEMV}, seen  # 11 rows: one forward at a time
        return
    assert set(kinds) == {3, 11}, seen  # the C loop ran at both sizes
    config = json.loads((Path(model) / "config.json").read_text())
    head = (config["vocab_size"], config["hidden_size"])  # the LM head's weight: [vocab, hidden]
    assert kinds == {rows: _head_kind(dtype, head, rows) for rows in (3, 11)}, seen


def _head_kind(dtype: str, shape: tuple[int, int], rows: int) -> LinearKind:
    """The kind of copy the LM head of `shape` reads at `rows` rows on this CPU (or the one
    simulated), by kernel_choice's rules."""
    from fleetllm.model import linear_kernels as lk

    weight = torch.zeros(shape, dtype=getattr(torch, dtype))
    if dtype == "float32":  # the GEMV up to 8 rows, then MKL's packed sgemm (Intel) or oneDNN's
        return LinearKind.GEMV if rows <= 8 else LinearKind.MKL if lk.Mkl.applies(weight) \
            else LinearKind.ONEDNN
    pairs = lk.Pairs.applies(weight)
    if pairs and (lk.batch_invariant() or lk.onednn_packs_bf16() and not lk.onednn_amx()):
        return LinearKind.PAIRS  # at every size (AVX-512, or FLEETLLM_BATCH_INVARIANT)
    if pairs and lk.onednn_amx():  # the small batches' copy, then oneDNN's
        tiles = lk.Amx.applies(weight)
        small = lk.Amx.MAX_ROWS if tiles else lk.Pairs.SMALL_ROWS
        if rows > small:
            return LinearKind.ONEDNN
        return LinearKind.AMX if tiles else LinearKind.PAIRS
    # AVX2-only (the dense bf16 weight for the GEMV up to 16 rows, a float32 copy for oneDNN)
    # or no pairs' GEMM at all (oneDNN's bf16 copy past 8 rows): lk.gemv_limits
    limit = 16 if not lk.onednn_packs_bf16() else 8
    return LinearKind.GEMV if rows <= limit else LinearKind.ONEDNN


def test_greedy_passes_end_when_every_row_has_drawn_a_stop_token(tiny_models):
    """The C loop ends a call after the pass in which the last row still going draws one of
    its stop tokens (a stop token id, or EOS unless ignore_eos): no passes are run for tokens
    the engine would discard. Two requests whose stop token ids each first appear at an
    output position that is not a multiple of k: the passes run are exactly the tokens kept
    (past the prefill's), and the outputs are those of one pass a call."""
    model = tiny_models["llama_gqa"]
    prompts = [{"prompt_token_ids": [5, 9, 17, 33]}, {"prompt_token_ids": [7, 7, 40]}]
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(model, kv_cache_memory=KV) as base:
        runs = [o.outputs[0].token_ids for o in base.generate(prompts, free, use_tqdm=False)]
        # a token first drawn at an output position past 1 that k = 8 does not divide
        ends = [next(p for p in range(2, 40) if p % 8 and row.index(row[p]) == p)
                for row in runs]
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                 stop_token_ids=[row[p]]) for row, p in zip(runs, ends,
                                                                              strict=True)]
        want = base.generate(prompts, params, use_tqdm=False)
    done = []
    passes = cpu_kernels.greedy_passes

    def counted(*args, **kwargs):
        out = passes(*args, **kwargs)
        done.append(out.shape[0])
        return out

    with LLM(model, kv_cache_memory=KV, num_scheduler_steps=8) as llm:
        cpu_kernels.greedy_passes = counted
        try:
            got = llm.generate(prompts, params, use_tqdm=False)
        finally:
            cpu_kernels.greedy_passes = passes
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].finish_reason for o in got] == ["stop", "stop"]
    # Both decode together until the shorter stops (the engine then drops it from the
    # batch), then the longer alone: each call ends at its last stop, not at 8 passes.
    assert sum(done) == max(ends), (done, ends)


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_an_interrupt_ends_the_c_loop_of_greedy_passes(tiny_models, backend):
    """An interrupt from another thread while the passes run in one C call (which runs
    without the GIL and reads the count after each pass; with mp, TP=1, the count lives in
    the 8-byte file the driver writes and the worker process maps): the call returns after
    fewer passes than it was given, and the tokens it gave are those of one pass a call.
    A thread interrupts every 2 ms while the step runs (one that lands before the call
    begins is part of the count the call starts from)."""
    prompt = {"prompt_token_ids": [5, 9, 17, 33]}
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    model = tiny_models["llama_gqa"]
    with LLM(model, kv_cache_memory=KV) as base:
        [want] = base.generate([prompt], params, use_tqdm=False)
    calls = []
    with LLM(model, kv_cache_memory=KV, num_scheduler_steps=1000,
             distributed_executor_backend=backend) as llm:
        engine = llm.llm_engine
        passes = cpu_kernels.greedy_passes
        stepping = threading.Event()

        def counted(*args, **kwargs):  # (uni: in this process)
            out = passes(*args, **kwargs)
            calls.append(out.shape[0])
            return out

        def interrupt_while_stepping():
            deadline = time.monotonic() + 60
            while stepping.is_set() and time.monotonic() < deadline:
                time.sleep(0.002)
                engine.interrupt_step()

        cpu_kernels.greedy_passes = counted
        try:
            engine.add_request("r", prompt, params)
            engine.step()  # the prefill
            stepping.set()
            thread = threading.Thread(target=interrupt_while_stepping)
            thread.start()
            try:
                [out] = engine.step()  # up to 899 passes in one call
            finally:
                stepping.clear()
                thread.join(timeout=60)
        finally:
            cpu_kernels.greedy_passes = passes
        done = len(out.outputs[0].token_ids) - 1
        print(f"{backend}: interrupted after {done} of 899 passes")
        assert 1 <= done < 899
        assert calls == ([done] if backend == "uni" else [])  # the one C call ran them
        assert out.outputs[0].token_ids == want.outputs[0].token_ids[:done + 1]


def test_sequences_near_max_model_len_stop_there(tiny_models):
    """A pass never goes past max_model_len (no position beyond the model's), whatever k."""
    prompts = [{"prompt_token_ids": [7] * n} for n in (50, 58, 60)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], max_model_len=64) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], max_model_len=64, num_scheduler_steps=8) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [14, 6, 4]


def test_configuration_is_checked(tiny_models):
    model = tiny_models["llama_gqa"]
    with pytest.raises(ConfigurationError, match="num_scheduler_steps: must be an int >= 1"):
        LLM(model, num_scheduler_steps=0)
    with pytest.raises(ConfigurationError, match="cannot be combined"):
        LLM(model, num_scheduler_steps=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_greedy_passes_python_loop_matches_one_pass_a_call(tiny_models, monkeypatch):
    """Where the C loop does not run (CUDA, a model the fused layers do not take), the greedy
    passes go pass by pass through ModelRunner.forward_tokens: the same tokens as one pass a
    call, and the lean path ran."""
    lean, run = [], greedy_passes.run

    def counted(*args, **kwargs):
        lean.append(run(*args, **kwargs))
        return lean[-1]

    monkeypatch.setattr(greedy_passes, "run", counted)
    monkeypatch.setattr(fused, "run_passes", lambda *args, **kwargs: None)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 20, 14)]
    model = tiny_models["llama_gqa"]
    with LLM(model, kv_cache_memory=KV) as ref, \
            LLM(model, kv_cache_memory=KV, num_scheduler_steps=4) as llm:
        want = tokens(ref.generate(prompts, params, use_tqdm=False))
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert sum(map(len, lean)) >= 15, lean
