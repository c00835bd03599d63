"""Building and loading fleetllm's C++ CPU kernels (the sources in `csrc/`).

What: `load()` compiles csrc/*.cpp with `torch.utils.cpp_extension.load` for this CPU's
variant ("avx512", "avx2" or "portable": PyTorch's split and flags, never -march=native;
FLEETLLM_CPU_ISA picks a lower one) and loads the ops `cpu_kernels` calls. Built at first use
(`make setup` builds ahead), so a missing compiler is a warning, not a failed install.
How: into <torch extensions root>/fleetllm/<variant>-<hash of sources, flags, compiler, torch,
Python>, shared by checkouts with the same sources, under an flock (torch's own lock outlives a
killed build). What fails: no compiler or ninja, a compile error or a library that does not
load raise BuildError. FLEETLLM_KERNEL_WERROR=1 adds -Werror; FLEETLLM_KERNEL_SANITIZE=1
builds with ASan/UBSan (`make sanitize`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from fleetllm import envs

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[1]
# An installed wheel carries the sources in the package (setup.py copies them there); a
# checkout has them at the repository root.
_SOURCE_DIRS = (PACKAGE / "_csrc", PACKAGE.parent / "csrc")
SOURCES = ("ops.cpp", "paged_decode.cpp", "prefill_attention.cpp", "fused_ops.cpp", "gemv.cpp",
           "gemm.cpp", "gemm_amx.cpp", "argmax.cpp", "parallel.cpp", "pool.cpp",
           "mkl_sgemm.cpp", "quant.cpp", "quant_ops.cpp", "quant_vnni.cpp",
           "quant_dequant.cpp", "moe.cpp", "moe_quant.cpp")

# -O3 with vectorization hints (`omp simd`, without an OpenMP runtime: -fopenmp-simd), and
# no errno or trap semantics for float math, which otherwise keep sqrt and the exp loops
# scalar. -mtune=native only schedules instructions for the CPU that builds (the one that
# runs them: builds happen at first use); it chooses none, so a library stays correct on any
# CPU its variant is picked for; without it, batch-1 decode was slower than a -march=native
# build.
# -Wno-maybe-uninitialized: GCC 12's AVX-512 intrinsics start from an "undefined" vector
# (`__m512 __Y = __Y;`), which it reports as uninitialized wherever one is inlined at -O2 or
# more (GCC bug 105593, fixed in 13): thousands of lines of false positives per build.
COMMON_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-pthread",
                "-Wall", "-Wextra", "-Wno-maybe-uninitialized", "-mtune=native")
ISA_FLAGS = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma"),
    "avx512": ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"),
}
# -O1 (after COMMON_FLAGS' -O3: the last one counts): GCC 12 takes 2.5 minutes over
# prefill_attention.cpp at -O3 with the sanitizers and 12 s at -O1 (`make sanitize`, build
# included, went from 5.7-8.9 minutes to ~2 on 2 cores); the checks are the same at any level.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer", "-g", "-O1")
_X86 = ("x86_64", "amd64")
_RANK = {"portable": 0, "avx2": 1, "avx512": 2}


class BuildError(RuntimeError):
    """The kernels could not be built or loaded here."""


def source_dir() -> Path:
    for d in _SOURCE_DIRS:
        if (d / "ops.cpp").is_file():
            return d
    raise BuildError(f"the kernel sources are in none of {[str(d) for d in _SOURCE_DIRS]}")


def variants(machine: str | None = None) -> list[str]:
    """The variants that exist for a machine (platform.machine() by default)."""
    machine = (machine or platform.machine()).lower()
    return list(ISA_FLAGS) if machine in _X86 else ["portable"]


def best_variant(machine: str | None = None, capability: str | None = None) -> str:
    """The variant for this CPU: on x86-64 by torch's CPU capability, elsewhere portable."""
    machine = (machine or platform.machine()).lower()
    if machine not in _X86:
        return "portable"
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "portable")


def chosen_variant() -> str:
    """best_variant(), or FLEETLLM_CPU_ISA if that names one this CPU can run."""
    best = best_variant()
    asked = envs.get("FLEETLLM_CPU_ISA")
    if not asked:
        return best
    if asked not in variants():
        raise BuildError(f"FLEETLLM_CPU_ISA={asked!r}: not one of {variants()}")
    if _RANK[asked] > _RANK[best]:
        raise BuildError(f"FLEETLLM_CPU_ISA={asked!r}: this CPU runs at most {best!r}")
    return asked


def flags(variant: str, sanitize: bool = False, werror: bool = False) -> list[str]:
    return [*COMMON_FLAGS, *ISA_FLAGS[variant], *(SANITIZE_FLAGS if sanitize else ()),
            *(("-Werror",) if werror else ())]


def build_directory(variant: str, cflags: list[str], src: Path) -> Path:
    key = hashlib.sha256()
    for part in (*cflags, envs.get("CXX"), torch.__version__, sys.version):
        key.update(part.encode() + b"\0")
    for name in sorted(p.name for p in src.iterdir() if p.suffix in (".cpp", ".h")):
        key.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    from torch.utils import cpp_extension  # imports setuptools: only when building

    root = envs.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    suffix = "-asan" if "-fsanitize=address,undefined" in cflags else ""
    return Path(root) / "fleetllm" / f"{variant}{suffix}-{key.hexdigest()[:16]}"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH; the ninja wheel's binary is not there when the venv is
    not activated (`.venv/bin/fleetllm ...`)."""
    if shutil.which("ninja"):
        yield
        return
    try:
        import ninja  # the PyPI package: its binary lives in the package
        extra = ninja.BIN_DIR
    except (ImportError, AttributeError):
        extra = str(Path(sys.executable).parent)
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = extra + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def load(variant: str | None = None) -> Path:
    """Build (if needed) and load the kernels; returns the library's path. Raises BuildError.
    Call once per process: torch registers the `fleetllm` op namespace once."""
    from torch.utils import cpp_extension

    variant = variant or chosen_variant()
    sanitize = envs.get("FLEETLLM_KERNEL_SANITIZE")
    # The sanitizer build is CI's full compile and link of this CPU's variant: warnings fail it.
    cflags = flags(variant, sanitize, sanitize or envs.get("FLEETLLM_KERNEL_WERROR"))
    src = source_dir()
    out = build_directory(variant, cflags, src)
    name = "fleetllm_" + out.name.replace("-", "_")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "build.flock", "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # waits while another process builds here
            (out / "lock").unlink(missing_ok=True)  # torch's baton: only a dead builder's
            copies = out / "src"
            copies.mkdir(exist_ok=True)
            for p in src.iterdir():
                if p.suffix in (".cpp", ".h") and not (copies / p.name).exists():
                    shutil.copyfile(p, copies / (p.name + ".tmp"))
                    os.replace(copies / (p.name + ".tmp"), copies / p.name)
            if not (out / f"{name}.so").exists():
                logger.warning("Compiling fleetllm's CPU kernels (%s; once per machine and "
                               "version, ~5-30 s) in %s", variant, out)
            with _ninja_on_path():
                cpp_extension.load(
                    name=name, sources=[str(copies / s) for s in SOURCES],
                    extra_cflags=cflags,
                    extra_ldflags=["-pthread", *(SANITIZE_FLAGS[:1] if sanitize else ())],
                    build_directory=str(out), is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError, ValueError) as e:
        # RuntimeError: compile or link errors, no ninja; OSError: dlopen (the library or the
        # sanitizer runtime not loadable), no compiler; ValueError: torch's compiler checks.
        raise BuildError(f"building the {variant} CPU kernels in {out} failed: {e}") from e
    return out / f"{name}.so"


def main() -> None:
    """Build ahead of first use (`make setup`); a failure is reported, not raised."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        print(f"fleetllm CPU kernels: {load()}")
    except BuildError as e:
        print(f"fleetllm CPU kernels unavailable, the PyTorch path will run: {e}")
