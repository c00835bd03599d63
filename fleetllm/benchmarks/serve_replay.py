"""The serving overhead of `fleetllm bench serve --offline-replay`: the same requests, arriving
at the same moments, run through an `LLMEngine` in this process, with no HTTP, no JSON, no
engine-core process in between, timed the way the client times the server.

How: the engine is built from the same serve flags; a loop admits each request at the offset
the client sent it (within --max-concurrency), steps while anything is unfinished and sleeps
until the next arrival otherwise. TTFT, TPOT, ITL and E2E are the client's figures, so
`server / replay - 1` is what serving adds. Chat prompts and grammar requests are refused
before the run. The machine's speed drifts between runs, so --repeat N alternates server and
replay rounds and medians() reports the median overheads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from typing import Any

from fleetllm.benchmarks.serve_figures import RequestResult, print_ratios, print_result, summarize

OVERHEADS = ("tpot", "itl", "ttft")  # mean of each: server / replay - 1


def with_replay(served: dict[str, Any], server_args: list[str], prompts: list,
                arrivals: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """served + {"offline_replay": the replay's figures, "serving_overhead": server / replay
    - 1 for mean TPOT, ITL and TTFT}."""
    results = [RequestResult() for _ in prompts]
    duration = replay(server_args, prompts, arrivals, args.temperature, args.max_concurrency,
                      results)
    offline = {**summarize(results, duration, args), "base_url": "offline replay"}
    overhead = {key: served[f"mean_{key}_ms"] / offline[f"mean_{key}_ms"] - 1
                if offline[f"mean_{key}_ms"] else float("nan") for key in OVERHEADS}
    if not args.quiet:
        print_result(offline, "offline replay (same engine, same arrivals)")
        _print_overhead(overhead, "serving overhead (server / replay - 1)")
    return {**served, "offline_replay": offline, "serving_overhead": overhead}


def medians(rounds: list[dict[str, Any]], quiet: bool = False) -> dict[str, Any]:
    """{"rounds": each round's figures, "serving_overhead" / "ratios": the median over the
    rounds of each overhead / --compare ratio (where the rounds have them)}."""
    out: dict[str, Any] = {"rounds": rounds}
    fleet = [r.get("fleetllm", r) for r in rounds]
    if "serving_overhead" in fleet[0]:
        out["serving_overhead"] = {k: statistics.median(f["serving_overhead"][k] for f in fleet)
                                   for k in OVERHEADS}
        if not quiet:
            print(f"{' mean TPOT: server / replay (ms), overhead ':=^60}")
            for i, f in enumerate(fleet):
                tpots = f"{f['mean_tpot_ms']:.2f} / {f['offline_replay']['mean_tpot_ms']:.2f}"
                print(f"round {i + 1:<10}{tpots:>30}{f['serving_overhead']['tpot']:>+14.1%}")
            _print_overhead(out["serving_overhead"], "serving overhead, median of the rounds")
    if "ratios" in rounds[0]:
        out["ratios"] = {k: statistics.median(r["ratios"][k] for r in rounds)
                         for k in rounds[0]["ratios"]}
        if not quiet:
            print_ratios(out["ratios"], f"fleetllm / vllm serve, median of {len(rounds)}")
    return out


def _print_overhead(overhead: dict[str, float], title: str) -> None:
    print(f"{f' {title} ':=^60}")
    for key in OVERHEADS:
        print(f"{'mean ' + key.upper():<40}{overhead[key]:>19.1%} ")
    print("=" * 60)


def replay(server_args: list[str], prompts: list[tuple[Any, int]], arrivals: list[float],
           temperature: float, max_concurrency: int | None, results: list[Any]) -> float:
    """Run `prompts` (prompt, output length) through an in-process engine made from
    `server_args`, request i admitted `arrivals[i]` seconds after the start, filling in
    `results[i]` (a fresh serve.RequestResult each) as the client would. Returns the duration."""
    from fleetllm.engine.llm_engine import LLMEngine

    model, kwargs = engine_args(server_args)
    engine = LLMEngine.from_engine_args(model, **kwargs)
    try:
        return _loop(engine, prompts, arrivals, temperature, max_concurrency, results)
    finally:
        engine.shutdown()


def engine_args(server_args: list[str]) -> tuple[str, dict[str, Any]]:
    """The checkpoint and engine keyword arguments `fleetllm serve SERVER_ARGS` would use."""
    from fleetllm.engine.arg_utils import engine_kwargs_from, resolve_model
    from fleetllm.entrypoints.openai.cli_args import add_serve_args

    args = add_serve_args(argparse.ArgumentParser(prog="fleetllm serve")).parse_args(server_args)
    return resolve_model(args.model_tag or args.model), engine_kwargs_from(args,
                                                                            args.engine_actions)


def _loop(engine: Any, prompts: list[tuple[Any, int]], arrivals: list[float],
          temperature: float, max_concurrency: int | None, results: list[Any]) -> float:
    from fleetllm.sampling_params import SamplingParams

    sent: dict[str, float] = {}  # request id -> when the client would have sent it
    last: dict[str, float] = {}  # request id -> when its latest token came back
    due = deque(sorted(range(len(prompts)), key=lambda i: arrivals[i]))
    start = time.perf_counter()
    # When each --max-concurrency slot opened (the client's gate): a request is sent at its
    # arrival or when a slot opens, whichever is later, and its clock starts then, as the
    # client's does; it joins the engine at the end of the step running at that moment.
    slots = deque([start] * max_concurrency) if max_concurrency else None
    while due or sent:
        now = time.perf_counter()
        while due and arrivals[due[0]] <= now - start and (slots is None or slots):
            i = due.popleft()
            prompt, output_len = prompts[i]
            if not isinstance(prompt, str):
                prompt = {"prompt_token_ids": list(prompt)}
            engine.add_request(str(i), prompt, SamplingParams(
                max_tokens=output_len, temperature=temperature, ignore_eos=True))
            at = max(start + arrivals[i], slots.popleft() if slots is not None else start)
            sent[str(i)] = last[str(i)] = at
        if not sent:
            time.sleep(max(0.0, arrivals[due[0]] - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            result, rid = results[int(out.request_id)], out.request_id
            tokens = len(out.outputs[0].token_ids)
            if tokens > result.output_tokens:
                if result.output_tokens == 0:
                    result.ttft = now - sent[rid]
                else:
                    result.itls.append(now - last[rid])
                result.output_tokens, last[rid] = tokens, now
            if out.finished:
                result.e2e = now - sent.pop(rid)
                if slots is not None:
                    slots.append(now)
                result.ok = out.outputs[0].finish_reason == "length" and tokens > 0
                if not result.ok:
                    result.error = out.error or f"finished early: {out.outputs[0].finish_reason}"
    return time.perf_counter() - start
