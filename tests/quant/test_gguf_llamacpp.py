"""GGUF export checked by llama.cpp itself, where `make llamacpp` built it (.peers/llama.cpp/
build/bin, or $FLEETLLM_LLAMACPP_BIN); every test skips elsewhere. libggml-base's C K-block
dequantizers read our Q4_K/Q5_K/Q6_K blocks as gguf does, llama-quantize picks the same type
for every tensor as gguf_mix, and llama-perplexity over our files (llama, qwen2, qwen3, a
"llama" vocabulary) gives the perplexity transformers computes from the Hugging Face
checkpoint."""

from __future__ import annotations

import ctypes
import math
import re
import subprocess

import gguf
import numpy as np
import pytest
import torch
from conftest import make_checkpoint
from gguf_helpers import (
    DEMO,
    ROOT,
    SIZES,
    byte_fallback_tokenizer,
    llamacpp_tool,
    load_gguf,
    load_reference,
    make_hf_models,
    rel_rms,
)

from fleetllm.quant import blocks
from fleetllm.quant.gguf_export import export_gguf

T = gguf.GGMLQuantizationType
N_CTX = 128


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_blocks_read_the_same_in_llama_cpp_and_as_good_as_its_quantizer(qtype):
    lib = ctypes.CDLL(str(llamacpp_tool("libggml-base.so")))
    name = qtype.name.lower().replace("_k", "_K")
    x = np.random.default_rng(2).standard_normal((32, 4096)).astype(np.float32)
    x[:, :5] *= 12  # a few outliers
    ptr = ctypes.c_void_p
    ours = blocks.quantize(x, qtype)
    theirs_read = np.empty_like(x)
    getattr(lib, f"dequantize_row_{name}")(ours.ctypes.data_as(ptr),
                                           theirs_read.ctypes.data_as(ptr), ctypes.c_int64(x.size))
    y = blocks.dequantize(ours, qtype, x.shape)
    assert np.array_equal(theirs_read, y)
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    assert lib.ggml_validate_row_data(int(qtype), ours.ctypes.data_as(ptr), ours.nbytes)
    ref = np.empty_like(ours)
    getattr(lib, f"quantize_row_{name}_ref")(x.ctypes.data_as(ptr), ref.ctypes.data_as(ptr),
                                             ctypes.c_int64(x.size))
    # measured: ours 1.5% (Q4_K) .. 0.1% (Q5_K) worse than ggml's reference quantizer
    assert rel_rms(y, x) <= 1.03 * rel_rms(blocks.dequantize(ref, qtype, x.shape), x)


def test_llama_quantize_makes_the_same_mix(tmp_path):
    tool = llamacpp_tool("llama-quantize")
    # 8 layers for the use_more_bits pattern, untied, K = 544 for the fallbacks; its own
    # small tokenizer (fewer tokens than embedding rows: [PAD] tokens)
    hf_dir = make_checkpoint(tmp_path / "hf", "LlamaForCausalLM", **{
        **SIZES, "num_hidden_layers": 8, "intermediate_size": 544, "vocab_size": 1024})
    for preset in ("Q8_0", "Q4_0", "Q5_1", "Q6_K", "Q4_K_S", "Q4_K_M", "Q5_K_M"):
        ours = gguf.GGUFReader(export_gguf(hf_dir, tmp_path / "a.gguf", preset, progress=False))
        theirs = gguf.GGUFReader(export_gguf(hf_dir, tmp_path / "b.gguf", preset,
                                             progress=False, llama_quantize=str(tool)))
        got = {t.name: t for t in theirs.tensors}
        assert {t.name: t.tensor_type for t in ours.tensors} == \
            {n: t.tensor_type for n, t in got.items()}, preset
        for t in ours.tensors:  # ggml's reference quantizers: the same bytes
            if t.tensor_type not in (T.Q4_K, T.Q5_K, T.Q6_K):
                assert np.array_equal(t.data, got[t.name].data), (preset, t.name)
    model = load_gguf(tmp_path / "b.gguf")
    assert model.config.num_hidden_layers == 8


def _text() -> str:
    return (ROOT / "fleetllm" / "executor" / "multiproc.py").read_text()[:9000]


def _llama_perplexity(path) -> float:
    tool = llamacpp_tool("llama-perplexity")
    text = path.with_suffix(".txt")
    text.write_text(_text())
    for _ in range(3):
        # --no-repack: this build's repacked (AMX) kernels die of SIGILL on some machines
        run = subprocess.run([str(tool), "-m", str(path), "-f", str(text), "-c", str(N_CTX),
                              "-b", str(N_CTX), "-t", "2", "--no-repack"], capture_output=True,
                             text=True, errors="replace", timeout=120, check=False)
        # its log thread may lose the "Final estimate" line at exit: the running value after
        # the last window is the same number; on a busy machine it may lose that too (seen
        # once): run again
        out = run.stdout + run.stderr
        chunks = re.search(r"perplexity over (\d+) chunks", out)
        running = re.findall(r"\[(\d+)\]([0-9.]+)", out)
        assert run.returncode == 0 and chunks and running, out[-2000:]
        if int(running[-1][0]) == int(chunks.group(1)):
            return float(running[-1][1])
    raise AssertionError(f"llama-perplexity's last window is missing:\n{out[-2000:]}")


def _hf_perplexity(hf_dir) -> float:
    """llama-perplexity's measure: per window of N_CTX tokens, the second half's mean NLL."""
    import transformers

    model = load_reference(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(_text()).input_ids
    adds_bos = tok("a").input_ids[:1] == [tok.bos_token_id]
    nll, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) // N_CTX * N_CTX, N_CTX):
            window = torch.tensor([ids[start:start + N_CTX]])
            if adds_bos:  # llama-perplexity starts every window with BOS
                window[0, 0] = tok.bos_token_id
            logp = torch.log_softmax(model(window).logits[0].double(), dim=-1)
            half = N_CTX // 2
            targets = window[0, half + 1:]
            nll -= logp[half:-1].gather(1, targets[:, None]).sum().item()
            n += len(targets)
    return math.exp(nll / n)


def _byte_fallback_model(root) -> object:
    """A Llama whose tokenizer is a "llama" (SentencePiece-like) vocabulary in the GGUF."""
    hf_dir = make_checkpoint(root / "spm", "LlamaForCausalLM", vocab_size=600, hidden_size=64,
                             intermediate_size=256, num_hidden_layers=1)
    byte_fallback_tokenizer(hf_dir)
    return hf_dir


@pytest.mark.parametrize("name", ["demo", "qwen2", "qwen3", "byte-fallback"])
def test_llama_cpp_reads_the_export_as_transformers_reads_the_checkpoint(tmp_path, name):
    """Same perplexity: llama.cpp tokenizes the text as transformers does (a "llama" vocabulary
    only with the merge-order scores: flat ones gave +0.4%) and computes the same model."""
    llamacpp_tool("llama-perplexity")
    hf_dir = {"demo": lambda: DEMO, "byte-fallback": lambda: _byte_fallback_model(tmp_path)}.get(
        name, lambda: make_hf_models(tmp_path, [name])[name])()
    want = _hf_perplexity(hf_dir)
    f32 = _llama_perplexity(export_gguf(hf_dir, tmp_path / "f32.gguf", "F32", progress=False))
    assert f32 == pytest.approx(want, rel=2e-4)  # measured 1e-5 .. 4e-5
    if name == "demo":  # quantized: llama.cpp's quantized kernels on our blocks
        q = _llama_perplexity(export_gguf(hf_dir, tmp_path / "q.gguf", "Q4_K_M",
                                          progress=False))
        assert q == pytest.approx(want, rel=0.06)  # measured +3.4%; llama-quantize: +3.8%
