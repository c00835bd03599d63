"""llama.cpp as the peer on a GGUF file: its tools (`make llamacpp`) on the same file, in the
same run, taking turns with fleetllm, on as many threads as torch uses here.

- `bench latency --model FILE.gguf --compare llamacpp`: llama-bench's decode tokens/s of
  `-n output_len` tokens after a context of `-d input_len` (tg @ d), batch 1, its default f16
  KV cache; it reports no TTFT (NaN here).
- `bench throughput --model FILE.gguf --compare llamacpp`: llama-batched-bench, one sequence
  per request, all of them together (-npl), each of the requests' mean prompt and output
  lengths (it runs one length for every sequence), timed by itself: prefill, then decode.

What fails: no tool built (PeerError naming `make llamacpp`), a batch above 1 for latency
(llama-bench's tg is one sequence), the tool failing (PeerError with its output's tail).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fleetllm.benchmarks.workload import Request, TimedRun
from fleetllm.errors import ConfigurationError, PeerError

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".peers" / "llama.cpp" / "build" / "bin"
LLAMA_BENCH = BIN / "llama-bench"
RUN_TIMEOUT_S = 3600
# llama-batched-bench prints its rows from a logging thread that the process does not join at
# exit: a finished run loses its last row now and then (up to 4 runs in 10 on a tiny model
# here). Such a run is repeated, up to this many times.
LOST_ROW_RETRIES = 3


def llamacpp_tool(name: str) -> Path:
    """A binary of the llama.cpp build (BIN), or PeerError saying how to build it."""
    path = BIN / name
    if not path.is_file():
        raise PeerError(f"{path} is missing: run `make llamacpp` first")
    return path


def llama_bench() -> Path:
    return llamacpp_tool("llama-bench")


def _failure(tool: str, run: subprocess.CompletedProcess, cmd: list[str]) -> PeerError:
    code = run.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    tail = (run.stderr or run.stdout or "")[-2000:]
    return PeerError(f"{tool} failed ({how}): {' '.join(cmd)}\n{tail}")


class LlamaCppLatency:
    name = "llama.cpp"

    def __init__(self, path: str, input_len: int, threads: int, batch_size: int):
        if batch_size != 1:
            raise ConfigurationError("--compare llamacpp measures batch 1 (llama-bench's tg): "
                                     f"--batch-size {batch_size}")
        self.bench, self.path, self.input_len, self.threads = llama_bench(), path, input_len, \
            threads
        self.build = "?"

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        # -ub 1: the context's prefill one token at a time. Its batched prefill crashes on
        # AMX CPUs (a segfault in ggml_backend_amx_mul_mat, seen with this build on a Xeon
        # with AMX for Q8_0 and Q4_K_M); decode is one token a step either way, and the
        # weights keep llama.cpp's repacked layout (--repack 0 was 20% slower).
        cmd = [str(self.bench), "-m", self.path, "-p", "0", "-n", str(output_len), "-d",
               str(self.input_len), "-ub", "1", "-t", str(self.threads), "-r", "1", "-o",
               "json"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise _failure("llama-bench", run, cmd)
        [row] = json.loads(run.stdout)
        self.build = row.get("build_commit", "?")
        rate = float(row["avg_ts"])
        return {"ttft_s": math.nan, "tpot_p50_s": 1 / rate, "tpot_p99_s": math.nan,
                "e2e_s": output_len / rate, "decode_tokens_per_s": rate}


# ------------------------------------------------------------------------------ throughput


@dataclass(frozen=True)
class BatchShape:
    """What llama-batched-bench runs for a list of requests: `sequences` of `prompt_len` +
    `output_len` tokens; `mean`: the requests' lengths vary, these are their rounded means."""

    sequences: int
    prompt_len: int
    output_len: int
    mean: bool

    @classmethod
    def of(cls, requests: list[Request]) -> BatchShape:
        ins = [len(r.prompt) for r in requests]
        outs = [r.output_len for r in requests]
        return cls(len(requests), max(1, round(sum(ins) / len(ins))),
                   max(1, round(sum(outs) / len(outs))),
                   len(set(ins)) > 1 or len(set(outs)) > 1)

    @property
    def input_tokens(self) -> int:
        return self.sequences * self.prompt_len

    @property
    def output_tokens(self) -> int:
        return self.sequences * self.output_len


# One row of its markdown table: PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s |
# T s | S t/s, named as its JSONL rows name them.
_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_TABLE_ROW = re.compile(r"^\|" + r"\s*([0-9.]+)\s*\|" * len(_KEYS) + r"\s*$")


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """Every result row in llama-batched-bench's output, JSONL (--output-format jsonl) or its
    markdown table, as {key: number} with the JSONL keys (_KEYS); any other line is skipped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(item, dict) and all(k in item for k in _KEYS):
                rows.append({k: float(item[k]) for k in _KEYS})
        elif match := _TABLE_ROW.match(line):
            rows.append(dict(zip(_KEYS, map(float, match.groups()), strict=True)))
    return rows


def amx_cpu() -> bool:
    """Whether this CPU has AMX (Linux's cpuinfo flags; False where there are none)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def peer_env() -> dict[str, str]:
    """This environment without the OpenMP settings (fleetllm sets GOMP_SPINCOUNT for its
    own threads at import): llama.cpp's OpenMP threads wait as they do for its users."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("KMP_", "OMP_", "GOMP_"))}


class LlamaCppThroughput:
    """llama-batched-bench on the GGUF file as a `bench throughput` engine. Its prompt tokens
    and the tokens it feeds back are random (it computes each step's logits, samples none);
    its KV cache is its default (f16), one stream per sequence. run() returns its own time
    (prefill + decode, not loading) and no outputs; shape() what it ran."""

    name = "llama.cpp"

    def __init__(self, path: str, threads: int):
        self.bench, self.path, self.threads = llamacpp_tool("llama-batched-bench"), path, \
            threads
        # Its repacked weights (AMX tiles, on CPUs with AMX) crash with more than one
        # sequence: a segfault in ggml_backend_amx_mul_mat at any -ub, 1 included (seen with
        # this build on a Xeon with AMX, Q4_K_M; only -kvu -ub 1 ran, one token a matmul: no
        # batching left to measure). --no-repack runs its plain kernels.
        self.repack = not amx_cpu()
        self.lost_rows = 0  # runs repeated because their row was lost (LOST_ROW_RETRIES)

    shape = staticmethod(BatchShape.of)

    def command(self, shape: BatchShape) -> list[str]:
        """Every sequence its own prompt (no -pps), a context that holds them all (a row
        that does not fit is skipped silently), its default batch sizes (-b 2048, -ub 512)."""
        cmd = [str(self.bench), "-m", self.path,
               "-c", str(shape.sequences * (shape.prompt_len + shape.output_len)),
               "-npp", str(shape.prompt_len), "-ntg", str(shape.output_len),
               "-npl", str(shape.sequences), "-t", str(self.threads), "-tb", str(self.threads),
               "--output-format", "jsonl"]
        return cmd if self.repack else [*cmd, "--no-repack"]

    def run(self, requests: list[Request]) -> TimedRun:
        shape = self.shape(requests)
        cmd = self.command(shape)
        want = (shape.prompt_len, shape.output_len, shape.sequences)
        for _ in range(1 + LOST_ROW_RETRIES):
            run = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                                 timeout=RUN_TIMEOUT_S, env=peer_env())
            if run.returncode != 0:
                raise _failure("llama-batched-bench", run, cmd)
            rows = [r for r in parse_batched_bench(run.stdout)
                    if (r["pp"], r["tg"], r["pl"]) == want]
            if rows:
                return TimedRun([], rows[0]["t"])
            self.lost_rows += 1
        raise PeerError(f"llama-batched-bench printed no result row for {want} (pp, tg, pl) in "
                        f"{1 + LOST_ROW_RETRIES} runs: {' '.join(cmd)}\n{run.stdout[-2000:]}")

    def report(self, requests: list[Request], figures: dict) -> None:
        """Print and record fleetllm / llama.cpp in output and total tokens/s (each engine's
        rates from its own token counts: figures["engines"]) and what llama.cpp ran."""
        shape = self.shape(requests)
        ours, theirs = figures["engines"]["fleetllm"], figures["engines"][self.name]
        out = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        total = ours["total_tokens_per_s"] / theirs["total_tokens_per_s"]
        figures["llamacpp"] = {
            "ratio_output_tokens_per_s": out, "ratio_total_tokens_per_s": total,
            "sequences": shape.sequences, "prompt_len": shape.prompt_len,
            "output_len": shape.output_len, "mean_lengths": shape.mean, "repack": self.repack,
            "lost_rows": self.lost_rows}
        ins, outs = [len(r.prompt) for r in requests], [r.output_len for r in requests]
        means = (f", the workload's mean lengths (its requests vary: prompts {min(ins)}-"
                 f"{max(ins)}, outputs {min(outs)}-{max(outs)})") if shape.mean else ""
        repack = "" if self.repack else \
            "; --no-repack (its AMX kernels crash on several sequences on this CPU)"
        print(f"ratio fleetllm / llama.cpp: output tokens/s {out:.2f}x, total tokens/s "
              f"{total:.2f}x (llama-batched-bench: {shape.sequences} sequences of "
              f"{shape.prompt_len} prompt + {shape.output_len} output tokens{means}; random "
              f"tokens, no sampling; the same file and thread count{repack})")
