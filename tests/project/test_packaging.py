"""fleetllm installed from a wheel (not editable) runs its commands: the benchmarks, the demo
model and the C++ kernel sources (compiled at first use) are inside the package, not beside it
in the repository.

No network: the wheel is built without an isolated build environment, installed with
--no-deps --no-index into a fresh venv, and the dependencies (torch, transformers, ...) come
from the running interpreter's site-packages through a .pth line. A directory added by a .pth
line does not have its own .pth files run, so the editable install there stays inert.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a wheel build must not see: local state, and stale build output that setuptools
# would otherwise copy into the wheel. In a git checkout the build sees what a fresh clone
# has (tracked files and new ones not ignored): the peers' venv and llama.cpp build (`make
# peers`, `make llamacpp`: ~6 GB) made the copy take a minute and fill /tmp.
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", ".peers", "site", "build", "dist",
                                      "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache")


def copy_sources(dest: Path) -> None:
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=REPO, capture_output=True, timeout=60)
    except OSError:  # no git here
        listed = None
    if listed is None or listed.returncode != 0:  # not a git checkout: by the patterns
        shutil.copytree(REPO, dest, ignore=_NOT_SOURCES)
        return
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the work tree is not a source
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def clean_env() -> dict[str, str]:
    """The environment minus what would put a source checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def check(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh venv with fleetllm installed from a freshly built wheel."""
    pytest.importorskip("build")
    tmp = tmp_path_factory.mktemp("pkg")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    copy_sources(src)
    check([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
          cwd=src, timeout=120)
    [wheel] = dist.glob("fleetllm-*.whl")
    check([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, timeout=60)
    python = venv / "bin" / "python"
    check([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
           "--no-index", str(wheel)], cwd=tmp, timeout=120)
    site = check([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                 cwd=tmp, timeout=30).stdout.strip()
    ours = sysconfig.get_paths()
    deps = dict.fromkeys([ours["purelib"], ours["platlib"]])  # the running interpreter's
    (Path(site) / "fleetllm_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    where = check([str(python), "-c", "import fleetllm; print(fleetllm.__file__)"], cwd=tmp,
                  timeout=60).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    return venv / "bin"


def test_wheel_ships_the_demo_model_and_generate_uses_it(installed, tmp_path):
    proc = check([str(installed / "fleetllm"), "generate", "--max-tokens", "8", "--quiet",
                  "def f(x):"], cwd=tmp_path, timeout=120)
    assert proc.stdout.startswith("def f(x):")


def test_wheel_runs_the_benchmarks(installed, tmp_path):
    proc = check([str(installed / "fleetllm"), "bench", "throughput", "--num-prompts", "4",
                  "--input-len", "8", "--output-len", "4", "--hf-batch-size", "0",
                  "--repeat", "1", "--kv-cache-memory", "33554432"], cwd=tmp_path, timeout=120)
    assert "requests/s" in proc.stdout


def test_wheel_ships_the_kernel_sources_and_loads_them(installed, tmp_path):
    """The wheel carries csrc/ as fleetllm/_csrc; the installed package compiles (or, with the
    same sources, reuses the build of) this machine's variant and loads its ops."""
    from fleetllm.kernels import cpu_kernels

    proc = check([str(installed / "python"), "-c",
                  "from fleetllm.kernels import build as kernel_build, cpu_kernels; "
                  "print(kernel_build.source_dir()); print(cpu_kernels.available())"],
                 cwd=tmp_path, timeout=300)
    where, loaded = proc.stdout.split()
    assert Path(where).is_relative_to(installed.parent) and Path(where).name == "_csrc"
    assert sorted(p.name for p in Path(where).iterdir()) == \
        sorted(p.name for p in (REPO / "csrc").iterdir())
    assert loaded == str(cpu_kernels.available())
