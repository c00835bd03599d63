"""`bench throughput --model FILE.gguf --compare llamacpp`: the llama-batched-bench command it
builds, its output read (samples of this build's real output), lost rows and crashes (a fake
tool), and one real run where `make llamacpp` built the tool (skipped elsewhere)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from gguf_helpers import DEMO, llamacpp_tool

from fleetllm.benchmarks import llamacpp_peer
from fleetllm.benchmarks.llamacpp_peer import BatchShape, LlamaCppThroughput
from fleetllm.benchmarks.workload import Request
from fleetllm.cli import build_parser
from fleetllm.errors import ConfigurationError, PeerError

KV = ["--kv-cache-memory", "33554432"]

# Real output of this build (demo model, Q4_K_M, -npp 32 -ntg 8 -npl 2,4 -t 2 --no-repack),
# on a busy machine: the figures mean nothing, the format is the point.
JSONL = """\
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 2, \
"n_kv": 80, "t_pp": 0.367488, "speed_pp": 174.155350, "t_tg": 2.859892, "speed_tg": 5.594617, \
"t": 3.227380, "speed": 24.787910}
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 4, \
"n_kv": 160, "t_pp": 0.368858, "speed_pp": 347.016998, "t_tg": 1.454597, \
"speed_tg": 21.999220, "t": 1.823455, "speed": 87.745514}

"""
TABLE = """
llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = -1, \
is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |      8 |    2 |     80 |    0.371 |   172.72 |    2.439 |     6.56 |    2.810 |    28.47 |
|    32 |      8 |    4 |    160 |    0.021 |  6020.13 |    0.015 |  2116.54 |    0.036 |  4397.90 |
"""


@pytest.fixture(scope="module")
def demo_q8(tmp_path_factory) -> Path:
    """The demo model as a Q8_0 GGUF (a type this build repacks for AMX: --no-repack runs)."""
    from fleetllm.quant.gguf_export import export_gguf

    return export_gguf(DEMO, tmp_path_factory.mktemp("gguf") / "demo-q8_0.gguf", "Q8_0",
                       progress=False)


def _run(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return args.run(args)


def _fake_tool(directory: Path, body: str) -> Path:
    """A llama-batched-bench in `directory`: a Python script running `body` (argv in `args`,
    a run counter in the file `count`)."""
    directory.mkdir(parents=True, exist_ok=True)
    tool = directory / "llama-batched-bench"
    tool.write_text(f"#!{sys.executable}\nimport json, os, sys\nargs = sys.argv[1:]\n"
                    f"count = {str(directory / 'count')!r}\n"
                    "n = int(open(count).read()) + 1 if os.path.exists(count) else 1\n"
                    "open(count, 'w').write(str(n))\n" + body)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


def test_output_rows_jsonl_or_table_among_log_lines():
    rows = llamacpp_peer.parse_batched_bench("main: loading\n" + JSONL + '{"pp": 1}\n{oops\n')
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(32, 8, 2), (32, 8, 4)]
    assert rows[1]["t"] == pytest.approx(1.823455) and rows[1]["speed_tg"] == \
        pytest.approx(21.99922)
    table = llamacpp_peer.parse_batched_bench(TABLE)
    assert [(r["pl"], r["n_kv"], r["t_tg"], r["t"]) for r in table] == \
        [(2, 80, 2.439, 2.81), (4, 160, 0.015, 0.036)]
    assert llamacpp_peer.parse_batched_bench("") == []


def test_shape_is_the_requests_mean_lengths():
    same = BatchShape.of([Request([5] * 16, 4)] * 3)
    assert same == BatchShape(3, 16, 4, mean=False)
    varied = BatchShape.of([Request([5] * n, o) for n, o in ((10, 3), (21, 8), (30, 6))])
    assert varied == BatchShape(3, 20, 6, mean=True)  # 61/3 -> 20, 17/3 -> 6
    assert (varied.input_tokens, varied.output_tokens) == (60, 18)


@pytest.mark.parametrize("amx", [False, True])
def test_command_line(tmp_path, monkeypatch, amx):
    """One sequence per request, their mean lengths, a context holding them all, fleetllm's
    thread count for both phases, JSONL; on an AMX CPU without llama.cpp's repacked weights."""
    monkeypatch.setattr(llamacpp_peer, "BIN", _fake_tool(tmp_path, "").parent)
    monkeypatch.setattr(llamacpp_peer, "amx_cpu", lambda: amx)
    peer = LlamaCppThroughput("/m/model.gguf", 3)
    requests = [Request([5] * n, o) for n, o in ((10, 3), (21, 8), (30, 6))]
    assert peer.command(peer.shape(requests)) == [
        str(tmp_path / "llama-batched-bench"), "-m", "/m/model.gguf", "-c", str(3 * 26),
        "-npp", "20", "-ntg", "6", "-npl", "3", "-t", "3", "-tb", "3", "--output-format",
        "jsonl", *(["--no-repack"] if amx else [])]
    assert peer.repack is not amx


def test_run_repeats_a_lost_row_and_reports_a_crash(tmp_path, monkeypatch):
    """Its row lost at exit (the first two runs print none): run again; its own time is the
    round's; fleetllm's OpenMP settings are not passed on. A crash names its signal."""
    row = {"pp": 16, "tg": 4, "pl": 2, "n_kv": 40, "t_pp": 0.5, "speed_pp": 64.0, "t_tg": 0.25,
           "speed_tg": 32.0, "t": 0.75, "speed": 53.3}
    _fake_tool(tmp_path, "open(count + '.env', 'w').write(os.environ.get('GOMP_SPINCOUNT', ''))\n"
                         f"print('log line'); print(json.dumps({row}) if n > 2 else '')\n")
    monkeypatch.setattr(llamacpp_peer, "BIN", tmp_path)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    peer = LlamaCppThroughput("m.gguf", 2)
    timed = peer.run([Request([7] * 16, 4)] * 2)
    assert timed.seconds == 0.75 and timed.outputs == [] and peer.lost_rows == 2
    assert (tmp_path / "count").read_text() == "3" and (tmp_path / "count.env").read_text() == ""
    with pytest.raises(PeerError, match="printed no result row"):
        peer.run([Request([7] * 16, 5)] * 2)  # never the asked row
    _fake_tool(tmp_path, "import signal; os.kill(os.getpid(), signal.SIGSEGV)\n")
    with pytest.raises(PeerError, match="killed by SIGSEGV"):
        peer.run([Request([7] * 16, 4)] * 2)


def test_missing_tool_and_wrong_peers_fail_before_loading(tmp_path, monkeypatch, tiny_models,
                                                          demo_q8):
    fake = str(demo_q8)
    monkeypatch.setattr(llamacpp_peer, "BIN", tmp_path / "none")
    with pytest.raises(PeerError, match="run `make llamacpp`"):
        _run(["bench", "throughput", "--model", fake, *KV])  # llamacpp: a GGUF's default
    with pytest.raises(ConfigurationError, match="peer of a GGUF"):
        _run(["bench", "throughput", "--model", fake, "--compare", "hf,llamacpp"])
    with pytest.raises(ConfigurationError, match="peer of a GGUF"):
        _run(["bench", "throughput", "--model", str(tiny_models["llama_gqa"]), "--compare",
              "llamacpp"])
    with pytest.raises(ConfigurationError, match="--shared-prefix"):
        _run(["bench", "throughput", "--model", fake, "--shared-prefix", "8"])


def test_throughput_beside_real_llama_batched_bench(tmp_path, monkeypatch, capsys, demo_q8):
    """The real tool on a Q8_0 file of the demo model: taking turns, its row read, the ratios
    printed with the mean lengths it ran."""
    monkeypatch.setattr(llamacpp_peer, "BIN", llamacpp_tool("llama-batched-bench").parent)
    figures = _run(["bench", "throughput", "--model", str(demo_q8), "--compare", "llamacpp",
                    "--num-prompts", "3", "--input-len", "8:24", "--output-len", "2:6",
                    "--repeat", "2", "--no-roofline", "--json", str(tmp_path / "f.json"), *KV])
    peer, ours = figures["engines"]["llama.cpp"], figures["engines"]["fleetllm"]
    assert peer["output_tokens_per_s"] > 0 and peer["seconds"] > 0
    info = figures["llamacpp"]
    assert info["sequences"] == 3 and info["mean_lengths"]
    assert info["ratio_output_tokens_per_s"] == pytest.approx(
        ours["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert figures["dtype"] == "GGUF Q8_0, activations float32"
    assert json.loads((tmp_path / "f.json").read_text())["llamacpp"] == info
    out = capsys.readouterr().out
    assert "ratio fleetllm / llama.cpp: output tokens/s" in out and "mean lengths" in out
