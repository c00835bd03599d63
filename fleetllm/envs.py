"""Every environment variable fleetllm and its C++ kernels read: name, type, default, one line.

Python code reads them through get(NAME), at the time it did before (mostly each call; the
doc line says when one is read at import). The kernels read theirs (read_by "C++") with getenv,
once per process. `python -m fleetllm.envs` prints the table docs/envs.md carries, and
`--write docs/envs.md` updates it (tests/project/test_envs.py checks both stay in step).
What fails: get() of a name not listed raises KeyError; a malformed number raises ValueError.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # as the docs table shows it: "bool", "int", "str", "auto|packed|dense", ...
    default: str  # as the docs table shows it
    doc: str  # one line for the table
    read_by: str = "Python"  # or "C++": csrc reads it with getenv, once per process
    parse: Callable[[str | None], Any] | None = None  # the raw value (None: unset) -> typed


def _str(default: str | None) -> Callable[[str | None], str | None]:
    return lambda v: default if v is None else v


def _nonempty(v: str | None) -> str | None:
    return v or None


def _on_unless_0(v: str | None) -> bool:
    return v != "0"


def _on_unless_empty_or_0(v: str | None) -> bool:
    return v not in (None, "", "0")


def _one_or_true(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true")


def _is_set(v: str | None) -> bool:
    return v is not None


def _int_or_none(v: str | None) -> int | None:
    return int(v) if v else None


def _bytes_or_none(v: str | None) -> int | None:
    return int(float(v)) if v else None  # "2e9" too


def _lower(default: str) -> Callable[[str | None], str]:
    return lambda v: (default if v is None else v).strip().lower()


VARIABLES: tuple[EnvVar, ...] = (
    # Which code paths run.
    EnvVar("FLEETLLM_CPU_KERNELS", "1|0|require", "1",
           "0: PyTorch paths only; require: fail if the C++ kernels do not build, instead of "
           "warning and falling back", parse=_str("1")),
    EnvVar("FLEETLLM_CPU_ISA", "portable|avx2|avx512", "the best this CPU runs",
           "build and load a lower instruction-set variant of the kernels", parse=_lower("")),
    EnvVar("FLEETLLM_LINEAR", "auto|packed|dense", "auto",
           "packed: keep only the packed weights (no dense copy for the small-batch GEMV); "
           "dense: plain F.linear, nothing packed", parse=_str("auto")),
    EnvVar("FLEETLLM_GEMV_MAX_BYTES", "int (bytes)",
           "2 GiB (beside oneDNN's copy on AMX: a quarter of the memory)",
           "the most bytes of projections that get a second copy for small batches",
           parse=_bytes_or_none),
    EnvVar("FLEETLLM_BATCH_INVARIANT", "bool (1|true)", "0",
           "bf16 projections read one copy at every batch size: a row's outputs are the same "
           "bits in any batch", parse=_one_or_true),
    EnvVar("FLEETLLM_HUGE_PAGES", "bool", "1",
           "0: no transparent huge pages for the packed weights", parse=_on_unless_0),
    EnvVar("FLEETLLM_LORA_ONE_THREAD", "bool", "1",
           "0: LoRA deltas use torch's threads instead of one (read at import)",
           parse=_on_unless_0),
    EnvVar("FLEETLLM_CUDA_DECODE", "auto|sdpa|math32|varlen", "auto",
           "decode attention where the C kernel does not apply (CUDA; CPU without kernels; "
           "read at import)", parse=_lower("auto")),
    EnvVar("FLEETLLM_CPU_BF16_DOT", "bool", "1",
           "0: the avx512 kernels do not use AVX-512 BF16's vdpbf16ps", read_by="C++"),
    EnvVar("FLEETLLM_CPU_BF16_PAIRS", "fma|dot", "timed at start",
           "how the bf16 pairs kernel sums (the same bits either way)", read_by="C++"),
    EnvVar("FLEETLLM_CPU_AMX", "bool", "1",
           "0: no AMX tiles for bf16 projections", read_by="C++"),
    EnvVar("FLEETLLM_QUANT_VNNI", "bool", "1",
           "0: quantized (GGUF) projections unpack to float32 instead of AVX-512 VNNI's int8 "
           "dot products", read_by="C++"),
    EnvVar("FLEETLLM_QUANT_FAST_DEQUANT", "bool", "1",
           "0: quantized prompts' GEMM chunks dequantize with the generic unpacking instead of "
           "AVX-512's (the same values, slower)", read_by="C++"),
    # Threads and memory.
    EnvVar("FLEETLLM_NUM_THREADS", "int", "physical cores / ranks on this machine",
           "torch's intra-op threads per worker", parse=_int_or_none),
    EnvVar("OMP_NUM_THREADS", "int", "unset",
           "if set (and FLEETLLM_NUM_THREADS is not), torch's threads, as torch reads it",
           parse=_nonempty),
    EnvVar("FLEETLLM_KERNEL_THREADS", "pool|torch", "pool",
           "torch: the kernels' work runs on torch's threads instead of their own pool",
           read_by="C++"),
    EnvVar("FLEETLLM_SPIN_US", "int (microseconds)", "100",
           "how long the kernels' pool spins after a small job before it sleeps",
           read_by="C++"),
    EnvVar("FLEETLLM_MALLOC_TUNING", "bool", "1",
           "0: leave glibc's mmap and trim thresholds alone", parse=_on_unless_0),
    # Building the kernels.
    EnvVar("FLEETLLM_KERNEL_WERROR", "bool", "0",
           "build the kernels with -Werror", parse=_on_unless_empty_or_0),
    EnvVar("FLEETLLM_KERNEL_SANITIZE", "bool", "0",
           "build the kernels with ASan and UBSan (`make sanitize`); a failed build raises",
           parse=_on_unless_empty_or_0),
    EnvVar("TORCH_EXTENSIONS_DIR", "path", "torch's default build root",
           "where the kernels are built (one folder per variant and flags)",
           parse=_nonempty),
    EnvVar("CXX", "str", "c++", "the C++ compiler (part of the build folder's key)",
           parse=_str("c++")),
    # Entry points and tools.
    EnvVar("FLEETLLM_API_KEY", "str", "unset",
           "`fleetllm serve --api-key`'s default", parse=_str(None)),
    EnvVar("RAY_ADDRESS", "str", "unset",
           "the Ray cluster to join when `ray_address` is not given", parse=_nonempty),
    EnvVar("FLEETLLM_VLLM_PYTHON", "path", ".venv-vllm/bin/python",
           "the vLLM interpreter for `bench --compare vllm`", parse=_nonempty),
    EnvVar("FLEETLLM_KEEP_SERVER_LOGS", "bool (set)", "unset",
           "set: LocalServer keeps its log folder", parse=_is_set),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def spec(name: str) -> EnvVar:
    """The listed variable `name`; KeyError if it is not listed."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not listed in fleetllm/envs.py") from None


def get(name: str) -> Any:
    """`name`'s value now, parsed as its entry says (its default when unset); a C++ one's raw
    string or None."""
    var = spec(name)
    raw = os.environ.get(name)
    return raw if var.parse is None else var.parse(raw)


def markdown_table() -> str:
    """The table docs/envs.md carries."""
    rows = ["| variable | type | default | read by | what |", "| --- | --- | --- | --- | --- |"]
    for v in VARIABLES:
        kind = v.type.replace("|", "\\|")  # a bare | would split the cell
        rows.append(f"| `{v.name}` | {kind} | {v.default} | {v.read_by} | {v.doc} |")
    return "\n".join(rows) + "\n"


BEGIN = "<!-- envs table: python -m fleetllm.envs --write docs/envs.md -->\n"
END = "<!-- end of envs table -->\n"


def with_table(page: str) -> str:
    """`page` with the text between BEGIN and END replaced by markdown_table()."""
    head, sep, rest = page.partition(BEGIN)
    if not sep or END not in rest:
        raise ValueError("the page has no envs table markers")
    return head + BEGIN + markdown_table() + END + rest.partition(END)[2]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        page = Path(sys.argv[2])
        page.write_text(with_table(page.read_text()))
    else:
        sys.stdout.write(markdown_table())
