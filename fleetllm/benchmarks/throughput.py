"""Offline throughput: the same requests through fleetllm (LLM.generate) and its peers in one
process, next to this machine's roofline.

    fleetllm bench throughput --preset llama-125m --compare hf,hf-cb [--repeat 2] [--json F]
    fleetllm bench throughput --preset llama-1b --compare vllm [--vllm-configs all]
    fleetllm bench throughput --model FILE.gguf [--compare llamacpp]
    fleetllm bench throughput [--model DIR] [--num-prompts N] [--input-len N|LOW:HIGH]
        [--output-len N|LOW:HIGH] [--shared-prefix N] [--lora N] [--task embed] [engine flags]

Engines are loaded and warmed once, then take turns for --repeat rounds, each keeping its best:
requests/s and tokens/s, fleetllm's ratio to each peer (`hf`, `hf-cb`, vLLM: vllm_peer.py; a
GGUF file's: `llamacpp`, llamacpp_peer.py), its share of the roofline (the workload's FLOPs at
the best matmul rate measured on the model's shapes); --shared-prefix, --lora (lora.py) and
--task embed (embed.py) add their own figures.
"""

from __future__ import annotations

import argparse
import json

import torch

from fleetllm.benchmarks import embed, lora, quiet, workload
from fleetllm.benchmarks.engines import (
    FleetEngine,
    FleetGenerate,
    compare_peers,
    engine_dtype,
    expert_load,
    measure,
)
from fleetllm.benchmarks.llamacpp_peer import LlamaCppThroughput, llamacpp_tool
from fleetllm.benchmarks.presets import PRESETS, preset_dir
from fleetllm.config_gguf import is_gguf
from fleetllm.engine.arg_utils import (
    HelpFormatter,
    add_engine_args,
    engine_kwargs_from,
    resolve_model,
)
from fleetllm.errors import ConfigurationError

PRESET_MAX_MODEL_LEN = 8192
_PRESET_DEFAULTS = dict(num_prompts=64, input_len=(16, 256), output_len=(16, 64),
                        hf_batch_size=16, repeat=2)
_DEFAULTS = dict(num_prompts=64, input_len=(128, 128), output_len=(64, 64), hf_batch_size=8,
                 repeat=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a built-in model with dummy weights instead of --model, and the "
                             "performance workload: 64 requests, 16:256 in, 16:64 out "
                             "(--task embed: 256 inputs, 16:256); max_model_len 8192 unless "
                             "given (default: none)")
    workload.add_workload_args(parser, "64; 256 with --task embed",
                               "128; 16:256 with --preset or --task embed",
                               "64; 16:64 with --preset")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of one random prefix every prompt starts with; fleetllm "
                             "then also runs without prefix caching and both mean TTFTs are "
                             "printed")
    parser.add_argument("--compare", default=None,
                        help="peers: hf (transformers generate), hf-cb (transformers "
                             "continuous batching), both in this process, vllm (vLLM's CPU "
                             "build from .venv-vllm, `make peers`), comma-separated; with a "
                             "GGUF --model: llamacpp (llama-batched-bench on the same file, "
                             "`make llamacpp`); or none (default: hf; llamacpp for a GGUF)")
    add_vllm_args(parser)
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="HF generate batch size (left-padded); 0 skips the HF peer "
                             "(default: 8; 16 with --preset; 32 with --task embed)")
    parser.add_argument("--hf-sort", action="store_true",
                        help="also run HF generate with the requests sorted by output and "
                             "prompt length (its most favourable static batches)")
    parser.add_argument("--compare-backend", default=None,
                        help="also run fleetllm with this distributed_executor_backend "
                             "(same requests, same run) and print the ratio (default: none)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed rounds, engines taking turns; each counts its best "
                             "(default: 3; 2 with --preset)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring the matmul rate")
    parser.add_argument("--json", default=None,
                        help="write every figure to this file (default: none)")
    lora.add_lora_args(parser)
    add_engine_args(parser)


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-configs", default="all",
                        help="vLLM configurations with --compare vllm: all (eager and "
                             "compiled, each with VLLM_CPU_OMP_THREADS_BIND auto and fleetllm's "
                             "cores) or comma-separated MODE:BIND, e.g. compiled:auto,eager:cores")
    parser.add_argument("--vllm-kv-gb", type=int, default=1,
                        help="VLLM_CPU_KVCACHE_SPACE of each vLLM process, GiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.benchmarks.throughput",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


def resolve_source(args: argparse.Namespace, kwargs: dict) -> tuple[str, int | None]:
    """The model directory and, for dummy weights, their seed (--preset implies
    load_format="dummy")."""
    if args.preset and args.model:
        raise ValueError("give --preset or --model, not both")
    if args.preset:
        kwargs.setdefault("load_format", "dummy")
        # Not the model's full context (llama-1b: 131072, a 4 GiB bf16 KV cache for one
        # sequence, more than the default KV budget): the workloads are far shorter.
        kwargs.setdefault("max_model_len", min(PRESET_MAX_MODEL_LEN,
                                               PRESETS[args.preset]["max_position_embeddings"]))
        return preset_dir(args.preset), kwargs.get("seed", 0)
    model = resolve_model(args.model)
    dummy = kwargs.get("load_format") == "dummy"
    return model, kwargs.get("seed", 0) if dummy else None


def _engines(args: argparse.Namespace, model: str, kwargs: dict, dummy_seed: int | None,
             peers: set[str], adapters: lora.Adapters | None = None):
    """fleetllm's engines and the in-process peers (vLLM's come once the requests are known:
    its max_model_len is theirs)."""
    if "vllm" in peers:  # before loading anything: a missing venv fails at once
        from fleetllm.benchmarks.vllm_peer import vllm_python

        vllm_python()
    if "llamacpp" in peers:  # likewise a missing build
        llamacpp_tool("llama-batched-bench")
    engines = [FleetGenerate("fleetllm", model, kwargs)]
    if adapters is not None:
        engines.append(FleetGenerate(adapters.label, model, adapters.engine_kwargs(kwargs),
                                     adapters.requests()))
    if args.compare_backend:
        engines.append(FleetGenerate(f"fleetllm ({args.compare_backend})", model,
                              {**kwargs, "distributed_executor_backend": args.compare_backend}))
    if args.shared_prefix:
        engines.append(FleetGenerate("fleetllm (no prefix caching)", model,
                              {**kwargs, "enable_prefix_caching": False}))
    if peers & {"hf", "hf-cb"}:
        from fleetllm.benchmarks.hf_peers import HFContinuousBatching, HFGenerate, load_hf_model

        hf = load_hf_model(model, dummy_seed, engine_dtype(engines[0].llm))
        if "hf" in peers:
            engines.append(HFGenerate(hf, args.hf_batch_size))
            if args.hf_sort:
                engines.append(HFGenerate(hf, args.hf_batch_size, sort=True))
        if "hf-cb" in peers:
            engines.append(HFContinuousBatching(hf))
    if "llamacpp" in peers:  # after loading fleetllm: its thread count is set by then
        engines.append(LlamaCppThroughput(model, torch.get_num_threads()))
    return engines


def run(args: argparse.Namespace) -> dict:
    busy = quiet.busy_share()  # before anything of ours runs
    kwargs = engine_kwargs_from(args, args.engine_actions)
    model, dummy_seed = resolve_source(args, kwargs)
    if embed.is_pooling(model, kwargs):  # --task embed, or an embedding checkpoint
        return embed.run(args, model, kwargs, dummy_seed)
    for name, value in (_PRESET_DEFAULTS if args.preset else _DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    peers = _peers(args, model)
    adapters = lora.Adapters(args, model) if args.lora else None
    engines = []
    vllm = None
    moe, moe_line = None, None
    try:
        engines = _engines(args, model, kwargs, dummy_seed, peers, adapters)
        llm = engines[0].llm
        arch = llm.llm_engine.model_config.arch
        dtype = engine_dtype(llm)
        tokenizer = llm.get_tokenizer()
        vocab = min(arch.vocab_size, len(tokenizer) if tokenizer else arch.vocab_size)
        requests = workload.make_requests(args, vocab, tokenizer, args.shared_prefix)
        if "vllm" in peers:
            from fleetllm.benchmarks.vllm_peer import VLLMPeers, parse_configs

            vllm = VLLMPeers(parse_configs(args.vllm_configs, torch.get_num_threads()), model,
                             dummy_seed, dtype, max(len(r.prompt) + r.output_len
                                                    for r in requests), args.vllm_kv_gb)
            engines += vllm.peers
        rows = _roofline_rows(requests, llm.llm_engine.config)
        rates: dict[int, dict[str, float]] = {}

        def probe() -> None:  # once per round: the machine as the engines found it
            for r in rows:
                for kind, value in workload.matmul_rate(arch, r, dtype).items():
                    rates.setdefault(r, {})[kind] = max(rates.get(r, {}).get(kind, 0), value)

        results = measure(engines, requests, args.repeat,
                           None if args.no_roofline or args.shared_prefix or args.lora
                           else probe)
        moe, moe_line = expert_load(llm)
    finally:
        for e in engines:
            if isinstance(e, FleetEngine):
                e.llm.shutdown()
        if vllm is not None:
            vllm.close()
        if adapters is not None:
            adapters.close()
    n_in = sum(len(r.prompt) for r in requests)
    n_out = sum(r.output_len for r in requests)
    dtype_name = str(dtype).removeprefix("torch.")
    if is_gguf(model):
        dtype_name = f"GGUF {workload.gguf_file_type(model)}, activations {dtype_name}"
    quant = workload.hf_quantization(model)
    label = dtype_name if quant is None else \
        f"{workload.hf_quant_label(quant)}, activations {dtype_name}"
    figures: dict = {"model": args.preset or model, "dtype": dtype_name, "requests": len(requests),
                     "input_tokens": n_in, "output_tokens": n_out,
                     "torch_threads": torch.get_num_threads(), "repeat": args.repeat,
                     "engines": {}, "busy_before_run": busy}
    if quant is not None:
        figures["quantization"] = workload.hf_quant_label(quant)
    print(f"model: {args.preset or model} ({label})")
    print(f"requests: {len(requests)}, {n_in} input + {n_out} output tokens "
          f"({_span(requests)}); torch threads: {torch.get_num_threads()}; best of "
          f"{args.repeat} rounds, engines taking turns")
    if warning := quiet.busy_warning(busy):
        print(warning)
    for e in engines:
        seconds, _, _ = results[e.name]
        # llama.cpp ran the requests' mean lengths: its own token counts
        shape = e.shape(requests) if isinstance(e, LlamaCppThroughput) else None
        e_in, e_out = (shape.input_tokens, shape.output_tokens) if shape else (n_in, n_out)
        f = figures["engines"][e.name] = {
            "seconds": seconds, "requests_per_s": len(requests) / seconds,
            "input_tokens_per_s": e_in / seconds, "output_tokens_per_s": e_out / seconds,
            "total_tokens_per_s": (e_in + e_out) / seconds}
        print(f"{e.name + ':':32s} {f['requests_per_s']:7.2f} requests/s  input "
              f"{f['input_tokens_per_s']:8.1f}  output {f['output_tokens_per_s']:7.1f}  total "
              f"{f['total_tokens_per_s']:8.1f} tokens/s  ({seconds:.2f} s)")
    _ratios([e for e in engines if adapters is None or e.name != adapters.label], results,
            figures, kwargs.get("distributed_executor_backend", "default"))
    if adapters is not None:
        lora.report(adapters, results, figures)
    if vllm is not None:
        _vllm_ratio(engines, results, figures)
    for e in engines:
        if isinstance(e, LlamaCppThroughput):
            e.report(requests, figures)
    if args.shared_prefix:
        _prefix_figures(results, figures)
    if args.shared_prefix:  # the cache skips most of the FLOPs a roofline would count
        print("roofline: not meaningful with --shared-prefix (prefix caching skips the "
              "shared prefix's FLOPs)")
    elif adapters is not None:  # the roofline would not count the adapters' FLOPs
        print("roofline: not measured with --lora")
    elif not args.no_roofline:
        _roofline(arch, requests, results["fleetllm"][0], rows, rates, figures, dtype_name)
    if moe_line:
        figures["expert_load"] = moe
        print(moe_line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


def _span(requests: list[workload.Request]) -> str:
    ins = [len(r.prompt) for r in requests]
    outs = [r.output_len for r in requests]
    return f"prompts {min(ins)}-{max(ins)}, outputs {min(outs)}-{max(outs)}"


def _ratios(engines, results: dict, figures: dict, backend: str) -> None:
    ours, our_outputs, _ = results["fleetllm"]
    figures["ratios"] = {}
    for e in engines[1:]:
        if e.name.startswith("vLLM (") or isinstance(e, LlamaCppThroughput):
            continue  # vLLM: one ratio, to its best configuration; llama.cpp: no outputs
        seconds, outputs, _ = results[e.name]
        same = sum(a == b for a, b in zip(our_outputs, outputs, strict=True))
        label = {"HF generate": "HF", "HF generate (sorted)": "HF (sorted)",
                 "HF continuous batching": "HF-CB"}.get(e.name, e.name)
        if e.name == "fleetllm (no prefix caching)":
            print(f"ratio with / without prefix caching: {seconds / ours:.2f}x  (identical "
                  f"outputs {same}/{len(outputs)})")
        elif e.name.startswith("fleetllm ("):
            print(f"ratio {backend} / {e.name[10:-1]}: {seconds / ours:.3f}x  (identical "
                  f"outputs {same}/{len(outputs)})")
        else:
            print(f"ratio fleetllm / {label}: {seconds / ours:.2f}x  (identical outputs "
                  f"{same}/{len(outputs)})")
        figures["ratios"][e.name] = {"speedup": seconds / ours, "identical_outputs": same}


def _peers(args: argparse.Namespace, model: str) -> set[str]:
    """The --compare peers; a GGUF file's peer is llama.cpp, and only it (the others read no
    GGUF here), on the workload's shape (no shared prefix, no adapters)."""
    gguf = is_gguf(model)
    peers = compare_peers(args.compare, {"hf", "hf-cb", "vllm", "llamacpp"},
                          set() if args.lora else {"llamacpp"} if gguf else {"hf"})
    if args.hf_batch_size == 0:
        peers.discard("hf")
    if ("llamacpp" in peers and not gguf) or (gguf and peers - {"llamacpp"}):
        raise ConfigurationError("--compare llamacpp is the peer of a GGUF --model, and the "
                                 "only one")
    if "llamacpp" in peers and (args.shared_prefix or args.lora):
        raise ConfigurationError("--compare llamacpp runs neither --shared-prefix (llama-"
                                 "batched-bench shares a whole prompt or none) nor --lora")
    return peers


def _vllm_ratio(engines, results: dict, figures: dict) -> None:
    """fleetllm against vLLM's best configuration; every configuration's identical outputs."""
    ours, our_outputs, _ = results["fleetllm"]
    names = [e.name for e in engines if e.name.startswith("vLLM (")]
    same = {n: sum(a == b for a, b in zip(our_outputs, results[n][1], strict=True))
            for n in names}
    best = min(names, key=lambda n: results[n][0])
    seconds = results[best][0]
    figures["vllm"] = {"best": best, "speedup": seconds / ours, "identical_outputs": same[best],
                       "configs": {n: {"seconds": results[n][0], "identical_outputs": same[n]}
                                   for n in names}}
    print(f"ratio fleetllm / vLLM best ({best[6:-1]}): {seconds / ours:.2f}x  (identical "
          f"outputs {same[best]}/{len(our_outputs)}; per configuration "
          f"{', '.join(str(same[n]) for n in names)})")


def _prefix_figures(results: dict, figures: dict) -> None:
    _, with_out, with_ttft = results["fleetllm"]
    _, without_out, without_ttft = results["fleetllm (no prefix caching)"]
    a = sum(with_ttft) / len(with_ttft)
    b = sum(without_ttft) / len(without_ttft)
    same = sum(x == y for x, y in zip(with_out, without_out, strict=True))
    figures["shared_prefix"] = {"mean_ttft_s": a, "mean_ttft_no_caching_s": b,
                                "ttft_ratio": b / a, "identical_outputs": same}
    print(f"shared prefix: mean TTFT {a * 1e3:.0f} ms with prefix caching, {b * 1e3:.0f} ms "
          f"without: {b / a:.1f}x lower (identical outputs {same}/{len(with_out)})")


def _roofline_rows(requests, config) -> tuple[int, list[int]]:
    """Matmul row counts for the roofline: the decode batch, then prefill-sized ones."""
    sc = config.scheduler_config
    decode = max(1, min(len(requests), sc.max_num_seqs))
    prefill = sorted({r for r in (512, sc.max_num_batched_tokens) if r > decode} or {512})
    return [decode, *prefill]


def _roofline(arch, requests, seconds: float, rows: list[int], rates: dict, figures: dict,
              dtype: str) -> None:
    """Roofline time = prefill FLOPs at the rate of prefill-sized matmuls + decode and LM-head
    FLOPs at the rate of decode-batch-sized ones (rates: the best of the rounds), in the
    engine's dtype. Two rates: plain torch matmul (`x @ W.T`: the issue's definition) and the
    best this machine does (oneDNN with packed weights, as fleetllm runs them)."""
    flops = workload.workload_flops(arch, requests)
    decode_rows, prefill_rows = rows[0], rows[1:]
    decode_rate = rates[decode_rows]
    tokens = sum(len(r.prompt) + r.output_len for r in requests)
    decode_flops = flops.decode + flops.lm_head
    figures["roofline"] = {
        "dtype": dtype, "workload_gflop": flops.total / 1e9, "prefill_gflop": flops.prefill / 1e9,
        "decode_gflop": decode_flops / 1e9, "decode_rows": decode_rows,
        "decode_gflops": decode_rate,
        "prefill_gflops": {str(r): rates[r] for r in prefill_rows}}
    for kind, label in (("dense", f"{dtype} torch matmul"), ("best", f"{dtype} best matmul")):
        prefill_rate = max(rates[r][kind] for r in prefill_rows)
        roof = flops.prefill / (prefill_rate * 1e9) + decode_flops / (decode_rate[kind] * 1e9)
        figures["roofline"][kind] = {"seconds": roof, "total_tokens_per_s": tokens / roof,
                                     "fraction": roof / seconds}
        print(f"roofline ({label}): {flops.total / 1e12:.2f} TFLOP = {flops.prefill / 1e12:.2f}"
              f" prefill at {prefill_rate:.0f} GFLOP/s + {decode_flops / 1e12:.2f} decode at "
              f"{decode_rate[kind]:.0f} GFLOP/s ({decode_rows} rows) = {roof:.2f} s, "
              f"{tokens / roof:.0f} total tokens/s; fleetllm reaches {roof / seconds:.0%}")


if __name__ == "__main__":
    raise SystemExit(main())
