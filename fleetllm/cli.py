"""The `fleetllm` command: generate, bench throughput, bench latency, bench rpc.

Engine flags are derived from the config dataclasses, with vLLM's names
(--tensor-parallel-size, --max-model-len, --block-size, ...), so they never drift; vLLM's
other engine flags are accepted or refused as EngineConfig.from_kwargs decides (VLLM_ARGS).
Errors print one line and exit non-zero; --debug (before or after the subcommand) shows the
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetllm import __version__
from fleetllm.config import VLLM_ARGS, engine_arg_fields

# Package data (pyproject's package-data), so a wheel install has it too.
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"
_MEASURED = {"num_gpu_blocks", "num_cpu_blocks"}  # set by the engine, not by users
# Help per engine flag. One that states its default itself gets no "(default: ...)" added.
_HELP = {
    "tokenizer": "tokenizer directory (default: the model directory)",
    "dtype": "auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, float16, "
             "bfloat16",
    "max_model_len": "longest prompt + output, in tokens (default: the model's)",
    "seed": "random seed for weights (dummy) and unseeded sampling",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "CPU KV cache budget: bytes (> 1) or a fraction of RAM (<= 1) "
                       "(default: 2 GiB)",
    "gpu_memory_utilization": "CUDA: fraction of GPU memory for weights, activations, KV",
    "swap_space": "bytes of CPU memory per worker for preempted (swapped) KV blocks",
    "num_gpu_blocks_override": "use exactly this many KV blocks, for tests (default: as many "
                               "as fit)",
    "tensor_parallel_size": "split each layer across this many workers",
    "pipeline_parallel_size": "split the layers into this many stages",
    "distributed_executor_backend": "uni (one process), mp (local processes), ray, or "
                                    "module:Class (default: uni for one worker, else mp)",
    "worker_cls": "worker class, module.Class",
    "startup_timeout": "seconds to wait for workers to start (ray: and to be placed)",
    "execute_model_timeout": "seconds a step may take before the workers are waited for once "
                             "more, then declared hung and restarted",
    "max_worker_restarts": "times crashed or hung workers are replaced, every request "
                           "resumed; 0: fail-stop",
    "ray_address": "ray: the cluster to join (auto, host:port, ray://host:port; default: "
                   "$RAY_ADDRESS, else a private local instance)",
    "placement_strategy": "ray: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD",
    "placement_group": "ray: the name of an existing placement group to run in",
    "ray_cpus_per_worker": "ray: CPUs each CPU worker reserves (and its torch threads)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in "
                              "chunks",
    "preemption_mode": "recompute or swap, when KV blocks run out",
    "device": "auto, cpu or cuda",
    "load_format": "auto, safetensors, dummy (random weights)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default exactly once: argparse appends it unless the help text states
    it already, or there is none to show (a switch; None, as engine flags have so that an unset
    flag leaves the config's own default in force: their help states that default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def _parse_int(text: str) -> int:
    """An int; also written as a float with no fraction, as byte counts often are (5e8)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(value)


def _arg_type(hint: Any, default: Any) -> Callable[[str], Any]:
    """How a flag's value is parsed: from the field's annotation (`float | None` is a float),
    or from its default's type where the annotation says nothing (Any). Nothing is keyed by
    field name, so a new config field gets the right type with no entry here."""
    kinds = set(typing.get_args(hint) or (hint,)) - {type(None)}
    if not kinds or Any in kinds:
        kinds = {type(default)} if default not in (None, dataclasses.MISSING) else set()
    if kinds == {bool}:  # a switch: --flag / --no-flag
        return bool
    if kinds == {int}:
        return _parse_int
    if kinds and kinds <= {int, float}:
        return float
    return str


def _add_flag(group: argparse._ArgumentGroup, name: str, parse: Callable[[str], Any],
              help: str) -> argparse.Action:
    flag = "--" + name.replace("_", "-")
    if parse is bool:  # a switch takes no value: `--enforce-eager PROMPT` must not eat PROMPT
        return group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                  default=None, help=help)
    return group.add_argument(flag, dest=name, type=parse, default=None, help=help)


def add_engine_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add --model and the engine flags; returns the engine flags' actions."""
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the bundled demo model)")
    group = parser.add_argument_group("engine")
    actions = []
    for section, f in engine_arg_fields():
        if f.name in _MEASURED:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        text = _HELP.get(f.name, f.name.replace("_", " "))
        if "default" not in text:
            text += f" (default: {default})".replace("%", "%%")
        hint = typing.get_type_hints(section).get(f.name, Any)
        actions.append(_add_flag(group, f.name, _arg_type(hint, default), text))
    compat = parser.add_argument_group(
        "vLLM compatibility", "vLLM's other engine flags (--enforce-eager, "
        "--trust-remote-code, --quantization, ...) are accepted: those that change nothing "
        "here with a warning; unsupported ones that would change results are refused.")
    for name, arg in VLLM_ARGS.items():
        actions.append(_add_flag(compat, name, _arg_type(Any, arg.default), argparse.SUPPRESS))
    parser.set_defaults(engine_actions=actions)
    return actions


def engine_kwargs_from(args: argparse.Namespace, actions: list[argparse.Action]
                       ) -> dict[str, Any]:
    """The engine flags the user set, as LLM(...) keyword arguments."""
    return {a.dest: getattr(args, a.dest) for a in actions if getattr(args, a.dest) is not None}


def resolve_model(model: str | None) -> str:
    if model:
        return model
    if not DEMO_MODEL.is_dir():
        from fleetllm.errors import ModelLoadError

        raise ModelLoadError(
            f"no --model given and the bundled demo model is missing at {DEMO_MODEL}: pass "
            "--model DIR (a local Hugging Face checkpoint), reinstall fleetllm (its wheel "
            "ships the model), or rebuild it from a source checkout with `python "
            f"tools/train_demo_model.py --out {DEMO_MODEL}` (about 30 minutes on 2 cores)")
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


def _run_bench_serve(args: argparse.Namespace) -> int | dict:
    from fleetllm.benchmarks import serve

    return serve.main(args.argv)


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    from fleetllm.benchmarks import latency, recovery, rpc, throughput

    bench = sub.add_parser("bench", help="throughput | latency | rpc | serve | recovery",
                           description="Benchmarks; `fleetllm bench NAME --help` for each.")
    which = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, module in (("throughput", throughput), ("latency", latency), ("rpc", rpc),
                         ("recovery", recovery)):
        summary = (module.__doc__ or name).split("\n\n")[0]
        parser = which.add_parser(name, parents=[common], formatter_class=HelpFormatter,
                                  help=summary.split(":")[0], description=summary)
        module.add_arguments(parser)
        parser.set_defaults(run=module.run)
    # bench serve passes every flag it does not know to the server it starts: it parses its
    # own arguments (and --help).
    serve = which.add_parser("serve", add_help=False, help="online serving load benchmark")
    serve.set_defaults(run=_run_bench_serve, passthrough=True)


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
    _add_bench(sub, common)
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
