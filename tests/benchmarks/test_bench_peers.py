"""The benchmarks' model presets, their dummy weights written as a checkpoint, the engine's dtype
carried to the peers, the roofline and the bandwidth bound, and the vLLM peer's driver (against
a fake runner: CI has no .venv-vllm; one test runs the real one where `make peers` made it)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from serving_helpers import alive

from fleetllm import LLM, SamplingParams
from fleetllm.benchmarks import vllm_peer, workload
from fleetllm.benchmarks.checkpoint import write_dummy_checkpoint
from fleetllm.benchmarks.hf_peers import HFGenerate, load_hf_model
from fleetllm.benchmarks.presets import PRESETS
from fleetllm.cli import build_parser
from fleetllm.config import ArchConfig
from fleetllm.model.loader import dummy_tensor, hf_tensor_shapes

KV = ["--kv-cache-memory", "33554432"]
TESTS = Path(__file__).resolve().parents[1]  # the fakes are helper modules in tests/
FAKE_RUNNER = TESTS / "fake_vllm_runner.py"
REAL_VLLM = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def run(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return args.run(args)


def shrunk(name: str, path: Path, dtype: str = "float32", head_dim: int = 16) -> Path:
    """The preset's architecture (biases, tying, rope scaling) at a test's size."""
    cfg = {**PRESETS[name], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": head_dim, "max_position_embeddings": 1024, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": dtype}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _requests(vocab: int) -> list[workload.Request]:
    g = torch.Generator().manual_seed(5)
    return [workload.Request(torch.randint(3, vocab, (n,), generator=g).tolist(), 3 + n % 5)
            for n in (3, 9, 17, 30)]


def _fleet(model: Path, requests: list[workload.Request], **kwargs) -> list[list[int]]:
    with LLM(model, kv_cache_memory=16 << 20, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                            [SamplingParams(temperature=0, max_tokens=r.output_len,
                                            ignore_eos=True) for r in requests],
                            use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------- presets, checkpoint


def test_presets_have_the_public_models_shapes():
    params = {name: sum(math.prod(s) for s in hf_tensor_shapes(ArchConfig.from_dict(c)).values())
              for name, c in PRESETS.items()}
    assert params == {"llama-125m": 124_668_672, "qwen2-0.5b": 494_032_768,
                      "llama-1b": 1_235_814_400,  # Qwen2-0.5B's and Llama-3.2-1B's counts
                      "qwen3-moe-small": 2_623_556_608, "qwen3-dense-small": 357_583_872}
    moe = ArchConfig.from_dict(PRESETS["qwen3-moe-small"])
    # the dense preset's parameters are the MoE one's active ones (8 of 128 experts) but for
    # the routers
    inactive = (moe.num_experts - moe.experts_per_token) * 3 * moe.hidden_size \
        * moe.moe_intermediate_size * moe.num_layers
    routers = moe.num_experts * moe.hidden_size * moe.num_layers
    assert params["qwen3-moe-small"] - inactive - routers == params["qwen3-dense-small"]
    # a batch-1 step reads the 8 experts picked; a large batch every one of them
    dense = ArchConfig.from_dict(PRESETS["qwen3-dense-small"])
    assert workload.weight_bytes(moe, 2) - workload.weight_bytes(dense, 2) == 2 * routers
    assert workload.weight_bytes(moe, 2, batch=10_000) == pytest.approx(
        workload.weight_bytes(dense, 2) + 2 * (routers + inactive), rel=1e-6)
    qwen, llama = (ArchConfig.from_dict(PRESETS[n]) for n in ("qwen2-0.5b", "llama-1b"))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.sliding_window is None and qwen.rope_theta == 1e6
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.tie_word_embeddings
    assert qwen.torch_dtype == llama.torch_dtype == "bfloat16"
    assert PRESETS["llama-125m"]["torch_dtype"] == "float32"


def test_a_preset_directory_is_removed_when_the_benchmark_exits():
    """Every `bench --preset` run used to leave its config-only checkpoint in /tmp."""
    code = ("from fleetllm.benchmarks.presets import preset_dir; import os; p = preset_dir("
            "'llama-125m'); assert os.path.isfile(os.path.join(p, 'config.json')); print(p)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    path = Path(proc.stdout.strip())
    assert path.name.startswith("fleetllm-llama-125m-") and not path.exists()


@pytest.mark.parametrize("name", ["qwen2-0.5b", "llama-1b"])
def test_shrunk_presets_load_and_match_transformers(name, tmp_path):
    """fleetllm's dummy load of the architecture and transformers given the same tensors
    (hf_peers) agree token for token."""
    model = shrunk(name, tmp_path / name)
    requests = _requests(512)
    ours = _fleet(model, requests, load_format="dummy", seed=3)
    hf = HFGenerate(load_hf_model(str(model), 3), batch_size=2).run(requests)
    assert ours == hf


def test_written_checkpoint_is_the_dummy_weights(tmp_path):
    """Sharded (a small shard size) in bf16: each tensor is the dummy one rounded to bf16, and
    fleetllm loading the files generates what it does from load_format="dummy"."""
    src = shrunk("llama-1b", tmp_path / "config")
    out = write_dummy_checkpoint(src, tmp_path / "ckpt", 3, torch.bfloat16, shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shapes = hf_tensor_shapes(ArchConfig.from_dict(json.loads((src / "config.json").read_text())))
    assert set(index["weight_map"]) == set(shapes) and "lm_head.weight" not in shapes
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, file in list(index["weight_map"].items())[:6]:
        with safe_open(str(out / file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), dummy_tensor(name, shapes[name], 3).to(
                torch.bfloat16))
    requests = _requests(512)
    assert _fleet(out, requests) == _fleet(src, requests, load_format="dummy", seed=3,
                                           dtype="bfloat16")


# ---------------------------------------------------------------------- dtype, roofline


def test_weight_and_kv_bytes_follow_the_dtype_and_count_a_tied_head_once():
    cfg = {**PRESETS["llama-1b"]}
    tied = ArchConfig.from_dict(cfg)
    untied = ArchConfig.from_dict({**cfg, "tie_word_embeddings": False})
    assert workload.weight_bytes(tied, 2) * 2 == workload.weight_bytes(tied, 4)
    # one vocab x hidden matrix either way: the LM head (a step reads a few embedding rows)
    assert workload.weight_bytes(tied, 2) == workload.weight_bytes(untied, 2)
    params = sum(math.prod(s) for s in hf_tensor_shapes(tied).values())
    assert workload.weight_bytes(tied, 2) == params * 2
    qwen = ArchConfig.from_dict(PRESETS["qwen2-0.5b"])  # biases counted too
    assert workload.weight_bytes(qwen, 2) == 2 * sum(
        math.prod(s) for s in hf_tensor_shapes(qwen).values())
    assert workload.kv_bytes_per_token(tied, 2) == 2 * 16 * 8 * 64 * 2


def test_matmul_rate_in_bf16():
    a = ArchConfig.from_dict({**PRESETS["llama-125m"], "num_hidden_layers": 1,
                              "vocab_size": 1024})
    rates = workload.matmul_rate(a, 8, torch.bfloat16, repeat=1)
    assert rates["best"] == max(rates.values()) and rates["dense"] > 0


def test_benchmarks_run_peers_bound_and_roofline_in_the_engine_dtype(tiny_models, monkeypatch,
                                                                      capsys):
    from fleetllm.benchmarks import hf_peers

    seen = []

    def load(model_dir, dummy_seed, dtype=torch.float32):
        seen.append(dtype)
        return load_hf_model(model_dir, dummy_seed, dtype)

    monkeypatch.setattr(hf_peers, "load_hf_model", load)
    model = str(tiny_models["llama_gqa"])
    figures = run(["bench", "throughput", "--model", model, "--dtype", "bfloat16",
                   "--num-prompts", "3", "--input-len", "8", "--output-len", "3",
                   "--hf-batch-size", "2", "--repeat", "1", *KV])
    assert figures["dtype"] == figures["roofline"]["dtype"] == "bfloat16"
    assert "roofline (bfloat16 torch matmul)" in capsys.readouterr().out
    lat = run(["bench", "latency", "--model", model, "--dtype", "bfloat16", "--batch-size",
               "2", "--input-len", "8", "--output-len", "4", "--repeat", "1", *KV])
    assert seen == [torch.bfloat16, torch.bfloat16]
    arch = ArchConfig.from_dict(json.loads((tiny_models["llama_gqa"] / "config.json")
                                           .read_text()))
    kv = 2 * (8 + 4 / 2) * workload.kv_bytes_per_token(arch, 2)
    assert lat["decode_step_bytes"] == pytest.approx(workload.weight_bytes(arch, 2) + kv)
    assert lat["kv_cache_dtype"] == "bfloat16"


# ----------------------------------------------------------------------------- vLLM peer


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The driver pointed at the fake runner, run by this interpreter; returns its log."""
    log = tmp_path / "runner.jsonl"
    monkeypatch.setenv("FLEETLLM_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_RUNNER_LOG", str(log))
    monkeypatch.setattr(vllm_peer, "RUNNER", FAKE_RUNNER)
    return log


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_missing_vllm_venv_says_make_peers(monkeypatch, tiny_models, capsys):
    from fleetllm.cli import main

    monkeypatch.setenv("FLEETLLM_VLLM_PYTHON", "/nonexistent/.venv-vllm/bin/python")
    with pytest.raises(vllm_peer.VLLMPeerError, match="run `make peers`"):
        run(["bench", "throughput", "--model", str(tiny_models["llama_gqa"]),
             "--compare", "vllm", *KV])
    assert main(["bench", "latency", "--model", str(tiny_models["llama_gqa"]), "--compare",
                 "hf,vllm", *KV]) == 1
    assert "run `make peers`" in capsys.readouterr().err


def test_vllm_configs_and_runner_environment(monkeypatch):
    configs = vllm_peer.parse_configs("all", 2)
    assert [c.name for c in configs] == [
        "vLLM (compiled, bind auto)", "vLLM (compiled, bind 0-1)", "vLLM (eager, bind auto)",
        "vLLM (eager, bind 0-1)"]
    assert vllm_peer.parse_configs("eager:cores,compiled:0,2", 3)[0].bind == "0-2"
    with pytest.raises(ValueError, match="MODE:BIND"):
        vllm_peer.parse_configs("fast:auto", 2)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # fleetllm's OpenMP wait, not vLLM's
    env = vllm_peer.runner_env(configs[1], Path("/x/.venv-vllm/bin/python"), 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in env
    assert "GOMP_SPINCOUNT" not in env  # vLLM sets its own (Intel OpenMP's 5 ms)


def test_throughput_compares_every_vllm_config_and_the_best(fake_vllm, tiny_models, capsys):
    """With dummy weights the runners get a written checkpoint (removed afterwards), the
    engine's dtype and the requests; each configuration is a printed engine; the ratio is to
    the fastest (bound to cores, compiled: 0.25 s in the fake)."""
    figures = run(["bench", "throughput", "--model", str(tiny_models["llama_gqa"]),
                   "--load-format", "dummy", "--dtype", "bfloat16", "--compare", "vllm",
                   "--vllm-configs", "compiled:auto,eager:cores,compiled:cores",
                   "--num-prompts", "3", "--input-len", "8", "--output-len", "2:4",
                   "--repeat", "2", "--no-roofline", "--vllm-kv-gb", "2", *KV])
    entries = _log(fake_vllm)
    loads = [e for e in entries if e["msg"]["op"] == "load"]
    assert [(e["msg"]["enforce_eager"], e["env"]["VLLM_CPU_OMP_THREADS_BIND"]) for e in loads] \
        == [(False, "auto"), (True, "0-1"), (False, "0-1")]
    assert {e["env"]["VLLM_CPU_KVCACHE_SPACE"] for e in loads} == {"2"}
    ckpt = Path(loads[0]["msg"]["model"])
    assert loads[0]["msg"]["dtype"] == "bfloat16" and loads[0]["msg"]["max_model_len"] == 12
    assert not ckpt.exists()  # written for the run, then removed
    runs = [e["msg"] for e in entries if e["msg"]["op"] == "run"]
    assert len(runs) == 3 * 3  # warm-up + 2 rounds, per configuration
    assert [len(p) for p, _ in runs[-1]["requests"]] == [8, 8, 8]
    assert sum(e["msg"]["op"] == "exit" for e in entries) == 3
    v = figures["vllm"]
    assert v["best"] == "vLLM (compiled, bind 0-1)" and v["identical_outputs"] == 0
    ours = figures["engines"]["fleetllm"]["seconds"]
    assert v["speedup"] == pytest.approx(0.25 / ours)
    assert figures["engines"]["vLLM (eager, bind 0-1)"]["seconds"] == pytest.approx(0.35)
    text = capsys.readouterr().out
    assert "vLLM (compiled, bind auto):" in text and \
        "ratio fleetllm / vLLM best (compiled, bind 0-1)" in text


def test_latency_compares_vllm_streamed_token_times(fake_vllm, tiny_models):
    figures = run(["bench", "latency", "--model", str(tiny_models["llama_gqa"]), "--compare",
                   "vllm", "--vllm-configs", "eager:auto", "--batch-size", "2",
                   "--input-len", "8", "--output-len", "5", "--repeat", "1", *KV])
    peer = figures["engines"]["vLLM (eager, bind auto)"]
    assert peer["ttft_s"] == pytest.approx(0.01) and peer["tpot_p50_s"] == pytest.approx(0.01)
    assert figures["vllm"]["best"] == "vLLM (eager, bind auto)"
    assert _log(fake_vllm)[0]["msg"]["max_model_len"] == 13


@pytest.mark.parametrize("mode, error", [("crash", "exited"), ("hang", "did not answer")])
def test_a_failing_runner_raises_and_is_killed(mode, error, fake_vllm, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_RUNNER_MODE", mode)
    monkeypatch.setattr(vllm_peer, "RUN_TIMEOUT_S", 1.0)
    monkeypatch.setattr(vllm_peer, "EXIT_TIMEOUT_S", 2.0)
    peers = vllm_peer.VLLMPeers(vllm_peer.parse_configs("eager:auto", 2), str(tmp_path), None,
                                torch.float32, 16)
    proc = peers.peers[0].runner.proc
    with peers, pytest.raises(vllm_peer.VLLMPeerError, match=error):
        peers.peers[0].run([workload.Request([3, 4], 2)])
    assert proc.poll() is not None and not peers.tmp.exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or not Path("/dev/shm").is_dir(),
                    reason="Linux: /proc and /dev/shm")
def test_closing_a_runner_removes_its_processes_openmp_files(tmp_path):
    """vLLM's engine-core child (Intel OpenMP preloaded) ends with os._exit, leaving
    /dev/shm/__KMP_REGISTERED_LIB_<pid>_0 behind: a runner's close removes those of every
    process of its group, and no other."""
    script = tmp_path / "runner.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        for pid in (child.pid, 0):  # 0: a file no process of the group owns
            open(f"/dev/shm/__KMP_REGISTERED_LIB_{pid or 999999999}_0", "w").close()
        print(child.pid, flush=True)
        sys.stdin.read()  # until the driver closes it
        """))
    runner = vllm_peer.Runner([sys.executable, str(script)], None, tmp_path / "log", "fake")
    child = int(runner.proc.stdout.readline())
    mine = Path(f"/dev/shm/__KMP_REGISTERED_LIB_{child}_0")
    other = Path("/dev/shm/__KMP_REGISTERED_LIB_999999999_0")
    try:
        assert mine.exists() and child in vllm_peer.descendants(runner.proc.pid)
        runner.close()
        assert not mine.exists() and other.exists()
        end = time.monotonic() + 5  # killed with the group (SIGKILL lands asynchronously)
        while alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        other.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


@pytest.mark.skipif(not REAL_VLLM.exists() or not os.environ.get("FLEETLLM_TEST_VLLM"),
                    reason="needs `make peers` and FLEETLLM_TEST_VLLM=1 (minutes: vLLM loads)")
def test_real_vllm_generates_what_fleetllm_does(tmp_path, monkeypatch):
    """vLLM's CPU attention wants head_dim 32 or more: a shrunk llama-1b with 64."""
    monkeypatch.delenv("FLEETLLM_VLLM_PYTHON", raising=False)
    model = shrunk("llama-1b", tmp_path / "llama", head_dim=64)
    figures = run(["bench", "throughput", "--model", str(model), "--load-format", "dummy",
                   "--compare", "vllm", "--vllm-configs", "eager:cores", "--num-prompts", "4",
                   "--input-len", "8:24", "--output-len", "4", "--repeat", "1",
                   "--no-roofline", *KV])
    assert figures["vllm"]["identical_outputs"] == 4


def test_bench_serve_compares_with_a_vllm_server_on_the_same_requests(tiny_models, tmp_path,
                                                                      monkeypatch):
    """--compare vllm starts the peer server from the peer venv with the flags both servers
    share, sends it the same requests and prints the ratios (a fake vLLM here);
    --offline-replay also runs fleetllm's requests through an in-process engine."""
    from fleetllm.benchmarks import serve

    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} "
                    f"{TESTS / 'fake_vllm_server.py'} \"$@\"\n")
    fake.chmod(0o755)
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FLEETLLM_VLLM_PYTHON", str(fake))
    monkeypatch.setenv("FAKE_VLLM_ARGV", str(argv_file))
    monkeypatch.setenv("FAKE_VLLM_KV", KV[1])
    model = str(tiny_models["llama_gqa"])
    result = serve.main(["--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                         "--compare", "vllm", "--offline-replay", model, *KV,
                         "--no-enable-prefix-caching", "--dtype", "float32"])
    for r in (result["fleetllm"], result["vllm"], result["fleetllm"]["offline_replay"]):
        assert r["completed"] == 4 and r["total_output_tokens"] == 16, r
        assert r["mean_tpot_ms"] > 0 and r["mean_ttft_ms"] > 0
    assert result["ratios"]["mean_tpot_ms"] == pytest.approx(
        result["fleetllm"]["mean_tpot_ms"] / result["vllm"]["mean_tpot_ms"])
    overhead = result["fleetllm"]["serving_overhead"]
    assert set(overhead) == {"tpot", "itl", "ttft"} and overhead["tpot"] > -1
    argv = json.loads(argv_file.read_text())
    assert argv[argv.index("--model") + 1] == model
    assert "--no-enable-prefix-caching" in argv and argv[argv.index("--dtype") + 1] == "float32"
    assert "--kv-cache-memory" not in argv  # fleetllm's own flags stay fleetllm's
