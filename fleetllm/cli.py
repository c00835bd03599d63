"""The `fleetllm` command: generate, serve, bench throughput | latency | rpc | serve | recovery |
grammar, quantize (a Hugging Face checkpoint to a GGUF file).

The console-script entry point, on top of everything: no fleetllm module imports it. The
engine flags it shares with the server and the benchmarks are fleetllm.engine.arg_utils'.
Errors print one line and exit non-zero; --debug (before or after the subcommand) shows the
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from fleetllm import __version__
from fleetllm.engine.arg_utils import (
    HelpFormatter,
    add_engine_args,
    engine_kwargs_from,
    resolve_model,
)


def cmd_generate(args: argparse.Namespace) -> int:
    from fleetllm import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                            max_tokens=args.max_tokens, stop=args.stop or None,
                            ignore_eos=args.ignore_eos,
                            repetition_penalty=args.repetition_penalty)
    with LLM(resolve_model(args.model), **engine_kwargs_from(args, args.engine_actions)) as llm:
        outputs = llm.generate(args.prompts, params, use_tqdm=not args.quiet)
    for out in outputs:
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            continue
        for completion in out.outputs:
            if args.quiet:
                print(out.prompt + completion.text)
            else:
                print(f"--- {out.prompt!r} ({completion.finish_reason})")
                print(out.prompt + completion.text)
    return 1 if any(o.error for o in outputs) else 0


def _add_generate(sub: Any, common: argparse.ArgumentParser) -> None:
    gen = sub.add_parser("generate", parents=[common], formatter_class=HelpFormatter,
                         help="generate completions for prompts",
                         description="Generate completions for prompts (vLLM's flag names).")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens per completion")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest; -1: "
                     "all")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this "
                     "fraction of the likeliest's probability")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed for this request's sampling (default: none, unseeded)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 discourages repeating prompt and output tokens")
    gen.add_argument("--stop", action="append",
                     help="stop string, repeatable (default: none)")
    gen.add_argument("--ignore-eos", action="store_true", help="continue past end-of-sequence")
    gen.add_argument("--quiet", action="store_true", help="print only prompt + completion")
    add_engine_args(gen)
    gen.set_defaults(run=cmd_generate)


def _run_serve(args: argparse.Namespace) -> int:
    from fleetllm.entrypoints.openai.launcher import run_serve  # the web stack, only here

    return run_serve(args)


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    from fleetllm.entrypoints.openai.cli_args import add_serve_args

    serve = sub.add_parser("serve", parents=[common], formatter_class=HelpFormatter,
                           help="serve an OpenAI-compatible HTTP API",
                           description="Serve an OpenAI-compatible HTTP API (vLLM's flags).")
    add_serve_args(serve)
    serve.set_defaults(run=_run_serve)


def _run_proxy(args: argparse.Namespace) -> int:
    from fleetllm.entrypoints.proxy.launcher import run_proxy  # the web stack, only here

    return run_proxy(args)


def _add_proxy(sub: Any, common: argparse.ArgumentParser) -> None:
    from fleetllm.entrypoints.proxy.launcher import add_proxy_args

    proxy = sub.add_parser("proxy", parents=[common], formatter_class=HelpFormatter,
                           help="one OpenAI API over prefill and decode instances",
                           description="Disaggregated prefill and decode: an OpenAI-compatible "
                           "front that sends each request's prompt to a prefill instance and "
                           "its decoding to a decode instance (vLLM's toy-proxy protocol; "
                           "docs/kv_transfer.md).")
    add_proxy_args(proxy)
    proxy.set_defaults(run=_run_proxy)


def _run_bench_serve(args: argparse.Namespace) -> int | dict:
    from fleetllm.benchmarks import serve

    return serve.main(args.argv)


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    from fleetllm.benchmarks import grammar, latency, perplexity, recovery, rpc, throughput

    bench = sub.add_parser("bench", help="throughput | latency | rpc | serve | recovery | "
                           "grammar | perplexity",
                           description="Benchmarks; `fleetllm bench NAME --help` for each.")
    which = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, module in (("throughput", throughput), ("latency", latency), ("rpc", rpc),
                         ("recovery", recovery), ("grammar", grammar),
                         ("perplexity", perplexity)):
        summary = (module.__doc__ or name).split("\n\n")[0]
        parser = which.add_parser(name, parents=[common], formatter_class=HelpFormatter,
                                  help=summary.split(":")[0], description=summary)
        module.add_arguments(parser)
        parser.set_defaults(run=module.run)
    # bench serve passes every flag it does not know to the server it starts: it parses its
    # own arguments (and --help).
    serve = which.add_parser("serve", add_help=False, help="online serving load benchmark")
    serve.set_defaults(run=_run_bench_serve, passthrough=True)


def _run_quantize(args: argparse.Namespace) -> int:
    import tempfile

    from fleetllm.quant.gguf_export import export_gguf
    from fleetllm.quant.hf_export import FORMATS, export_quantized

    if (args.hf_dir is None) == (args.preset is None):
        raise SystemExit("fleetllm quantize: give HF_DIR or --preset, not both")
    with tempfile.TemporaryDirectory(prefix="fleetllm-preset-") as tmp:
        src = args.hf_dir
        if args.preset:  # the benchmarks' dummy weights (seed 0), bf16, a placeholder BPE
            import torch

            from fleetllm.benchmarks.checkpoint import (
                write_byte_bpe_tokenizer,
                write_dummy_checkpoint,
            )
            from fleetllm.benchmarks.presets import PRESETS, preset_dir

            src = write_dummy_checkpoint(preset_dir(args.preset), tmp, 0, torch.bfloat16)
            write_byte_bpe_tokenizer(src, PRESETS[args.preset]["vocab_size"])
        if args.type in FORMATS:
            path = export_quantized(src, args.out, args.type, bits=args.bits,
                                    group_size=args.group_size, sym=args.sym,
                                    act_order=args.act_order)
        else:
            path = export_gguf(src, args.out, args.type, llama_quantize=args.llama_quantize)
    print(path)
    return 0


def _add_quantize(sub: Any, common: argparse.ArgumentParser) -> None:
    from fleetllm.benchmarks.presets import PRESETS as BENCH_PRESETS
    from fleetllm.quant.gguf_mix import PRESETS
    from fleetllm.quant.hf_export import FORMATS

    quant = sub.add_parser("quantize", parents=[common], formatter_class=HelpFormatter,
                           help="write a Hugging Face checkpoint as a GGUF file, or as an "
                           "AWQ / GPTQ / compressed-tensors checkpoint",
                           description="Write a Hugging Face checkpoint directory (Llama, "
                           "Mistral, Qwen2, Qwen3) as a GGUF file, quantized the way "
                           "llama-quantize's presets mix types; or (--type AWQ, GPTQ, W4A16, "
                           "W8A8) as a checkpoint directory in that format, rounded to its "
                           "grid (not calibrated).")
    quant.add_argument("hf_dir", metavar="HF_DIR", nargs="?", default=None,
                       help="Hugging Face checkpoint directory")
    quant.add_argument("out", metavar="OUT", help="GGUF file (or, for AWQ, GPTQ, W4A16, "
                       "W8A8, directory) to write")
    quant.add_argument("--preset", default=None, choices=sorted(BENCH_PRESETS),
                       help="instead of HF_DIR: a benchmark preset's dummy weights (what "
                       "`fleetllm bench --preset` runs), so GGUF figures can be reproduced")
    quant.add_argument("--type", default="Q8_0", type=str.upper,
                       choices=[*PRESETS, *FORMATS], metavar="TYPE",
                       help=f"GGUF preset ({', '.join(PRESETS)}) or checkpoint format "
                       f"({', '.join(FORMATS)})")
    quant.add_argument("--bits", type=int, default=4, choices=(4, 8),
                       help="GPTQ: bits per weight")
    quant.add_argument("--group-size", type=int, default=128,
                       help="AWQ, GPTQ, W4A16: weights per scale (-1: one per row)")
    quant.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                       help="GPTQ, W4A16: symmetric weights, no zero points (default: yes)")
    quant.add_argument("--act-order", action="store_true",
                       help="GPTQ, W4A16: act-order groups (g_idx), as desc_act checkpoints")
    quant.add_argument("--llama-quantize", metavar="PATH", default=None,
                       help="quantize with this llama.cpp llama-quantize binary instead of "
                       "fleetllm's numpy quantizers")
    quant.set_defaults(run=_run_quantize)


def build_parser() -> argparse.ArgumentParser:
    # --debug is on every subcommand too; SUPPRESS there keeps `fleetllm --debug generate`
    # (the subcommand's unset default would otherwise overwrite the top-level value).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors")
    parser = argparse.ArgumentParser(prog="fleetllm", formatter_class=HelpFormatter,
                                     description="fleetllm: a small vLLM-style LLM inference "
                                     "engine")
    parser.add_argument("--version", action="version", version=f"fleetllm {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub, common)
    _add_serve(sub, common)
    _add_proxy(sub, common)
    _add_bench(sub, common)
    _add_quantize(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.argv = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # fleetllm's warnings (e.g. an ignored vLLM flag) as one plain line each.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        result = args.run(args)  # an exit code, or the figures (a dict) a benchmark printed
        return result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        from fleetllm.errors import FleetLLMError

        name = "" if isinstance(e, FleetLLMError) else f"{type(e).__name__}: "
        print(f"error: {name}{e}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
