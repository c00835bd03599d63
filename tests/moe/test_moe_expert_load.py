"""Expert-load metrics: the (token, expert) pairs each MoE layer's router picked, counted on
the workers (model/moe_load.py) and summed by the engine (engine/expert_load.py), against
transformers' own router on the same tokens; counted once under TP+EP and across pipeline
stages on mp; the /metrics gauge (also over the engine core's wire) and the bench line."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
import torch
from helpers import load_hf
from test_moe_models import moe_models  # noqa: F401 - the fixture

from fleetllm import LLM, SamplingParams
from fleetllm.cli import build_parser
from fleetllm.engine import core_wire
from fleetllm.engine.expert_load import imbalance
from fleetllm.engine.stats import EngineLoad
from fleetllm.entrypoints.openai.metrics import PrometheusMetrics
from fleetllm.model import moe_experts

MAX_TOKENS = 6
TOP_K = 2  # tests/moe/moe_checkpoints.py: top-2 routing


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30)]


def _generate(path, **kwargs) -> tuple[list[list[int]], dict[int, list[int]], EngineLoad]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, kv_cache_memory=16 << 20, enable_prefix_caching=False, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.expert_load(), \
            EngineLoad.of(llm.llm_engine)


def _hf_counts(path, sequences: list[list[int]]) -> dict[int, list[int]]:
    """transformers' routing of every token our engine ran (each prompt and all its output
    tokens but the last, which no step feeds back): top-k ids of each sparse layer's router."""
    hf = load_hf(path)
    counts: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def hook(module, args, out, i=i):
            ids = out[2] if isinstance(out, tuple) else out.topk(TOP_K, dim=-1).indices
            num = hf.config.num_experts
            counts[i] = counts.get(i, torch.zeros(num, dtype=torch.int64)) + torch.bincount(
                ids.reshape(-1), minlength=num)
        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        for seq in sequences:
            hf(torch.tensor([seq]))
    for h in hooks:
        h.remove()
    return {i: c.tolist() for i, c in sorted(counts.items())}


@pytest.mark.parametrize("kernel", ["chosen", "pytorch"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_counts_are_transformers_routing(moe_models, name, kernel, monkeypatch):  # noqa: F811
    """qwen3_moe's layer 1 is dense (no entry); the C++ op's path and PyTorch's count alike;
    the profile run's dummy tokens are not counted; EngineLoad (what /metrics renders)
    carries each layer's max/mean."""
    if kernel == "pytorch":
        monkeypatch.setattr(moe_experts.FusedExperts, "choose_kernel",
                            lambda self: setattr(self, "kernel", moe_experts.torch_experts))
    tokens, counts, load = _generate(moe_models[name])
    seqs = [p + t[:-1] for p, t in zip(_prompts(), tokens, strict=True)]
    assert counts == _hf_counts(moe_models[name], seqs)
    assert all(sum(c) == TOP_K * sum(map(len, seqs)) for c in counts.values())
    assert load.moe_expert_imbalance == {str(k): v for k, v in imbalance(counts).items()}


def test_counted_once_under_expert_parallel_and_pipeline_stages(moe_models):  # noqa: F811
    """TP=2+EP: both ranks route every token, only one reports; PP=2: layers 0 and 2 are on
    different stages, both reported. Totals as one process counts them."""
    want_tokens, want, _ = _generate(moe_models["qwen3_moe"])
    total = sum(next(iter(want.values())))
    for layout in (dict(tensor_parallel_size=2, enable_expert_parallel=True),
                   dict(pipeline_parallel_size=2)):
        _, counts, _ = _generate(moe_models["qwen3_moe"], distributed_executor_backend="mp",
                                 **layout)
        assert sorted(counts) == sorted(want) == [0, 2], layout
        assert all(sum(c) == total for c in counts.values()), layout


def test_dense_model_has_no_expert_load():
    from fleetllm.engine.arg_utils import DEMO_MODEL

    with LLM(str(DEMO_MODEL), kv_cache_memory=16 << 20) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                     SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert llm.llm_engine.expert_load() == {}
        assert EngineLoad.of(llm.llm_engine).moe_expert_imbalance == {}


def test_metrics_gauge_a_layer_and_over_the_core_wire():
    load = EngineLoad(moe_expert_imbalance={"0": 1.5, "2": 3.25})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(core_wire.load_msg(load)))
    assert EngineLoad(*decoded) == load  # the engine core process's snapshot, as sent
    text = PrometheusMetrics("m").render(EngineLoad(*decoded)).decode()
    assert 'fleetllm:moe_expert_load_imbalance{layer="0",model_name="m"} 1.5' in text
    assert 'fleetllm:moe_expert_load_imbalance{layer="2",model_name="m"} 3.25' in text


def test_bench_latency_prints_the_imbalance(moe_models, tmp_path, capsys):  # noqa: F811
    """Warm-up (output 6 <= 8) and one round: 2 x (16 + 5) tokens each, k=2 pairs a token."""
    out = tmp_path / "figures.json"
    args = build_parser().parse_args([
        "bench", "latency", "--model", str(moe_models["qwen3_moe"]), "--batch-size", "2",
        "--input-len", "16", "--output-len", "6", "--repeat", "1", "--compare", "none",
        "--kv-cache-memory", "33554432", "--json", str(out)])
    figures = args.run(args)
    load = figures["expert_load"]
    assert sorted(load["tokens"]) == [0, 2]
    assert all(sum(c) == 2 * 2 * 2 * (16 + 5) for c in load["tokens"].values())
    assert json.loads(out.read_text())["expert_load"]["imbalance"].keys() == {"0", "2"}
    assert "expert load imbalance (max/mean tokens per expert): mean" in capsys.readouterr().out


def test_server_metrics_of_a_moe_model_under_expert_parallel(moe_models):  # noqa: F811
    """`fleetllm serve --tensor-parallel-size 2 --enable-expert-parallel` (the engine core in
    its own process, mp workers): after a request, /metrics has a gauge per MoE layer."""
    import time

    import httpx
    from serving_helpers import metric_values, server_env, serving

    from fleetllm.entrypoints.openai.local_server import LocalServer

    srv = LocalServer([str(moe_models["qwen3_moe"]), "--kv-cache-memory", str(32 << 20),
                       "--served-model-name", "moe", "--tensor-parallel-size", "2",
                       "--enable-expert-parallel"], env=server_env())
    with serving(srv):
        reply = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "moe", "prompt": list(range(10, 30)), "max_tokens": 4,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30
        while True:  # the snapshot is the engine's after a step: the last one may be in flight
            values = metric_values(httpx.get(f"{srv.url}/metrics", timeout=10).text)
            ratios = {dict(labels)["layer"]: value for (name, labels), value in values.items()
                      if name == "fleetllm:moe_expert_load_imbalance"}
            if set(ratios) == {"0", "2"} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert set(ratios) == {"0", "2"}
    assert all(1.0 <= r <= 8.0 for r in ratios.values()), ratios


def test_bench_throughput_prints_the_imbalance(moe_models, capsys):  # noqa: F811
    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(moe_models["qwen2_moe"]), "--num-prompts", "3",
        "--input-len", "8", "--output-len", "3", "--repeat", "1", "--compare", "none",
        "--no-roofline", "--kv-cache-memory", "33554432"])
    figures = args.run(args)
    assert sorted(figures["expert_load"]["imbalance"]) == [0, 1]
    assert "expert load imbalance (max/mean tokens per expert): mean" in capsys.readouterr().out
