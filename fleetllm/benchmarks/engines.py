"""The engines the benchmarks time and how they take turns, shared by the throughput benchmark
(generate, and --task embed in embed.py) and the latency one: fleetllm behind LLM, the dtype it
runs in, the --compare peer list, and the rounds (every engine warmed once, then each timed in
turn, best round kept)."""

from __future__ import annotations

import time

import torch

from fleetllm.benchmarks import workload


def expert_load(llm) -> tuple[dict | None, str | None]:
    """A mixture-of-experts model's routing over the run (LLMEngine.expert_load, warm-up
    included): figures for --json ({"imbalance": {layer: max/mean}, "tokens": {layer:
    [per expert]}}) and the line bench prints; (None, None) for a dense model."""
    from fleetllm.engine.expert_load import imbalance, summary

    counts = llm.llm_engine.expert_load()
    if not counts:
        return None, None
    return {"imbalance": imbalance(counts), "tokens": counts}, summary(counts)


def engine_dtype(llm) -> torch.dtype:
    """The dtype fleetllm runs the model in (--dtype, or the checkpoint's: "auto")."""
    config = llm.llm_engine.config
    return config.model_config.torch_dtype(config.device_config.device)


def compare_peers(text: str | None, known: set[str], default: set[str]) -> set[str]:
    peers = set(default) if text is None else \
        {p.strip() for p in text.split(",") if p.strip() not in ("", "none")}
    unknown = peers - known
    if unknown:
        raise ValueError(f"--compare: unknown peers {sorted(unknown)} ({', '.join(sorted(known))}"
                         f", none)")
    return peers


class FleetEngine:
    """fleetllm: an LLM loaded once under a name; the subclasses say what a round runs.
    shutdown() it when done."""

    def __init__(self, name: str, model: str, kwargs: dict):
        from fleetllm import LLM

        self.name = name
        self.llm = LLM(model, **kwargs)


class FleetGenerate(FleetEngine):
    """fleetllm through LLM.generate; the prefix cache is emptied before every run, so no
    round reuses the previous round's prompts. With lora_requests, request i runs through
    adapter i mod len(lora_requests) (bench throughput --lora)."""

    def __init__(self, name: str, model: str, kwargs: dict, lora_requests: list | None = None):
        super().__init__(name, model, kwargs)
        self.lora_requests = lora_requests

    def run(self, requests: list[workload.Request]) -> tuple[list[list[int]], list[float]]:
        from fleetllm import SamplingParams

        self.llm.llm_engine.scheduler.block_manager.reset_prefix_cache()
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                  for r in requests]
        loras = {} if not self.lora_requests else {"lora_request": [
            self.lora_requests[i % len(self.lora_requests)] for i in range(len(requests))]}
        outs = self.llm.generate([{"prompt_token_ids": r.prompt} for r in requests], params,
                                 use_tqdm=False, **loras)
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        return [o.outputs[0].token_ids for o in outs], ttft


def measure(engines, requests, repeat: int, probe=None) -> dict:
    """{name: (best seconds, outputs of the first round, TTFTs of the best round)}; probe()
    runs after every round."""
    warm = requests[: max(2, len(requests) // 4)]
    for e in engines:  # warm-up: shapes, caches, first-call costs
        e.run([workload.Request(r.prompt, min(r.output_len, 8)) for r in warm])
    results: dict = {}
    for _ in range(max(1, repeat)):
        for e in engines:
            start = time.perf_counter()
            out = e.run(requests)
            seconds = time.perf_counter() - start
            if isinstance(out, workload.TimedRun):  # timed in its own process
                out, seconds = out.outputs, out.seconds
            outputs, ttft = out if isinstance(out, tuple) else (out, None)
            best = results.get(e.name)
            if best is None or seconds < best[0]:
                results[e.name] = (seconds, best[1] if best else outputs, ttft)
        if probe is not None:
            probe()
    return results
