"""The `fleetllm` command: generate, bench.

Engine flags are derived from the config dataclasses, with vLLM's names
(--tensor-parallel-size, --max-model-len, --block-size, ...), so they never drift.
Errors print one line and exit non-zero; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from fleetllm.config import engine_arg_fields

DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "fleetllm-demo-py"
_MEASURED = {"num_gpu_blocks", "num_cpu_blocks"}  # set by the engine, not by users
_HELP = {
    "tokenizer": "tokenizer directory (default: the model directory)",
    "dtype": "auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, float16, "
             "bfloat16",
    "max_model_len": "longest prompt + output, in tokens (default: the model's)",
    "seed": "random seed for weights (dummy) and unseeded sampling",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "CPU KV cache budget: bytes (> 1) or a fraction of RAM (<= 1); "
                       "default 2 GiB",
    "gpu_memory_utilization": "CUDA: fraction of GPU memory for weights, activations, KV",
    "swap_space": "bytes of CPU memory per worker for preempted (swapped) KV blocks",
    "num_gpu_blocks_override": "use exactly this many KV blocks (testing)",
    "tensor_parallel_size": "split each layer across this many workers",
    "pipeline_parallel_size": "split the layers into this many stages",
    "distributed_executor_backend": "uni (one process), mp (local processes), ray, or "
                                    "module:Class",
    "worker_cls": "worker class, module.Class",
    "startup_timeout": "seconds to wait for workers to start",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in "
                              "chunks",
    "preemption_mode": "recompute or swap, when KV blocks run out",
    "device": "auto, cpu or cuda",
    "load_format": "auto, safetensors, dummy (random weights)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add --model and the engine flags; returns the engine flags' actions."""
    parser.add_argument("--model", default=None,
                        help=f"checkpoint directory (default: the bundled demo model, "
                             f"{DEMO_MODEL.name})")
    group = parser.add_argument_group("engine")
    actions = []
    for _, f in engine_arg_fields():
        if f.name in _MEASURED:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        actions.append(group.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=_arg_type(f.name, default),
            default=None, help=f"{_HELP.get(f.name, '')} (default: {default})"))
    return actions


def _arg_type(name: str, default: Any):
    if name in ("kv_cache_memory", "gpu_memory_utilization", "startup_timeout"):
        return float
    if name == "swap_space":
        return lambda s: int(float(s))
    if isinstance(default, bool):
        return lambda s: s.lower() in ("1", "true", "yes")
    if isinstance(default, int) or name in ("max_model_len", "num_gpu_blocks_override"):
        return int
    return str


def engine_kwargs_from(args: argparse.Namespace, actions: list[argparse.Action]
                       ) -> dict[str, Any]:
    """The engine flags the user set, as LLM(...) keyword arguments."""
    return {a.dest: getattr(args, a.dest) for a in actions if getattr(args, a.dest) is not None}


def resolve_model(model: str | None) -> str:
    if model:
        return model
    if not DEMO_MODEL.is_dir():
        from fleetllm.errors import ModelLoadError

        raise ModelLoadError(f"no --model given and the bundled demo model is missing at "
                             f"{DEMO_MODEL}")
    return str(DEMO_MODEL)


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


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(root))
    import importlib

    module = importlib.import_module(args.which)
    result = module.main(rest)  # an exit code, or the figures (a dict) it printed
    return result if isinstance(result, int) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetllm", description="fleetllm: a small "
                                     "vLLM-style LLM inference engine")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed for this request's sampling")
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="print only prompt + completion")
    gen.set_defaults(engine_actions=add_engine_args(gen))
    from fleetllm.entrypoints.openai.cli_args import add_serve_args
    add_serve_args(sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API"))
    bench = sub.add_parser("bench", help="benchmarks: throughput | rpc (see each one's --help)")
    bench.add_argument("which", choices=["throughput", "rpc", "serve"])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            from fleetllm.entrypoints.openai.launcher import run_serve
            return run_serve(args)
        return cmd_bench(args, rest)
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
