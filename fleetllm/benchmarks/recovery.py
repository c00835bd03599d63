"""Recovery time after a crash: kill a worker (or, with --kill core, the engine-core process
that `fleetllm serve` runs) mid-generation, time until the first token after the restart, and
check every request against an undisturbed run.

    fleetllm bench recovery [--model DIR] [--tensor-parallel-size 2] [--num-prompts 16]
        [--kill-after-steps 8] [--kill worker|core] [engine flags ...]

The undisturbed run comes first, on the same engine. Then the same requests again; after
--kill-after-steps steps (core: that many outputs of the first stream), worker rank tp-1 (or
the core) gets SIGKILL. Printed: kill -> crash noticed, the restart, kill -> first token after
it, and whether all tokens equal the undisturbed run (greedy and seeded requests).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time

from fleetllm.engine.arg_utils import (
    HelpFormatter,
    add_engine_args,
    engine_kwargs_from,
    resolve_model,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=16, help="requests")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=48, help="tokens per request")
    parser.add_argument("--kill-after-steps", type=int, default=8,
                        help="engine steps of the second run before the kill")
    parser.add_argument("--kill", choices=("worker", "core"), default="worker",
                        help="what gets SIGKILL: a worker, or the engine-core process")
    add_engine_args(parser)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.benchmarks.recovery",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _workload(args: argparse.Namespace) -> tuple[list[dict], list]:
    from fleetllm import SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
              if i % 2 else SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len,
                                           ignore_eos=True) for i in range(args.num_prompts)]
    return prompts, params


def run(args: argparse.Namespace) -> dict:
    from fleetllm import LLM

    kwargs = engine_kwargs_from(args, args.engine_actions)
    kwargs.setdefault("tensor_parallel_size", 2)
    if args.kill == "core":
        return asyncio.run(_run_core(args, kwargs))
    prompts, params = _workload(args)
    with LLM(resolve_model(args.model), **kwargs) as llm:
        undisturbed = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
        engine = llm.llm_engine
        executor = engine.model_executor
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        for _ in range(args.kill_after_steps):
            engine.step()
        restart = executor.restart_failed_workers
        marks: dict[str, float] = {}

        def timed_restart() -> None:  # when the engine notices, and when the restart is done
            marks["noticed"] = time.perf_counter()
            restart()
            marks["restarted"] = time.perf_counter()

        executor.restart_failed_workers = timed_restart
        killed = time.perf_counter()
        os.kill(executor.worker_pids[-1], signal.SIGKILL)
        results, first_token = {}, None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first_token is None and "restarted" in marks and outputs:
                first_token = time.perf_counter()
            results.update({o.request_id: o for o in outputs if o.finished})
        del executor.restart_failed_workers
    same = [results[f"r{i}"].outputs[0].token_ids for i in range(args.num_prompts)] \
        == undisturbed
    figures = {
        "kill_to_noticed_s": marks["noticed"] - killed,
        "restart_s": marks["restarted"] - marks["noticed"],
        "kill_to_first_token_s": first_token - killed,
        "restarts": engine.worker_restarts,
        "tokens_identical": same,
    }
    print(f"kill -> crash noticed {figures['kill_to_noticed_s'] * 1e3:.0f} ms; restart "
          f"(new workers, weights, KV cache) {figures['restart_s']:.2f} s; kill -> first token "
          f"after the restart {figures['kill_to_first_token_s']:.2f} s; "
          f"{args.num_prompts} requests, tokens identical to the undisturbed run: {same}")
    return figures


async def _run_core(args: argparse.Namespace, kwargs: dict) -> dict:
    """The engine core in its own process (EngineCoreClient, as `fleetllm serve` runs it):
    the same requests undisturbed, then again with the core killed mid-stream."""
    from fleetllm.engine.core_client import EngineCoreClient

    prompts, params = _workload(args)
    engine = EngineCoreClient(resolve_model(args.model), **kwargs)
    marks: dict[str, float] = {}
    seen = asyncio.Event()

    async def one(tag: str, i: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompts[i], params[i], f"{tag}{i}"):
            tokens = list(out.outputs[0].token_ids)
            # counted once the death is seen: later outputs come from the new core
            if engine.core_restarts.total and "first" not in marks:
                marks["first"] = time.perf_counter()
            if i == 0 and (len(tokens) >= args.kill_after_steps or out.finished):
                seen.set()
        return tokens

    async def kill() -> None:
        await seen.wait()
        marks["killed"] = time.perf_counter()
        os.kill(engine._proc.pid, signal.SIGKILL)

    try:
        n = range(args.num_prompts)
        undisturbed = await asyncio.gather(*(one("u", i) for i in n))
        *disturbed, _ = await asyncio.gather(*(one("d", i) for i in n), kill())
    finally:
        engine.shutdown()
    figures = {"kill_to_first_token_s": marks["first"] - marks["killed"],
               "restarts": engine.core_restarts.total, "tokens_identical": disturbed ==
               undisturbed}
    print(f"engine core killed: kill -> first token from the new core "
          f"{figures['kill_to_first_token_s']:.2f} s; core restarts {figures['restarts']}; "
          f"{args.num_prompts} requests, tokens identical to the undisturbed run: "
          f"{figures['tokens_identical']}")
    return figures
