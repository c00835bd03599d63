"""The vLLM peer of the benchmarks (`--compare vllm`): the real vLLM CPU build, run from its
own venv (`make peers` makes .venv-vllm) in subprocesses executing vllm_runner.py, spoken to
in JSON lines (never pickle). One subprocess per configuration, each loaded once and kept
between rounds; the engines take turns, so while one computes every other waits idle.

vLLM's figure is its best configuration: eager (enforce_eager) or compiled (its default),
each with its CPU threads bound by its own choice (VLLM_CPU_OMP_THREADS_BIND=auto, which on
x86 keeps one core for its scheduler process) or to the cores fleetllm uses (0-N). Preset
weights reach it as a checkpoint written to a temporary directory (checkpoint.py): the very
tensors fleetllm and the transformers peers run. A quantized checkpoint (AWQ, GPTQ,
compressed-tensors) is loaded from the same directory by both, each with its own kernels, in
the same activation dtype, which vLLM's CPU kernels constrain (check_quantized_dtype).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetllm import envs
from fleetllm.benchmarks.workload import Request, TimedRun

RUNNER = Path(__file__).with_name("vllm_runner.py")
VENV_NAME = ".venv-vllm"
LOAD_TIMEOUT_S = 1800.0  # compiling on 2 cores takes minutes
RUN_TIMEOUT_S = 3600.0
EXIT_TIMEOUT_S = 20.0


class VLLMPeerError(RuntimeError):
    """The vLLM peer is not installed, failed, or did not answer in time."""


def vllm_python() -> Path:
    """The vLLM venv's interpreter: $FLEETLLM_VLLM_PYTHON, else .venv-vllm in the checkout
    (beside the fleetllm package) or in the working directory."""
    if asked := envs.get("FLEETLLM_VLLM_PYTHON"):
        candidates = [Path(asked)]
    else:
        roots = [Path(__file__).resolve().parents[2], Path.cwd()]
        candidates = [r / VENV_NAME / "bin" / "python" for r in roots]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise VLLMPeerError(f"--compare vllm needs vLLM's CPU build in {VENV_NAME}: run `make "
                        f"peers` in the fleetllm checkout (or set FLEETLLM_VLLM_PYTHON); "
                        f"not found: {', '.join(map(str, candidates))}")


# The activation dtypes vLLM CPU 0.32's kernels run quantized checkpoints in: float32 is
# refused (AWQ, GPTQ: at its config check; compressed-tensors: by the kernels); its int8
# GEMM (W8A8) writes bfloat16 only (float16 aborts the process: "scale_C: scalar path not
# implemented!").
VLLM_QUANT_DTYPES = {"W8A8": (torch.bfloat16,)}
VLLM_QUANT_DTYPES_DEFAULT = (torch.bfloat16, torch.float16)


def check_quantized_dtype(model: str, dtype: torch.dtype) -> None:
    """Raise VLLMPeerError, before any vLLM process starts, when `model` is a quantized
    checkpoint that vLLM's CPU kernels cannot run in fleetllm's dtype (the peer runs in the
    same one, so the two compute alike: a float16 checkpoint runs in float32 in fleetllm)."""
    from fleetllm.benchmarks.workload import hf_quant_name, hf_quantization

    q = hf_quantization(model)
    if q is None:
        return
    name = hf_quant_name(q)
    allowed = VLLM_QUANT_DTYPES.get(name, VLLM_QUANT_DTYPES_DEFAULT)
    if dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise VLLMPeerError(
            f"--compare vllm: vLLM's CPU build runs {name} checkpoints in {names}, not "
            f"{str(dtype).removeprefix('torch.')} (fleetllm's dtype in this run, which the "
            f"peer is given): pass --dtype bfloat16 so both engines run the same")


@dataclass(frozen=True)
class VLLMConfig:
    eager: bool
    bind: str  # VLLM_CPU_OMP_THREADS_BIND

    @property
    def name(self) -> str:
        return f"vLLM ({'eager' if self.eager else 'compiled'}, bind {self.bind})"


def parse_configs(text: str, threads: int) -> list[VLLMConfig]:
    """'all' (the default: eager and compiled, each bound auto and to cores 0..threads-1) or
    comma-separated MODE:BIND, MODE eager|compiled, BIND auto|cores (0-N, the same number of
    cores as fleetllm's threads) or a literal VLLM_CPU_OMP_THREADS_BIND list, e.g.
    compiled:auto,eager:0-1."""
    cores = f"0-{threads - 1}" if threads > 1 else "0"
    if text == "all":
        return [VLLMConfig(eager, bind) for eager in (False, True) for bind in ("auto", cores)]
    configs = []
    for item in re.split(r",(?=\s*(?:eager|compiled):)", text):  # a CPU list may hold commas
        mode, _, bind = item.strip().partition(":")
        if mode not in ("eager", "compiled") or not bind:
            raise ValueError(f"--vllm-configs: {item!r} is not MODE:BIND (MODE eager or "
                             "compiled, BIND auto, cores or a CPU list)")
        configs.append(VLLMConfig(mode == "eager", cores if bind == "cores" else bind))
    return configs


def runner_env(config: VLLMConfig, python: Path, kv_cache_gb: int) -> dict[str, str]:
    """The runner's environment: the thread binding, a KV cache of kv_cache_gb GiB, no network,
    and Intel OpenMP preloaded from the venv where it is (vLLM's recommended CPU set-up: it
    then sets a 5 ms spin-wait, so its threads are asleep soon after a round)."""
    env = {k: v for k, v in os.environ.items()  # fleetllm's own OpenMP settings stay here
           if not k.startswith(("VLLM_", "KMP_", "OMP_", "GOMP_"))}
    env.pop("PYTHONPATH", None)  # fleetllm's tree and venv are not the runner's
    env.update(VLLM_CPU_OMP_THREADS_BIND=config.bind, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = " ".join(p for p in (str(iomp), env.get("LD_PRELOAD")) if p)
    return env


class Runner:
    """One runner subprocess, in its own process group (so it and vLLM's engine-core child
    are killed together), its stderr to a log file; request() sends a message and waits for
    the answer line until a deadline."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, log: Path, name: str):
        self.name, self.log = name, log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, start_new_session=True)
        self._buffer = b""
        self._busy = False  # a request is unanswered (a timeout, Ctrl-C): kill, don't ask

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._busy = True
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("exited before it was sent a message") from None
        reply = self._read_line(time.monotonic() + timeout)
        self._busy = False
        if not reply.get("ok"):
            sys.stderr.write(reply.get("traceback", ""))
            raise self._failure(reply.get("error", "failed"))
        return reply

    def _read_line(self, deadline: float) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure("did not answer in time")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self.proc.wait(timeout=EXIT_TIMEOUT_S)
                    raise self._failure(f"exited (status {self.proc.returncode})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise self._failure(f"answered something not JSON: {line[:200]!r}") from None

    def _failure(self, what: str) -> VLLMPeerError:
        tail = self.log.read_text(errors="replace").splitlines()[-30:] if self.log.exists() \
            else []
        if tail:  # the CLI prints an error's first line: the log goes to stderr first
            sys.stderr.write(f"--- {self.name}: the last lines of its log\n" + "\n".join(tail)
                             + "\n")
        return VLLMPeerError(f"{self.name}: {what}")

    def close(self) -> None:
        """Ask it to exit; after EXIT_TIMEOUT_S, or if it is still busy with a request (it
        would not read the question before finishing), kill its group."""
        group = _group_pids(self.proc.pid)
        if self.proc.poll() is None and not self._busy:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=EXIT_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:  # vLLM's engine-core child too, even when the runner exited first
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        remove_openmp_files(group)


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process (Linux: /proc; elsewhere none)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return out


def _group_pids(pgid: int) -> list[int]:
    return [pid for pid, (_, group) in _processes().items() if group == pgid]


def descendants(pid: int) -> list[int]:
    """pid's children, their children, ... (alive now)."""
    children: dict[int, list[int]] = {}
    for p, (parent, _) in _processes().items():
        children.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def remove_openmp_files(pids: list[int]) -> None:
    """Intel OpenMP (preloaded for vLLM: runner_env) registers each process in /dev/shm and
    removes the file at a normal exit only; vLLM's multiprocessing children end with
    os._exit. Call once those processes are gone."""
    for pid in pids:
        for leftover in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
            leftover.unlink(missing_ok=True)


class VLLMPeer:
    """One vLLM configuration as a benchmark engine: run() for the throughput benchmark,
    run_stream() (per-token arrival times) for the latency benchmark."""

    def __init__(self, config: VLLMConfig, runner: Runner):
        self.config, self.runner, self.name = config, runner, config.name
        self.version = ""

    def load(self, model: str, dtype: torch.dtype, max_model_len: int, seed: int) -> None:
        reply = self.runner.request(
            {"op": "load", "model": model, "dtype": str(dtype).removeprefix("torch."),
             "enforce_eager": self.config.eager, "max_model_len": max_model_len,
             "seed": seed}, LOAD_TIMEOUT_S)
        self.version = reply.get("vllm", "")

    def run(self, requests: list[Request]) -> TimedRun:
        reply = self.runner.request(
            {"op": "run", "requests": [[r.prompt, r.output_len] for r in requests],
             "stream": False}, RUN_TIMEOUT_S)
        return TimedRun(_outputs(reply, requests), float(reply["seconds"]))

    def run_stream(self, prompts: list[list[int]], output_len: int) -> dict[str, list[float]]:
        """Each request's token arrival times, seconds from the start of the round."""
        requests = [Request(p, output_len) for p in prompts]
        reply = self.runner.request(
            {"op": "run", "requests": [[r.prompt, r.output_len] for r in requests],
             "stream": True}, RUN_TIMEOUT_S)
        _outputs(reply, requests)
        return {f"r{i}": list(t) for i, t in enumerate(reply["token_times"])}


def _outputs(reply: dict[str, Any], requests: list[Request]) -> list[list[int]]:
    outputs = reply.get("outputs")
    if not isinstance(outputs, list) or [len(o) for o in outputs] != \
            [r.output_len for r in requests]:
        raise VLLMPeerError("vLLM runner: its outputs do not have the requests' lengths")
    return outputs


class VLLMPeers:
    """Every requested configuration, loaded one after the other (a load compiles, and two at
    once would share the cores), on the model directory (quantized ones too: vLLM reads their
    quantization_config itself), or for dummy weights (dummy_seed) a checkpoint of them written
    once to a temporary directory. A context manager: on leaving, every runner is stopped (its
    process group killed if need be) and the directory removed."""

    def __init__(self, configs: list[VLLMConfig], model: str, dummy_seed: int | None,
                 dtype: torch.dtype, max_model_len: int, kv_cache_gb: int = 1):
        self.peers: list[VLLMPeer] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="fleetllm-vllm-"))
        try:
            python = vllm_python()
            if dummy_seed is None:
                check_quantized_dtype(model, dtype)
            else:
                from fleetllm.benchmarks.checkpoint import write_dummy_checkpoint
                from fleetllm.benchmarks.workload import hf_quantization

                if hf_quantization(model) is not None:  # written unquantized, config says not
                    raise VLLMPeerError("--compare vllm on a quantized checkpoint runs its "
                                        "files: drop --load-format dummy")
                model = str(write_dummy_checkpoint(model, self.tmp / "model", dummy_seed,
                                                   dtype))
            for i, config in enumerate(configs):
                runner = Runner([str(python), str(RUNNER)],
                                runner_env(config, python, kv_cache_gb),
                                self.tmp / f"runner-{i}.log", config.name)
                peer = VLLMPeer(config, runner)
                self.peers.append(peer)
                peer.load(model, dtype, max_model_len, dummy_seed or 0)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for peer in self.peers:
            peer.runner.close()
        self.peers = []
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> VLLMPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def best_of(results: dict[str, Any], peers: list[VLLMPeer], faster) -> VLLMPeer:
    """The peer whose result is best by faster(a, b) -> bool (a better than b)."""
    best = peers[0]
    for p in peers[1:]:
        if faster(results[p.name], results[best.name]):
            best = p
    return best
