"""`fleetllm bench throughput|latency --model DIR --compare vllm` on AWQ, GPTQ and
compressed-tensors checkpoints (fleetllm.quant.hf_export writes them): both engines load the
same directory in the same activation dtype, the header names the format, the latency bound
counts the weights as stored, and what vLLM's CPU kernels cannot run fails before any vLLM
process starts. Against the fake runner (CI has no .venv-vllm); the real one where `make peers`
made it and FLEETLLM_TEST_VLLM=1."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fleetllm.benchmarks import vllm_peer, workload
from fleetllm.benchmarks.checkpoint import write_dummy_checkpoint
from fleetllm.benchmarks.presets import PRESETS
from fleetllm.cli import build_parser
from fleetllm.quant.hf_export import export_quantized

KV = ["--kv-cache-memory", "33554432"]
TESTS = Path(__file__).resolve().parents[1]
FAKE_RUNNER = TESTS / "fake_vllm_runner.py"
REAL_VLLM = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# Shrunk llama-1b (tied embeddings): head_dim 64 (vLLM's CPU attention wants 32 or more),
# every projection's input a multiple of 128 (the exports' group size).
SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
FORMATS = {"awq": ("AWQ", {}), "gptq": ("GPTQ", {}), "w4a16": ("W4A16", {}),
           "w8a8": ("W8A8", {}), "gptq-asym": ("GPTQ", {"sym": False})}
LABELS = {"awq": "AWQ 4-bit, group 128", "gptq": "GPTQ 4-bit, group 128, sym",
          "w4a16": "W4A16 (compressed-tensors pack-quantized, group 128)",
          "w8a8": "W8A8 (compressed-tensors int-quantized, channel)",
          "gptq-asym": "GPTQ 4-bit, group 128, asym"}


def run(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return args.run(args)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """A bfloat16 checkpoint (the preset dummy weights, as `fleetllm quantize --preset` makes
    them) and its exports, by name."""
    root = tmp_path_factory.mktemp("vllm-quant")
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(
        {**PRESETS["llama-1b"], **SIZES, "torch_dtype": "bfloat16"}))
    src = write_dummy_checkpoint(root / "cfg", root / "bf16", 0, torch.bfloat16)
    out = {"bf16": src}
    for name, (fmt, kw) in FORMATS.items():
        out[name] = export_quantized(src, root / name, fmt, group_size=128, **kw)
    return out


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The driver pointed at the fake runner, run by this interpreter; returns its log."""
    log = tmp_path / "runner.jsonl"
    monkeypatch.setenv("FLEETLLM_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_RUNNER_LOG", str(log))
    monkeypatch.setattr(vllm_peer, "RUNNER", FAKE_RUNNER)
    return log


def _loads(log: Path) -> list[dict]:
    return [e["msg"] for e in map(json.loads, log.read_text().splitlines())
            if e["msg"]["op"] == "load"]


def test_format_labels_and_stored_weight_bytes(quantized):
    for name, label in LABELS.items():
        assert workload.hf_quant_label(workload.hf_quantization(str(quantized[name]))) == label
    assert workload.hf_quantization(str(quantized["bf16"])) is None
    assert [workload.hf_quant_name(workload.hf_quantization(str(quantized[n])))
            for n in ("awq", "gptq", "w4a16", "w8a8")] == ["AWQ", "GPTQ", "W4A16", "W8A8"]
    with safe_open(str(quantized["awq"] / "model.safetensors"), framework="pt") as f:
        stored = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size()
                     for n in f.keys())  # tied embeddings: the table is the LM head, once
    assert workload.hf_weight_bytes(str(quantized["awq"])) == stored
    assert stored < workload.weight_bytes(
        vllm_arch(quantized["awq"]), 2) * 0.4  # 4-bit projections, bf16 embedding


def vllm_arch(model: Path):
    from fleetllm.config import ArchConfig

    return ArchConfig.from_dict(json.loads((model / "config.json").read_text()))


def test_throughput_runs_vllm_on_the_same_quantized_files(fake_vllm, quantized, capsys):
    model = str(quantized["awq"])
    figures = run(["bench", "throughput", "--model", model, "--compare", "vllm",
                   "--vllm-configs", "eager:cores", "--num-prompts", "3", "--input-len", "8",
                   "--output-len", "3", "--repeat", "1", "--no-roofline", *KV])
    [load] = _loads(fake_vllm)
    assert load["model"] == model and load["dtype"] == "bfloat16"  # the files themselves
    assert figures["dtype"] == "bfloat16" and figures["quantization"] == LABELS["awq"]
    assert f"model: {model} (AWQ 4-bit, group 128, activations bfloat16)" in \
        capsys.readouterr().out
    assert figures["vllm"]["best"].startswith("vLLM (eager, bind 0")


def test_latency_runs_vllm_on_the_same_quantized_files(fake_vllm, quantized, capsys):
    model = str(quantized["w8a8"])
    figures = run(["bench", "latency", "--model", model, "--compare", "vllm",
                   "--vllm-configs", "compiled:auto", "--batch-size", "1", "--input-len", "8",
                   "--output-len", "4", "--repeat", "1", *KV])
    [load] = _loads(fake_vllm)
    assert load["model"] == model and load["dtype"] == "bfloat16"
    assert figures["quantization"] == LABELS["w8a8"]
    assert figures["dtype"] == f"{LABELS['w8a8']}, activations bfloat16"
    kv = 1 * (8 + 4 / 2) * workload.kv_bytes_per_token(vllm_arch(quantized["w8a8"]), 2)
    assert figures["decode_step_bytes"] == pytest.approx(workload.hf_weight_bytes(model) + kv)
    out = capsys.readouterr().out
    assert f"({LABELS['w8a8']}, activations bfloat16)" in out and "vLLM best" in out


def test_a_dtype_vllm_cannot_run_fails_before_vllm_starts(fake_vllm, quantized):
    """fleetllm runs a float16 checkpoint in float32 on the CPU; vLLM's CPU kernels run
    quantized checkpoints in bfloat16 or float16 (W8A8: bfloat16 only)."""
    with pytest.raises(vllm_peer.VLLMPeerError, match="pass --dtype bfloat16"):
        run(["bench", "throughput", "--model", str(quantized["gptq"]), "--dtype", "float32",
             "--compare", "vllm", "--vllm-configs", "eager:auto", "--num-prompts", "2",
             "--input-len", "8", "--output-len", "2", "--repeat", "1", "--no-roofline", *KV])
    assert not fake_vllm.exists()  # no runner was started
    vllm_peer.check_quantized_dtype(str(quantized["awq"]), torch.float16)
    vllm_peer.check_quantized_dtype(str(quantized["bf16"]), torch.float32)  # not quantized
    with pytest.raises(vllm_peer.VLLMPeerError, match="runs W8A8 checkpoints in bfloat16,"):
        vllm_peer.check_quantized_dtype(str(quantized["w8a8"]), torch.float16)


def test_dummy_weights_of_a_quantized_checkpoint_are_refused(fake_vllm, quantized):
    with pytest.raises(vllm_peer.VLLMPeerError, match="drop --load-format dummy"):
        vllm_peer.VLLMPeers(vllm_peer.parse_configs("eager:auto", 1), str(quantized["awq"]),
                            0, torch.bfloat16, 16)
    assert not fake_vllm.exists()


def test_runner_reports_vllm_config_errors_on_one_line():
    """The CLI prints an error's first line: pydantic's reason is on its second."""
    spec = importlib.util.spec_from_file_location("vllm_runner", vllm_peer.RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    e = ValueError("1 validation error for VllmConfig\n  Value error, Unsupported quantization "
                   "config: bits=4, sym=False [type=value_error, input_value=ArgsKwargs((), "
                   "{...}), input_type=ArgsKwargs]\n    For further information visit "
                   "https://errors.pydantic.dev/2.14/v/value_error")
    assert runner._one_line(e) == ("1 validation error for VllmConfig: Value error, "
                                   "Unsupported quantization config: bits=4, sym=False")


@pytest.mark.skipif(not REAL_VLLM.exists() or not os.environ.get("FLEETLLM_TEST_VLLM"),
                    reason="needs `make peers` and FLEETLLM_TEST_VLLM=1 (minutes: vLLM loads)")
@pytest.mark.parametrize("name", ["awq", "gptq", "w8a8"])
def test_real_vllm_runs_the_quantized_checkpoint(name, quantized, monkeypatch):
    """vLLM CPU 0.32 loads AWQ, symmetric GPTQ and W8A8 (not asymmetric GPTQ, desc_act, 8-bit
    GPTQ: docs/quantization.md); the same dummy weights give the same greedy tokens here."""
    monkeypatch.delenv("FLEETLLM_VLLM_PYTHON", raising=False)
    figures = run(["bench", "throughput", "--model", str(quantized[name]), "--compare", "vllm",
                   "--vllm-configs", "eager:cores", "--num-prompts", "4", "--input-len",
                   "8:24", "--output-len", "4", "--repeat", "1", "--no-roofline", *KV])
    assert figures["quantization"] == LABELS[name]
    assert figures["vllm"]["identical_outputs"] >= 3


@pytest.mark.skipif(not REAL_VLLM.exists() or not os.environ.get("FLEETLLM_TEST_VLLM"),
                    reason="needs `make peers` and FLEETLLM_TEST_VLLM=1 (minutes: vLLM loads)")
def test_real_vllm_refusal_is_one_line(quantized, monkeypatch):
    monkeypatch.delenv("FLEETLLM_VLLM_PYTHON", raising=False)
    with pytest.raises(vllm_peer.VLLMPeerError,
                       match="Unsupported quantization config: bits=4, sym=False$"):
        vllm_peer.VLLMPeers(vllm_peer.parse_configs("eager:auto", 1),
                            str(quantized["gptq-asym"]), None, torch.bfloat16, 32)
