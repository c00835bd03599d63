"""The benchmarks' model presets and their dummy weights written as a checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fleetllm import LLM, SamplingParams
from fleetllm.benchmarks import workload
from fleetllm.benchmarks.checkpoint import write_dummy_checkpoint
from fleetllm.benchmarks.hf_peers import HFGenerate, load_hf_model
from fleetllm.benchmarks.presets import PRESETS
from fleetllm.config import ArchConfig
from fleetllm.model.loader import dummy_tensor, hf_tensor_shapes


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
                      "llama-1b": 1_235_814_400}  # Qwen2-0.5B's and Llama-3.2-1B's counts
    qwen, llama = (ArchConfig.from_dict(PRESETS[n]) for n in ("qwen2-0.5b", "llama-1b"))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.sliding_window is None and qwen.rope_theta == 1e6
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.tie_word_embeddings
    assert qwen.torch_dtype == llama.torch_dtype == "bfloat16"
    assert PRESETS["llama-125m"]["torch_dtype"] == "float32"


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
