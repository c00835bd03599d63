"""GGUF writing: the numpy block quantizers (fleetllm.quant.blocks), the llama-quantize type
mixes (gguf_mix) and HF directory -> .gguf export (gguf_export), read back with transformers'
own GGUF loader (which dequantizes with the gguf package). Tiny random-weight models and the
bundled demo model; nothing is downloaded. The checks against llama.cpp's own build are
test_gguf_llamacpp's."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_helpers import (
    DEMO,
    MODELS,
    edit_config,
    load_gguf,
    load_reference,
    make_hf_models,
    rel_rms,
)

from fleetllm.cli import main as cli_main
from fleetllm.errors import ConfigurationError
from fleetllm.quant import blocks
from fleetllm.quant.gguf_export import export_gguf
from fleetllm.quant.gguf_mix import PRESETS, tensor_type, use_more_bits

T = gguf.GGMLQuantizationType
TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
         "  Hello,  world! ü 🦙 <|endoftext|> tabs\tand 12345", "import os\n\nclass A:\n\tpass"]
# relative RMS error of dequantize(quantize(x)) on N(0, 1) rows, measured (in the comments)
# with margin; Q8_0 .. Q5_1 are gguf's (ggml's reference) quantizers
ERROR_BOUND = {T.F32: 0.0, T.F16: 3e-4, T.BF16: 2e-3, T.Q8_0: 0.006,  # 0.54%
               T.Q6_K: 0.0195, T.Q5_K: 0.039, T.Q5_1: 0.041, T.Q5_0: 0.046,  # 1.79 3.63 3.79 4.27
               T.Q4_K: 0.078, T.Q4_1: 0.084, T.Q4_0: 0.092}  # 7.26 7.82 8.60


@pytest.mark.parametrize("qtype", sorted(blocks.SUPPORTED), ids=lambda t: t.name)
def test_round_trip_within_the_type_error(qtype):
    x = np.random.default_rng(0).standard_normal((64, 2048)).astype(np.float32)
    raw = blocks.quantize(x, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (64, 2048 // block * nbytes)
    y = blocks.dequantize(raw, qtype, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert rel_rms(y, x) <= ERROR_BOUND[qtype]
    zeros = np.zeros((2, 512), np.float32)
    assert not blocks.dequantize(blocks.quantize(zeros, qtype), qtype, zeros.shape).any()


def _representable(qtype: T, n: int, rng: np.random.Generator) -> np.ndarray:
    """Weights a K block holds exactly: random levels and scales, the first sub-block at the
    largest scale (and min) so that the super-block d (and dmin) come out the same."""
    d = rng.uniform(1e-3, 1e-2, (n, 1, 1)).astype(np.float16).astype(np.float32)
    if qtype == T.Q6_K:
        sc = rng.integers(-127, 128, (n, 16, 1)).astype(np.float32)
        sc[sc == 0], sc[:, 0] = 5, -128
        q = rng.integers(-32, 32, (n, 16, 16)).astype(np.float32)
        q[..., 0] = -32  # each sub-block's largest magnitude
        return ((d * sc) * q).reshape(n, 256)
    nmax = 15 if qtype == T.Q4_K else 31
    dmin = rng.uniform(1e-3, 1e-2, (n, 1, 1)).astype(np.float16).astype(np.float32)
    sc = rng.integers(1, 64, (n, 8, 1)).astype(np.float32)
    m = rng.integers(0, 64, (n, 8, 1)).astype(np.float32)
    sc[:, 0], m[:, 0] = 63, 63
    q = rng.integers(0, nmax + 1, (n, 8, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, nmax
    return ((d * sc) * q - dmin * m).reshape(n, 256)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quants_give_back_what_a_block_represents(qtype):
    x = _representable(qtype, 200, np.random.default_rng(1))
    y = blocks.dequantize(blocks.quantize(x, qtype), qtype, x.shape)
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-6 * np.abs(x).max())


def test_bad_block_arguments_are_configuration_errors():
    x = np.ones((2, 128), np.float32)
    with pytest.raises(ConfigurationError, match="Q4_K.*128 is not a multiple of 256"):
        blocks.quantize(x, T.Q4_K)
    with pytest.raises(ConfigurationError, match="not supported.*supported: BF16"):
        blocks.quantize(x, T.IQ4_NL)
    with pytest.raises(ConfigurationError, match="not supported"):
        blocks.quantize(x, "Q9_9")
    with pytest.raises(ConfigurationError, match="NaN or inf"):
        blocks.quantize(np.full((1, 32), np.nan, np.float32), "Q8_0")
    with pytest.raises(ConfigurationError, match="not a Q8_0 tensor of shape"):
        blocks.dequantize(np.zeros(30, np.uint8), T.Q8_0, (1, 32))


def test_mixes_follow_llama_quantize_rules():
    n = 8  # use_more_bits: layers 0, 3, 6, 7
    assert [i for i in range(n) if use_more_bits(i, n)] == [0, 3, 6, 7]

    def kind(name, k=256, preset="Q4_K_M", tied=False):
        return tensor_type(name, (512, k), preset, n, tied).name

    assert [kind(f"blk.{i}.attn_v.weight") for i in (0, 1, 3)] == ["Q6_K", "Q4_K", "Q6_K"]
    assert [kind(f"blk.{i}.ffn_down.weight", preset="Q5_K_M") for i in (5, 6)] == \
        ["Q5_K", "Q6_K"]
    assert [kind(f"blk.{i}.attn_v.weight", preset="Q4_K_S") for i in (3, 4)] == ["Q5_K", "Q4_K"]
    assert [kind(f"blk.{i}.ffn_down.weight", preset="Q4_K_S") for i in (0, 1)] == \
        ["Q5_K", "Q4_K"]
    assert kind("blk.1.attn_q.weight") == kind("token_embd.weight") == "Q4_K"
    assert kind("output.weight") == kind("token_embd.weight", tied=True) == "Q6_K"
    assert kind("output.weight", preset="Q4_0") == "Q6_K"
    assert kind("output.weight", preset="Q8_0") == kind("output.weight", 544, "Q4_0") == "Q8_0"
    assert [kind("blk.1.ffn_up.weight", 544, p) for p in ("Q4_K_S", "Q5_K_M", "Q6_K")] == \
        ["Q5_0", "Q5_1", "Q8_0"]
    assert kind("blk.1.ffn_down.weight", 688) == kind("output.weight", 688) == "F16"
    assert kind("blk.1.ffn_up.weight", 688, "BF16") == "BF16"
    assert tensor_type("blk.0.attn_norm.weight", (256,), "Q8_0", n, False) == T.F32
    assert tensor_type("blk.0.attn_q.bias", (256,), "F16", n, False) == T.F32
    with pytest.raises(ConfigurationError, match="unknown GGUF quantization type 'Q3_K_M'"):
        tensor_type("output.weight", (4, 256), "Q3_K_M", n, False)


# -- export, read back by transformers --------------------------------------------------

@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    return make_hf_models(tmp_path_factory.mktemp("hf"))


def _greedy(model: transformers.PreTrainedModel, ids: torch.Tensor) -> list[int]:
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", list(MODELS))
def test_f32_export_reads_back_exactly(hf_models, tmp_path, name):
    hf_dir = hf_models[name]
    path = export_gguf(hf_dir, tmp_path / f"{name}.gguf", "F32", progress=False)
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary left
    ref, got = load_reference(hf_dir), load_gguf(path)
    want = ref.state_dict()
    tied = bool(ref.config.tie_word_embeddings)
    assert ("lm_head.weight" in dict(got.named_parameters())) is not tied
    for key, value in got.state_dict().items():
        assert torch.equal(value, want[key]), key  # q/k permuted and back
    c, rc = got.config, ref.config
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "hidden_size", "intermediate_size", "vocab_size", "rms_norm_eps",
                  "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(c, field) == pytest.approx(getattr(rc, field)), field
    assert c.rope_parameters["rope_theta"] == rc.rope_parameters["rope_theta"]
    ids = torch.tensor([[5, 99, 1234, 7, 42, 3000]])
    assert _greedy(got, ids) == _greedy(ref, ids)
    want_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tok(text).input_ids == want_tok(text).input_ids
        assert tok.decode(tok(text).input_ids) == text
    fields = gguf.GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    assert arch == {"mistral": "llama"}.get(name, name)
    assert (f"{arch}.attention.sliding_window" in fields) is (name == "mistral")
    assert fields["tokenizer.ggml.pre"].contents() == ("qwen2" if "qwen" in name else "gpt-2")
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_q8_0_export_is_within_the_block_error(hf_models, tmp_path, name):
    hf_dir = hf_models[name]
    path = export_gguf(hf_dir, tmp_path / f"{name}.gguf", "Q8_0", progress=False)
    ref, got = load_reference(hf_dir), load_gguf(path)
    want = ref.state_dict()
    for key, value in got.state_dict().items():
        bound = 0.0 if value.ndim == 1 else 0.006
        assert rel_rms(value.numpy(), want[key].numpy()) <= bound, key
    ids = torch.tensor([[5, 99, 1234, 7, 42, 3000, 17, 256]])
    with torch.no_grad():
        a, b = ref(ids).logits, got(ids).logits
    err = ((a - b).norm() / a.norm()).item()
    assert err <= 0.04  # measured 2.4% (llama), random weights amplify


def test_demo_model_exports_and_reads_back(tmp_path):
    ref = load_reference(DEMO)
    want_tok = transformers.AutoTokenizer.from_pretrained(DEMO)
    ids = want_tok(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        want = ref(ids).logits
    for preset, bound in (("Q8_0", 0.015), ("Q4_K_M", 0.15)):  # measured 1.0%, 10.9%
        path = export_gguf(DEMO, tmp_path / f"demo-{preset}.gguf", preset, progress=False)
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        assert "output.weight" not in types  # tied
        assert types["blk.0.ffn_down.weight"] == "F16"  # 688 is no multiple of 32
        if preset == "Q4_K_M":
            assert types["token_embd.weight"] == "Q6_K"
            assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == \
                ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
        got = load_gguf(path)
        with torch.no_grad():
            logits = got(ids).logits
        err = ((logits - want).norm() / want.norm()).item()
        assert err <= bound, (preset, err)
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
        assert [tok(t).input_ids for t in TEXTS] == [want_tok(t).input_ids for t in TEXTS]


@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
         rope_theta=10000.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=16, rope_theta=100.0),
], ids=lambda r: r["rope_type"])
def test_rope_scaling_is_written_as_convert_hf_to_gguf_does(hf_models, tmp_path, rope):
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_models["llama"], hf_dir)
    edit_config(hf_dir, rope_parameters=rope, rope_scaling=None)
    reader = gguf.GGUFReader(export_gguf(hf_dir, tmp_path / "r.gguf", "F16", progress=False))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.rope")}
    assert fields["llama.rope.freq_base"] == rope["rope_theta"]
    tensors = {t.name: t for t in reader.tensors}
    if rope["rope_type"] == "llama3":
        assert "llama.rope.scaling.type" not in fields
        from transformers.modeling_rope_utils import _compute_llama3_parameters

        # llama.cpp divides each rope frequency by its factor: transformers' llama3 frequencies
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        scaled, _ = _compute_llama3_parameters(config)
        base = 1.0 / (100.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        np.testing.assert_allclose(tensors["rope_freqs.weight"].data, base / scaled, rtol=1e-5)
        return
    assert "rope_freqs.weight" not in tensors
    assert fields["llama.rope.scaling.type"] == rope["rope_type"]
    assert fields["llama.rope.scaling.factor"] == rope["factor"]
    if rope["rope_type"] == "yarn":
        assert fields["llama.rope.scaling.original_context_length"] == 128
        assert fields["llama.rope.scaling.yarn_beta_fast"] == 32.0


def test_unsupported_inputs_are_clear_errors_and_leave_no_file(hf_models, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_models["llama"], hf_dir)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigurationError, match="unknown GGUF quantization type 'Q3_K_M'"):
        export_gguf(hf_dir, out / "x.gguf", "Q3_K_M")
    edit_config(hf_dir, rope_parameters=dict(rope_type="dynamic", factor=2.0))
    with pytest.raises(ConfigurationError, match="rope scaling 'dynamic'"):
        export_gguf(hf_dir, out / "x.gguf", "Q8_0", progress=False)
    edit_config(hf_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigurationError, match="architecture 'GPT2LMHeadModel' cannot be"):
        export_gguf(hf_dir, out / "x.gguf")
    assert list(out.iterdir()) == []
    assert cli_main(["quantize", str(hf_dir), str(out / "x.gguf")]) == 1
    assert "GPT2LMHeadModel" in capsys.readouterr().err
    assert cli_main(["quantize", str(hf_models["llama"]), str(out / "y.gguf"), "--type",
                     "q4_k_m"]) == 0
    assert gguf.GGUFReader(out / "y.gguf").fields["general.file_type"].contents() == \
        PRESETS["Q4_K_M"][0]
