"""`bench throughput --lora N` (issue #22): the random adapters it writes are PEFT adapters
(PEFT 0.21 loads every tensor of them and they change the model's outputs), and the benchmark
runs base-only and round-robin over N adapters and prints the ratio."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fleetllm.benchmarks.lora import make_adapters, module_shapes
from fleetllm.cli import build_parser

KV = ["--kv-cache-memory", "33554432"]


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"),
                                     ("gate_proj", "up_proj", "down_proj", "v_proj")])
def test_adapters_are_what_peft_loads_and_they_change_outputs(tiny_models, tmp_path, targets):
    import transformers
    from peft import PeftModel

    model_dir = tiny_models["llama_gqa"]
    paths = make_adapters(model_dir, tmp_path, 2, rank=4, targets=targets, seed=3)
    assert [p.name for p in paths] == ["adapter-0", "adapter-1"]
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[1, 5, 9, 200, 37, 11]])
    with torch.no_grad():
        base_logits = base(ids).logits
    config = json.loads((model_dir / "config.json").read_text())
    shapes = module_shapes(config)
    logits = []
    for path in paths:
        saved = load_file(path / "adapter_model.safetensors")
        assert len(saved) == 2 * len(targets) * config["num_hidden_layers"]
        model = PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir), path).eval()
        loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
        # Every tensor of the file is in the model (PEFT inserts the adapter name).
        assert len(loaded) == len(saved)
        for name, tensor in saved.items():
            key = name.replace(".weight", ".default.weight")
            assert torch.equal(loaded[key].detach(), tensor), name
            module = name.split(".")[-3]
            fan_in, fan_out = shapes[module]
            assert tensor.shape == ((4, fan_in) if "lora_A" in name else (fan_out, 4))
        assert model.peft_config["default"].r == 4
        assert sorted(model.peft_config["default"].target_modules) == sorted(targets)
        with torch.no_grad():
            logits.append(model(ids).logits)
    for out in logits:
        assert (out - base_logits).abs().max() > 1e-2  # B is not zero: the adapter matters
    assert (logits[0] - logits[1]).abs().max() > 1e-2  # and each adapter is its own


def test_make_adapters_refuses_unknown_targets(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="lm_head"):
        make_adapters(tiny_models["llama_gqa"], tmp_path, 1, targets=("lm_head",))


def test_bench_throughput_lora_prints_the_ratio_to_base_only(tiny_models, capsys):
    """Needs lora-core's engine (LLM.generate(lora_request=[...]))."""
    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(tiny_models["llama_gqa"]), "--lora", "2",
        "--lora-rank", "8", "--num-prompts", "6", "--input-len", "8", "--output-len", "5",
        "--repeat", "1", *KV])
    figures = args.run(args)
    lora = figures["lora"]
    assert lora["adapters"] == 2 and lora["rank"] == 8
    assert lora["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora["throughput_ratio"] > 0
    assert lora["outputs_differing_from_base"] >= 1  # the adapters were applied
    assert "fleetllm (2 LoRA r=8)" in figures["engines"]
    assert "HF generate" not in figures["engines"]  # no peers by default with --lora
    out = capsys.readouterr().out
    assert "LoRA adapters (r=8, q_proj,k_proj,v_proj,o_proj) / base-only" in out
