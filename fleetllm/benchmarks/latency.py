"""Latency at one batch size: time to first token, time per output token (p50/p99),
end-to-end latency, decode tokens/s, for fleetllm and HF `generate` on the same prompts in the
same process (and vLLM in its own, --compare vllm), next to the memory-bandwidth bound; and
where a decode step's time goes.

    fleetllm bench latency --preset llama-125m --batch-size 1 [--input-len 128] [--output-len
        128] [--repeat 3] [--compare hf,vllm|none] [--json F] [--speculative-config ...]

Engines take turns; fleetllm steps LLMEngine.step() (streaming, as a server does). The bound:
every weight and the batch's KV read once a step at the read bandwidth measured in this run.
The split: the model's forward against the rest of a step, per forward pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fleetllm.benchmarks import quiet, workload
from fleetllm.benchmarks.engines import compare_peers, engine_dtype, expert_load
from fleetllm.benchmarks.presets import PRESETS
from fleetllm.benchmarks.throughput import add_vllm_args, resolve_source
from fleetllm.engine.arg_utils import HelpFormatter, add_engine_args, engine_kwargs_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a built-in model with dummy weights instead of --model; "
                             "max_model_len 8192 unless given (default: none)")
    parser.add_argument("--batch-size", type=int, default=1, help="requests run together")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds, engines taking turns; each counts its best")
    parser.add_argument("--compare", default="hf",
                        help="hf (transformers generate, same prompts and weights), vllm "
                             "(vLLM's CPU build from .venv-vllm, `make peers`), both "
                             "comma-separated, or none")
    add_vllm_args(parser)
    parser.add_argument("--workload", choices=["random", "copy"], default="random",
                        help="random: prompts of --input-len random tokens; copy: code "
                             "editing, each prompt a function to repeat under a new name "
                             "(copy-heavy, what n-gram speculative decoding drafts; needs the "
                             "model's tokenizer; --input-len ignored)")
    parser.add_argument("--data-seed", dest="bench_seed", type=int, default=0,
                        help="seed for the random prompts")
    parser.add_argument("--json", default=None,
                        help="write every figure to this file (default: none)")
    add_engine_args(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.benchmarks.latency",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


def _timed_forward(worker) -> None:
    """Installed in each worker: record the wall time of every model forward (greedy passes
    in one C call, multi-step decoding's: the call's time split evenly over its passes)."""
    from fleetllm.model import fused

    runner = worker.model_runner
    if getattr(runner, "_bench_times", None) is None:
        inner, inner_passes = runner._forward, fused.run_passes

        def forward(batch, kv_caches):
            start = time.perf_counter()
            try:
                return inner(batch, kv_caches)
            finally:
                runner._bench_times.append(time.perf_counter() - start)

        def run_passes(model, *args, **kwargs):
            start = time.perf_counter()
            tokens = inner_passes(model, *args, **kwargs)
            if tokens is not None and model is runner.model:
                took = time.perf_counter() - start
                runner._bench_times.extend([took / len(tokens)] * len(tokens))
            return tokens

        runner._forward = forward
        fused.run_passes = run_passes
    runner._bench_times = []


def _forward_times(worker) -> list[float]:
    return list(worker.model_runner._bench_times)


class _FleetLatency:
    def __init__(self, model: str, kwargs: dict, name: str = "fleetllm"):
        from fleetllm import LLM

        self.name = name
        self.llm = LLM(model, **kwargs)
        self.engine = self.llm.llm_engine

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        from fleetllm import SamplingParams

        engine = self.engine
        engine.scheduler.block_manager.reset_prefix_cache()
        engine.model_executor.collective_rpc(_timed_forward)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"lat{i}", {"prompt_token_ids": p}, params)
        token_times: dict[str, list[float]] = {f"lat{i}": [] for i in range(len(prompts))}
        step_times, first_decode = [], None
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            step_times.append(now - t0)
            for o in outs:
                times = token_times[o.request_id]
                times += [now] * (len(o.outputs[0].token_ids) - len(times))
            if first_decode is None and all(token_times.values()):
                first_decode = len(step_times)  # the steps after this one are decodes
        forwards = engine.model_executor.collective_rpc(_forward_times)[-1]
        spec = engine.model_executor.metrics.spec_decode
        split = None
        # A step runs one forward, or several passes with multi-step decoding (prompt steps
        # never do): the split is per decode pass.
        if first_decode is not None and first_decode < len(step_times) and \
                len(forwards) >= len(step_times):
            steps, model = step_times[first_decode:], forwards[first_decode:]
            total, fwd = sum(steps), sum(model)
            split = {"steps": len(model), "step_s": total / len(model),
                     "forward_s": fwd / len(model), "other_s": (total - fwd) / len(model),
                     "other_fraction": (total - fwd) / total}
        result = _summary(start, token_times, split)
        if spec is not None:  # this run's counts: the difference from the last run's
            last = getattr(self, "_spec_seen", (0, 0))
            self._spec_seen = (spec.accepted_tokens, spec.draft_tokens)
            accepted, drafted = (a - b for a, b in zip(self._spec_seen, last, strict=True))
            result["spec_decode"] = {"accepted_tokens": accepted, "draft_tokens": drafted,
                                     "draft_acceptance_rate": accepted / drafted
                                     if drafted else 0.0}
        return result


def _summary(start: float, token_times: dict[str, list[float]], split: dict | None) -> dict:
    ttft = [t[0] - start for t in token_times.values()]
    tpot = [b - a for t in token_times.values() for a, b in zip(t, t[1:], strict=False)]
    e2e = [t[-1] - start for t in token_times.values()]
    decode_s = max(t[-1] for t in token_times.values()) - max(t[0] for t in token_times.values())
    new_tokens = sum(len(t) - 1 for t in token_times.values())
    out = {"ttft_s": statistics.mean(ttft), "tpot_p50_s": _pct(tpot, 50),
           "tpot_p99_s": _pct(tpot, 99), "e2e_s": max(e2e),
           "decode_tokens_per_s": new_tokens / decode_s if decode_s > 0 else 0.0}
    if split is not None:
        out["decode_step"] = split
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class _HFLatency:
    name = "HF generate"

    def __init__(self, model):
        self.model = model

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        import torch
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []

        class Clock(BaseStreamer):
            def put(self, value) -> None:
                times.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        with torch.no_grad():
            self.model.generate(torch.tensor(prompts), max_new_tokens=output_len,
                                min_new_tokens=output_len, do_sample=False, pad_token_id=0,
                                eos_token_id=None, streamer=Clock())
        stamps = times[1:]  # the first put() is the prompt
        return _summary(start, {f"r{i}": stamps for i in range(len(prompts))}, None)


class _VLLMLatency:
    """A vLLM configuration stepping its own engine in its process (vllm_peer.py)."""

    def __init__(self, peer):
        self.peer, self.name = peer, peer.name

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        return _summary(0.0, self.peer.run_stream(prompts, output_len), None)


def run(args: argparse.Namespace) -> dict:
    import random

    import torch

    busy = quiet.busy_share()  # before anything of ours runs
    kwargs = engine_kwargs_from(args, args.engine_actions)
    model, dummy_seed = resolve_source(args, kwargs)
    from fleetllm.config_gguf import is_gguf

    gguf = is_gguf(model)  # its peer: llama.cpp on the same file (HF reads no GGUF here)
    peers = compare_peers(args.compare, {"hf", "vllm", "llamacpp"},
                          {"llamacpp"} if gguf else {"hf"})
    if ("llamacpp" in peers and not gguf) or (gguf and peers - {"llamacpp"}):
        raise ValueError("--compare llamacpp is the peer of a GGUF --model, and the only one")
    if "vllm" in peers:  # before loading anything: a missing venv fails at once
        from fleetllm.benchmarks.vllm_peer import vllm_python

        vllm_python()
    engines = [_FleetLatency(model, kwargs)]
    moe, moe_line = None, None
    spec = kwargs.get("speculative_config") is not None
    vllm = None
    try:
        if spec:  # the same engine without speculation, measured in the same run
            off = {k: v for k, v in kwargs.items() if k != "speculative_config"}
            engines.append(_FleetLatency(model, off, "fleetllm (spec off)"))
        arch = engines[0].engine.model_config.arch
        dtype = engine_dtype(engines[0].llm)
        cache_config = engines[0].engine.config.cache_config
        kv_dtype = cache_config.torch_kv_dtype(dtype)
        rng = random.Random(args.bench_seed)
        if args.workload == "copy":
            tokenizer = engines[0].engine.get_tokenizer()
            if tokenizer is None:
                raise SystemExit("--workload copy needs the model's tokenizer; this "
                                 "checkpoint (or preset) has none")
            room = engines[0].engine.model_config.max_model_len - args.output_len
            prompts = workload.copy_edit_prompts(tokenizer, args.batch_size, room,
                                                 args.bench_seed)
            args.input_len = round(sum(map(len, prompts)) / len(prompts))
        else:
            prompts = [[rng.randrange(3, arch.vocab_size) for _ in range(args.input_len)]
                       for _ in range(args.batch_size)]
        if "llamacpp" in peers:
            from fleetllm.benchmarks.llamacpp_peer import LlamaCppLatency

            engines.append(LlamaCppLatency(model, args.input_len, torch.get_num_threads(),
                                           args.batch_size))
        if "hf" in peers:
            from fleetllm.benchmarks.hf_peers import load_hf_model

            engines.append(_HFLatency(load_hf_model(model, dummy_seed, dtype)))
        if "vllm" in peers:
            from fleetllm.benchmarks.vllm_peer import VLLMPeers, parse_configs

            vllm = VLLMPeers(parse_configs(args.vllm_configs, torch.get_num_threads()), model,
                             dummy_seed, dtype, args.input_len + args.output_len,
                             args.vllm_kv_gb)
            engines += [_VLLMLatency(p) for p in vllm.peers]
        for e in engines:  # warm-up
            e.run(prompts, min(args.output_len, 8))
        best: dict[str, dict] = {}
        bandwidth = 0.0
        for _ in range(max(1, args.repeat)):
            for e in engines:
                r = e.run(prompts, args.output_len)
                if e.name not in best or r["decode_tokens_per_s"] > \
                        best[e.name]["decode_tokens_per_s"]:
                    best[e.name] = r
            # after every round, best kept: the machine as the engines found it
            bandwidth = max(bandwidth, workload.read_bandwidth())
        moe, moe_line = expert_load(engines[0].llm)
    finally:
        for e in engines:
            if isinstance(e, _FleetLatency):
                e.llm.shutdown()
        if vllm is not None:
            vllm.close()
    ctx = args.input_len + args.output_len / 2  # mean context over the decode steps
    kv = args.batch_size * ctx * workload.kv_bytes_per_token(arch, kv_dtype.itemsize)
    quant = None if gguf else workload.hf_quantization(model)
    if gguf:
        weights = workload.gguf_weight_bytes(model)
    elif quant is not None:  # AWQ, GPTQ, compressed-tensors: the tensors as stored
        weights = workload.hf_weight_bytes(model)
    else:
        weights = workload.weight_bytes(arch, dtype.itemsize, args.batch_size)
    step_bytes = weights + kv
    bound = args.batch_size * bandwidth * 1e9 / step_bytes
    dtype_name = str(dtype).removeprefix("torch.")
    if gguf:
        dtype_name = f"GGUF {workload.gguf_file_type(model)}, activations {dtype_name}"
    elif quant is not None:
        dtype_name = f"{workload.hf_quant_label(quant)}, activations {dtype_name}"
    figures = {"model": args.preset or model, "dtype": dtype_name,
               "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
               "batch_size": args.batch_size,
               "input_len": args.input_len, "output_len": args.output_len,
               "torch_threads": torch.get_num_threads(), "engines": best,
               "read_bandwidth_gb_s": bandwidth, "decode_step_bytes": step_bytes,
               "bandwidth_bound_tokens_per_s": bound, "busy_before_run": busy}
    if quant is not None:
        figures["quantization"] = workload.hf_quant_label(quant)
    print(f"model: {args.preset or model} ({dtype_name}); batch {args.batch_size}, "
          f"{args.input_len} prompt "
          f"tokens, {args.output_len} output tokens; torch threads {torch.get_num_threads()}; "
          f"best of {args.repeat} rounds, engines taking turns")
    if warning := quiet.busy_warning(busy):
        print(warning)
    width = max(len(n) for n in best) + 2
    for name, r in best.items():
        print(f"{name + ':':{width}s} TTFT {r['ttft_s'] * 1e3:7.1f} ms  TPOT p50 "
              f"{r['tpot_p50_s'] * 1e3:6.2f} ms  p99 {r['tpot_p99_s'] * 1e3:6.2f} ms  "
              f"end-to-end {r['e2e_s']:6.2f} s  decode {r['decode_tokens_per_s']:7.1f} "
              "tokens/s")
    ours = best["fleetllm"]["decode_tokens_per_s"]
    if "fleetllm (spec off)" in best:
        ratio = ours / best["fleetllm (spec off)"]["decode_tokens_per_s"]
        sd = best["fleetllm"]["spec_decode"]
        figures["ratio_decode_spec_on_vs_off"] = ratio
        print(f"speculative decoding: {ratio:.2f}x the decode tokens/s without it; drafts "
              f"accepted {sd['accepted_tokens']} of {sd['draft_tokens']} "
              f"({sd['draft_acceptance_rate']:.1%})")
    if "llama.cpp" in best:
        ratio = ours / best["llama.cpp"]["decode_tokens_per_s"]
        figures["ratio_decode_vs_llamacpp"] = ratio
        print(f"ratio fleetllm / llama.cpp decode tokens/s: {ratio:.2f}x (llama-bench tg"
              f"{args.output_len} @ d{args.input_len}, the same file and thread count)")
    if "HF generate" in best:
        ratio = ours / best["HF generate"]["decode_tokens_per_s"]
        figures["ratio_decode_vs_hf"] = ratio
        print(f"ratio fleetllm / HF decode tokens/s: {ratio:.2f}x")
    configs = [n for n in best if n.startswith("vLLM (")]
    if configs:
        top = max(configs, key=lambda n: best[n]["decode_tokens_per_s"])
        ratio = ours / best[top]["decode_tokens_per_s"]
        figures["vllm"] = {"best": top, "ratio_decode": ratio}
        print(f"ratio fleetllm / vLLM best ({top[6:-1]}) decode tokens/s: {ratio:.2f}x")
    figures["fraction_of_bound"] = ours / bound
    print(f"memory-bandwidth bound: {bandwidth:.1f} GB/s read (measured now); a decode step "
          f"reads {step_bytes / 1e6:.0f} MB (weights {weights / 1e6:.0f} MB in {dtype_name}, "
          f"KV {kv / 1e6:.1f} MB in {figures['kv_cache_dtype']}) -> {bound:.1f} tokens/s; "
          f"fleetllm reaches {ours / bound:.0%}")
    split = best["fleetllm"].get("decode_step")
    if split:
        print(f"decode step: {split['step_s'] * 1e3:.2f} ms = model forward "
              f"{split['forward_s'] * 1e3:.2f} ms + everything else {split['other_s'] * 1e3:.2f}"
              f" ms ({split['other_fraction']:.1%}: scheduling, input preparation, sampling, "
              f"detokenization, outputs; mean of {split['steps']} passes)")
    if moe_line:
        figures["expert_load"] = moe
        print(moe_line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
