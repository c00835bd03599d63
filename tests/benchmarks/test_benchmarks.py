"""The performance benchmarks run end to end on a tiny model (the figures themselves are the
lead's to measure on a quiet machine): same outputs as their transformers peers, the
roofline, the shared-prefix mode and the latency split are computed and written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetllm.benchmarks import workload
from fleetllm.cli import build_parser
from fleetllm.config import ArchConfig
from fleetllm.errors import ConfigurationError

KV = ["--kv-cache-memory", "33554432"]


def run(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return args.run(args)


def test_throughput_with_a_dataset_peers_and_roofline(tiny_models, tmp_path, capsys):
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(5, 5 + n)),
                                          "output_len": 3 + n % 4}) for n in (4, 9, 20)))
    out = tmp_path / "figures.json"
    figures = run(["bench", "throughput", "--model", str(tiny_models["llama_gqa"]),
                   "--dataset", str(data), "--compare", "hf", "--hf-batch-size", "2",
                   "--repeat", "1", "--json", str(out), *KV])
    assert json.loads(out.read_text()) == json.loads(json.dumps(figures))
    assert figures["requests"] == 3 and figures["output_tokens"] == 3 + 4 + 3
    assert figures["ratios"]["HF generate"]["identical_outputs"] == 3
    for kind in ("dense", "best"):
        assert 0 < figures["roofline"][kind]["fraction"]
    text = capsys.readouterr().out
    assert "ratio fleetllm / HF" in text and "roofline (float32 torch matmul)" in text


def test_shared_prefix_mode_compares_caching_on_and_off(tiny_models):
    figures = run(["bench", "throughput", "--model", str(tiny_models["llama_gqa"]),
                   "--shared-prefix", "100", "--num-prompts", "6", "--input-len", "8",
                   "--output-len", "4", "--compare", "none", "--repeat", "1",
                   "--no-roofline", *KV])
    shared = figures["shared_prefix"]
    assert shared["identical_outputs"] == 6
    assert shared["mean_ttft_s"] > 0 and shared["mean_ttft_no_caching_s"] > 0


def test_latency_reports_ttft_tpot_bound_and_step_split(tiny_models, capsys):
    figures = run(["bench", "latency", "--model", str(tiny_models["llama_gqa"]),
                   "--batch-size", "2", "--input-len", "16", "--output-len", "6",
                   "--repeat", "1", *KV])
    ours = figures["engines"]["fleetllm"]
    assert ours["decode_tokens_per_s"] > 0 and ours["tpot_p50_s"] <= ours["tpot_p99_s"]
    split = ours["decode_step"]
    assert split["steps"] == 5 and 0 <= split["other_fraction"] < 1
    assert figures["bandwidth_bound_tokens_per_s"] > 0 and "ratio_decode_vs_hf" in figures
    assert "memory-bandwidth bound" in capsys.readouterr().out


def test_workload_flops_count_every_token_once():
    a = ArchConfig.from_dict({"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8,
                              "num_hidden_layers": 2, "num_attention_heads": 2,
                              "num_key_value_heads": 1})
    lin = 2 * workload.linear_params(a)
    assert workload.linear_params(a) == 2 * (4 * 4 * 2 + 4 * 4 + 3 * 4 * 8)
    f = workload.workload_flops(a, [workload.Request([1, 2, 3], 2)])
    attn = 4 * 2 * 2 * 2  # 4 * heads * head_dim * layers per (token, visible key)
    assert f.prefill == lin * 3 + attn * (1 + 2 + 3)
    assert f.decode == lin * 1 + attn * 4  # the first sampled token, fed at position 3
    assert f.lm_head == 2 * 10 * 4 * 2


def test_throughput_task_embed_against_hf_automodel(tiny_models, tmp_path, capsys):
    out = tmp_path / "figures.json"
    figures = run(["bench", "throughput", "--model", str(tiny_models["qwen2_bias"]),
                   "--task", "embed", "--num-prompts", "10", "--input-len", "3:40",
                   "--hf-batch-size", "4", "--hf-sort", "--repeat", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(figures))
    assert figures["task"] == "embed" and figures["inputs"] == 10
    assert figures["pooling_type"] == "LAST" and figures["normalize"] is True
    assert 10 * 3 <= figures["input_tokens"] <= 10 * 40
    for name in ("fleetllm", "HF AutoModel", "HF AutoModel (sorted)"):
        f = figures["engines"][name]
        assert f["sequences_per_s"] == 10 / f["seconds"]
        assert f["tokens_per_s"] == figures["input_tokens"] / f["seconds"]
    for name in ("HF AutoModel", "HF AutoModel (sorted)"):  # same vectors, any padding
        ratio = figures["ratios"][name]
        assert ratio["cosine_min"] >= 0.99999 and ratio["speedup"] > 0
    text = capsys.readouterr().out
    assert "sequences/s" in text and "ratio fleetllm / HF AutoModel: " in text
    assert "inputs: cosine min 0.99999" in text or "cosine min 1.000000" in text


def test_throughput_embed_pools_as_the_engine_does_on_dummy_weights(tiny_models, capsys):
    # MEAN without normalizing, dummy weights handed to AutoModel: a mismatch in either the
    # peer's pooling or its weights would show in the cosine.
    figures = run(["bench", "throughput", "--model", str(tiny_models["llama_gqa"]),
                   "--task", "embed", "--load-format", "dummy", "--override-pooler-config",
                   '{"pooling_type": "MEAN", "normalize": false}', "--num-prompts", "5",
                   "--input-len", "2:30", "--hf-batch-size", "3", "--repeat", "1"])
    assert (figures["pooling_type"], figures["normalize"]) == ("MEAN", False)
    ratio = figures["ratios"]["HF AutoModel"]
    assert ratio["cosine_min"] >= 0.99999 and ratio["max_relative_difference"] < 1e-4
    assert "MEAN pooling" in capsys.readouterr().out


def test_throughput_runs_an_embedding_checkpoint_as_embed_without_the_flag(tiny_models,
                                                                            tmp_path):
    config = json.loads((tiny_models["llama_gqa"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config,
                                                      "architectures": ["LlamaModel"]}))
    figures = run(["bench", "throughput", "--model", str(tmp_path), "--load-format", "dummy",
                   "--num-prompts", "3", "--input-len", "4:9", "--hf-batch-size", "2",
                   "--repeat", "1"])
    assert figures["task"] == "embed"
    assert figures["ratios"]["HF AutoModel"]["cosine_min"] >= 0.99999


def test_throughput_embed_refuses_generation_options(tiny_models):
    base = ["bench", "throughput", "--model", str(tiny_models["llama_gqa"]), "--task", "embed"]
    for extra, message in ((["--compare", "hf,vllm"], "--compare vllm: generation peers"),
                           (["--compare", "hf-cb"], "--compare hf-cb: generation peers"),
                           (["--output-len", "8"], "--output-len applies to generation"),
                           (["--shared-prefix", "16"], "--shared-prefix applies to generation")):
        with pytest.raises(ConfigurationError, match=message):
            run([*base, *extra])


def test_op_profile_tool_prints_the_workloads_ops(tiny_models, monkeypatch, capsys):
    """tools/op_profile.py (per-op figures): the workload's requests through
    LLM.generate under torch's profiler, one row per op, the projections among them."""
    from helpers import load_tool

    tool = load_tool("op_profile")
    monkeypatch.setattr("sys.argv", ["op_profile", "--model", str(tiny_models["llama_gqa"]),
                                     "--num-prompts", "2", "--dtype", "float32", "--rows", "40",
                                     "--kv-cache-memory", "33554432"])
    tool.main()
    out = capsys.readouterr().out
    assert "unprofiled round:" in out and "profiled round:" in out
    assert "Self CPU" in out and ("mkldnn::_linear_pointwise" in out or "aten::" in out)


def test_fp32_gemm_ab_tool_times_both_packings_on_the_same_product(capsys):
    """tools/fp32_gemm_ab.py: oneDNN's and MKL's packed
    float32 GEMMs on the 125M shapes, checked to give the same product, one line per row count
    with both rates per shape and the ratio of the totals."""
    import torch
    from helpers import load_tool

    tool = load_tool("fp32_gemm_ab")
    if not torch.backends.mkl.is_available() or tool._mkl() is None:
        pytest.skip("this torch exports no MKL packed sgemm")
    threads = torch.get_num_threads()  # the tool sets it; keep this process's
    tool.main(["--rows", "4,70", "--rounds", "1", "--reps", "1", "--threads", str(threads)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rows 4", "rows 70"], lines
    for line in lines:  # " / " in the header, each of the 5 shapes and the ratio
        assert line.count(" / ") == 7 and float(line.rsplit(" ", 1)[1]) > 0, line


def test_host_ab_tool_swaps_functions_step_by_step_and_times_both(tiny_models, capsys):
    """tools/host_ab.py: a function of a git revision against the
    working tree's, swapped step by step in one process; both medians printed."""
    import shutil
    import subprocess

    from helpers import load_tool

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    from fleetllm.kernels import cpu_kernels
    from fleetllm.worker import sampler

    tool = load_tool("host_ab")
    before = (sampler.sample, cpu_kernels.decoder_layers, cpu_kernels.gemm_pairs)
    for extra in ([], ["--forward-python"]):
        tool.main(["--model", str(tiny_models["llama_gqa"]), "--rounds", "1",
                   "--stream-mib", "4", *extra, "fleetllm.worker.sampler:sample"])
        out = capsys.readouterr().out
        assert "median of 63 steps each: HEAD " in out and "working tree " in out, out
        # the process's functions as they were: later tests run the working tree's
        assert (sampler.sample, cpu_kernels.decoder_layers, cpu_kernels.gemm_pairs) == before
