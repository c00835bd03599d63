"""The `fleetllm` command line."""

from __future__ import annotations

import subprocess
import sys

CLI = [sys.executable, "-m", "fleetllm.cli"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_prints_the_completion(tiny_models):
    proc = run("generate", "--model", str(tiny_models["llama_gqa"]), "--max-tokens", "6",
               "--kv-cache-memory", "33554432", "--quiet", "hello")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hello") and len(proc.stdout.strip()) > len("hello")


def test_errors_are_one_line_without_traceback(tmp_path, tiny_models):
    proc = run("generate", "--model", str(tmp_path / "missing"), "hello")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: [E004]") and "missing" in proc.stderr
    proc = run("generate", "--model", str(tiny_models["llama_gqa"]), "--block-size", "3", "x")
    assert proc.returncode == 1 and "block_size" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    proc = run("--debug", "generate", "--model", str(tmp_path / "missing"), "hello")
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_help_lists_vllm_flag_names():
    proc = run("generate", "--help")
    assert proc.returncode == 0
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size",
                 "--distributed-executor-backend", "--max-model-len", "--block-size",
                 "--max-num-seqs", "--max-num-batched-tokens", "--preemption-mode", "--dtype",
                 "--kv-cache-memory", "--temperature", "--max-tokens"):
        assert flag in proc.stdout


def test_bench_throughput_prints_ratio_against_hf(tiny_models):
    proc = run("bench", "throughput", "--model", str(tiny_models["llama_gqa"]),
               "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
               "--hf-batch-size", "2", "--kv-cache-memory", "33554432",
               "--compare-backend", "uni", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    assert "requests/s" in proc.stdout and "ratio fleetllm / HF" in proc.stdout
    assert "ratio default / uni" in proc.stdout


def test_bench_rpc_prints_round_trips_next_to_uni():
    proc = run("bench", "rpc", "--backend", "mp", "--tensor-parallel-size", "2", "--iters", "50")
    assert proc.returncode == 0, proc.stderr
    assert "median" in proc.stdout and "uni" in proc.stdout
