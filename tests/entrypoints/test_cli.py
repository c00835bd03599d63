"""The `fleetllm` command line."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import pytest

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


# ---------------------------------------------------------------- help, flags, version

def help_text(argv: list[str], capsys, monkeypatch) -> str:
    """What `fleetllm <argv>` prints for --help, wide enough that few lines wrap."""
    from fleetllm.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def option_blocks(text: str) -> dict[str, str]:
    """Each option's help entry (its lines, wrapped ones included), keyed by its first flag."""
    blocks: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            key = m.group(1)
            blocks[key] = line
        elif key and line.startswith("   "):
            blocks[key] += " " + line.strip()
        else:
            key = None
    return blocks


def value_flags(argv: list[str]) -> list[str]:
    """The flags that take a value in the parser `fleetllm <argv> --help` describes."""
    from fleetllm.cli import build_parser

    parser = build_parser()
    for word in argv:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS]


@pytest.mark.parametrize("argv", [["generate"], ["bench", "throughput"], ["bench", "rpc"]])
def test_help_shows_each_default_exactly_once(argv, capsys, monkeypatch):
    blocks = option_blocks(help_text([*argv, "--help"], capsys, monkeypatch))
    flags = value_flags(argv)
    assert "--max-tokens" in flags or argv[0] == "bench"
    for flag in flags:
        assert flag in blocks, (flag, sorted(blocks))
        assert blocks[flag].count("default") == 1, blocks[flag]


@pytest.mark.parametrize("which, own_flag", [("throughput", "--num-prompts"),
                                             ("rpc", "--iters")])
def test_bench_help_is_the_benchmarks_own(which, own_flag, capsys, monkeypatch):
    text = help_text(["bench", which, "--help"], capsys, monkeypatch)
    assert text.startswith(f"usage: fleetllm bench {which}")
    assert own_flag in text


def test_version(capsys, monkeypatch):
    import fleetllm

    assert help_text(["--version"], capsys, monkeypatch).strip() == \
        f"fleetllm {fleetllm.__version__}"


@dataclasses.dataclass
class _FutureConfig:
    """Fields of kinds a config section may grow (a float timeout, an optional int, ...)."""

    some_timeout: float = 30.0
    optional_count: int | None = None
    optional_fraction: float | None = None
    some_switch: bool = False
    some_name: str = "x"


def test_engine_flag_types_follow_the_config_fields(monkeypatch):
    import fleetllm.cli as cli
    from fleetllm.config import engine_arg_fields
    from fleetllm.engine import arg_utils

    fields = engine_arg_fields()
    monkeypatch.setattr(arg_utils, "engine_arg_fields", lambda: [
        *fields, *((_FutureConfig, f) for f in dataclasses.fields(_FutureConfig))])
    args = cli.build_parser().parse_args([
        "generate", "--some-timeout", "5", "--execute-model-timeout", "5", "--optional-count",
        "3", "--optional-fraction", "1", "--some-switch", "--some-name", "7", "x"])
    assert args.some_timeout == 5.0 and type(args.some_timeout) is float
    assert args.execute_model_timeout == 5.0 and type(args.execute_model_timeout) is float
    assert args.optional_count == 3 and type(args.optional_count) is int
    assert type(args.optional_fraction) is float
    assert args.some_switch is True and args.some_name == "7"
    assert cli.build_parser().parse_args(["generate", "--no-some-switch", "x"]
                                         ).some_switch is False
    # Every numeric engine flag parses to its config default's type.
    for _, f in fields:
        if isinstance(f.default, int | float) and not isinstance(f.default, bool):
            args = cli.build_parser().parse_args(["generate", f"--{f.name.replace('_', '-')}",
                                                  "5", "x"])
            assert type(getattr(args, f.name)) is type(f.default), f.name
    assert cli.build_parser().parse_args(["generate", "--swap-space", "5e8", "x"]
                                         ).swap_space == 500_000_000


def test_missing_demo_model_says_how_to_get_it(tmp_path, monkeypatch):
    from fleetllm.engine import arg_utils
    from fleetllm.errors import ModelLoadError

    assert arg_utils.resolve_model(None) == str(arg_utils.DEMO_MODEL)  # the bundled one
    monkeypatch.setattr(arg_utils, "DEMO_MODEL", tmp_path / "demo_model")
    with pytest.raises(ModelLoadError) as info:
        arg_utils.resolve_model(None)
    assert "--model" in str(info.value) and "train_demo_model.py" in str(info.value)


# ---------------------------------------------------------------- end to end

def test_debug_is_accepted_before_and_after_the_subcommand(tmp_path):
    for argv in (["generate", "--debug", "--model", str(tmp_path / "missing"), "hello"],
                 ["bench", "throughput", "--debug", "--model", str(tmp_path / "missing")]):
        proc = run(*argv)
        assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr


def test_a_rejected_prompt_prints_one_line(tiny_models):
    model = str(tiny_models["llama_gqa"])
    proc = run("generate", "--model", model, "--max-model-len", "8", "--kv-cache-memory",
               "33554432", "--quiet", "a prompt far longer than eight tokens " * 3)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: [E007]") and "max_model_len" in proc.stderr


def test_vllm_flags_that_mean_nothing_warn_and_unsupported_ones_fail(tiny_models):
    model = str(tiny_models["llama_gqa"])
    proc = run("generate", "--model", model, "--max-tokens", "2", "--kv-cache-memory",
               "33554432", "--quiet", "--enforce-eager", "--trust-remote-code", "hi")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("enforce_eager") == 1, proc.stderr
    assert proc.stderr.count("trust_remote_code") == 1, proc.stderr
    proc = run("generate", "--model", model, "--quantization", "awq", "hi")
    assert proc.returncode == 1 and proc.stderr.startswith("error: [E005] quantization")
