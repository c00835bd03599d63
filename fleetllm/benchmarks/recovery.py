"""Recovery time after a worker crash: kill one worker mid-generation, time until the first
token after the restart, and check every request against an undisturbed run.

    fleetllm bench recovery [--model DIR] [--tensor-parallel-size 2] [--num-prompts 16]
        [--kill-after-steps 8] [engine flags ...]

The undisturbed run comes first, on the same engine. Then the same requests again; after
--kill-after-steps steps, worker rank tp-1 gets SIGKILL. Printed: kill -> crash noticed,
kill -> workers restarted, kill -> first token after the restart, the restart's part of it,
and whether all tokens equal the undisturbed run (greedy and seeded requests).
"""

from __future__ import annotations

import argparse
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
    add_engine_args(parser)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.benchmarks.recovery",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    from fleetllm import LLM, SamplingParams

    kwargs = engine_kwargs_from(args, args.engine_actions)
    kwargs.setdefault("tensor_parallel_size", 2)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
              if i % 2 else SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len,
                                           ignore_eos=True) for i in range(args.num_prompts)]
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
