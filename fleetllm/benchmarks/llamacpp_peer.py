"""llama.cpp as the peer on a GGUF file (`fleetllm bench latency --model FILE.gguf --compare
llamacpp`): its llama-bench (`make llamacpp`) decoding on the same file, in the same run,
taking turns with fleetllm, on as many threads as torch uses here.

llama-bench reports decode tokens/s of `-n output_len` tokens after a context of
`-d input_len` (tg @ d), batch 1, its default f16 KV cache; it reports no TTFT (NaN here).
What fails: no llama-bench built (SystemExit naming `make llamacpp`), a batch above 1
(llama-bench's tg is one sequence), or llama-bench failing (its stderr's tail in the error).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA_BENCH = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-bench"


def llama_bench() -> Path:
    if not LLAMA_BENCH.exists():
        raise SystemExit(f"{LLAMA_BENCH} is missing: run `make llamacpp` first")
    return LLAMA_BENCH


class LlamaCppLatency:
    name = "llama.cpp"

    def __init__(self, path: str, input_len: int, threads: int, batch_size: int):
        if batch_size != 1:
            raise SystemExit("--compare llamacpp measures batch 1 (llama-bench's tg): "
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
            raise RuntimeError(f"llama-bench failed ({run.returncode}): {run.stderr[-2000:]}")
        [row] = json.loads(run.stdout)
        self.build = row.get("build_commit", "?")
        rate = float(row["avg_ts"])
        return {"ttft_s": math.nan, "tpot_p50_s": 1 / rate, "tpot_p99_s": math.nan,
                "e2e_s": output_len / rate, "decode_tokens_per_s": rate}
