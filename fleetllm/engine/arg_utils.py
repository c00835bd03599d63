"""Engine arguments on the command line: the flags every entry point shares, below them all.

`fleetllm generate`, `fleetllm serve` and the benchmarks add these flags to their parsers and
turn what the user set into LLM(...) keyword arguments. They live here, under the engine
(vLLM's place for them is vllm/engine/arg_utils.py), and not in fleetllm.cli, because cli.py
imports the benchmarks and the server launcher to build its subcommands: were the flags there,
those modules would import cli.py back, an import circle. Nothing in the package imports
fleetllm.cli (tests/project/test_layering.py checks it).

Engine flags are derived from the config dataclasses, with vLLM's names
(--tensor-parallel-size, --max-model-len, --block-size, ...), so they never drift; vLLM's
other engine flags are accepted or refused as EngineConfig.from_kwargs decides (VLLM_ARGS).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetllm.config import SPEC_FLAT_ARGS, VLLM_ARGS, engine_arg_fields

# Package data (pyproject's package-data), so a wheel install has it too.
DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"
# Its draft for speculative decoding (tools/train_demo_model.py --teacher; docs/spec_decode.md)
DEMO_DRAFT = DEMO_MODEL.parent / "demo_draft"
_MEASURED = {"num_gpu_blocks", "num_cpu_blocks"}  # set by the engine, not by users
# Help per engine flag. One that states its default itself gets no "(default: ...)" added.
_HELP = {
    "tokenizer": "tokenizer directory (default: the model directory)",
    "dtype": "auto (the checkpoint's dtype; on CPU float16 checkpoints run in float32), "
             "float32, float16, bfloat16",
    "kv_cache_dtype": "auto (the model's dtype), bfloat16, float32",
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
    "enable_expert_parallel": "MoE models: each tensor-parallel rank holds whole experts "
                              "instead of a slice of each (docs/moe.md)",
    "distributed_executor_backend": "uni (one process), mp (local processes), ray, or "
                                    "module:Class (default: uni for one worker, else mp)",
    "worker_cls": "worker class, module.Class",
    "startup_timeout": "seconds to wait for workers to start (ray: and to be placed)",
    "execute_model_timeout": "seconds a step may take before the workers are waited for once "
                             "more, then declared hung and restarted",
    "max_worker_restarts": "times crashed or hung workers are replaced, every request "
                           "resumed; 0: fail-stop",
    "worker_restart_window_s": "seconds after which a worker restart no longer counts "
                               "against max_worker_restarts (inf: never)",
    "ray_address": "ray: the cluster to join (auto, host:port, ray://host:port; default: "
                   "$RAY_ADDRESS, else a private local instance)",
    "placement_strategy": "ray: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD",
    "placement_group": "ray: the name of an existing placement group to run in",
    "ray_cpus_per_worker": "ray: CPUs each CPU worker reserves (and its torch threads)",
    "max_num_seqs": "most sequences in one batch",
    "enable_lora": "serve LoRA adapters (requests name one; docs/lora.md)",
    "max_loras": "distinct LoRA adapters one step may use (device slots)",
    "max_lora_rank": "largest LoRA adapter rank accepted",
    "max_cpu_loras": "LoRA adapters kept loaded per worker, LRU (default: max_loras)",
    "lora_dtype": "auto (the model's dtype), float32, bfloat16, float16: the adapters' "
                  "weights",
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
    actions.append(_add_flag(
        group, "speculative_config", str,
        "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4}' (prompt_lookup_max / _min: the n-gram lengths "
        "matched; default: off)"))
    actions.append(_add_flag(
        group, "kv_transfer_config", str,
        "KV transfer, vLLM's JSON: '{\"kv_connector\": \"SharedStorageConnector\", "
        "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": "
        "{\"shared_storage_path\": \"/path\"}}' (docs/kv_transfer.md; default: off)"))
    for name, arg in VLLM_ARGS.items():
        actions.append(_add_flag(compat, name, _arg_type(Any, arg.default), argparse.SUPPRESS))
    for name in SPEC_FLAT_ARGS:  # vLLM's older spelling of --speculative-config
        parse = str if name == "speculative_model" else _parse_int
        actions.append(_add_flag(compat, name, parse, argparse.SUPPRESS))
    parser.set_defaults(engine_actions=actions)
    return actions


def engine_kwargs_from(args: argparse.Namespace, actions: list[argparse.Action]
                       ) -> dict[str, Any]:
    """The engine flags the user set, as LLM(...) keyword arguments."""
    return {a.dest: getattr(args, a.dest) for a in actions if getattr(args, a.dest) is not None}


def resolve_model(model: str | None) -> str:
    """The checkpoint to load: `model`, or the bundled demo model when none is given."""
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
