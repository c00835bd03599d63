"""GGUF mixture-of-experts files (qwen3moe, qwen2moe with its shared expert) written by
fleetllm's exporter from tiny random checkpoints (tests/moe/moe_checkpoints.py), run with their
experts quantized, against transformers running the same file dequantized in float32; the
quantized experts op (csrc/moe_quant.cpp) against its PyTorch path; tensor parallelism; an
expert tensor of a type fleetllm does not read refused by name."""

from __future__ import annotations

import gc
import random
import struct
import weakref

import numpy as np
import pytest
import torch
import transformers
from helpers import check_logprobs_close, greedy_run, hf_greedy
from moe_checkpoints import make_moe_checkpoint

from fleetllm.config import EngineConfig
from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.executor import Executor
from fleetllm.kernels import cpu_kernels
from fleetllm.model import moe_experts, moe_quant
from fleetllm.quant import blocks
from fleetllm.quant.gguf_export import export_gguf
from fleetllm.quant.packed import QType, QuantTensor

MAX_TOKENS = 8
# name -> (architecture, checkpoint overrides, preset). Q4_K needs rows of 256: hidden 256,
# experts of width 256 (their down is Q4_K, or Q6_K on the _M mix's more-bits layers).
FILES = {
    "qwen3moe-Q8_0": ("Qwen3MoeForCausalLM", dict(num_experts=8, norm_topk_prob=True), "Q8_0"),
    "qwen3moe-Q4_K_M": ("Qwen3MoeForCausalLM", dict(
        num_experts=8, norm_topk_prob=True, hidden_size=256, moe_intermediate_size=256,
        head_dim=64), "Q4_K_M"),
    "qwen2moe-Q8_0": ("Qwen2MoeForCausalLM", dict(
        num_experts=8, norm_topk_prob=False, shared_expert_intermediate_size=96), "Q8_0"),
    # the shared expert in K-quants too (its down 256 wide: Q4_K / Q6_K)
    "qwen2moe-Q4_K_M": ("Qwen2MoeForCausalLM", dict(
        num_experts=8, norm_topk_prob=False, hidden_size=256, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, head_dim=64), "Q4_K_M"),
    # every tensor F16: the experts fill the dense stacked weights instead
    "qwen3moe-F16": ("Qwen3MoeForCausalLM", dict(num_experts=8, norm_topk_prob=True), "F16"),
    # arch "llama" with llama.expert_count; experts of the FFN width (128)
    "mixtral-Q8_0": ("MixtralForCausalLM", dict(num_local_experts=8), "Q8_0"),
    # experts of width 64: each of 2 tensor-parallel ranks keeps whole Q8_0 blocks of down
    "qwen3moe-Q8_0-wide": ("Qwen3MoeForCausalLM", dict(
        num_experts=8, norm_topk_prob=True, moe_intermediate_size=64), "Q8_0"),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_gguf")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            arch, kw, preset = FILES[name]
            hf = make_moe_checkpoint(root / name, arch, seed=len(cache), **kw)
            cache[name] = (hf, export_gguf(hf, root / f"{name}.gguf", preset, progress=False))
        return cache[name]
    return get


def make_executor(path, **kwargs) -> Executor:
    cfg = EngineConfig.from_kwargs(model=str(path), kv_cache_memory=32 << 20, **kwargs)
    executor = Executor.get_class(cfg)(cfg)
    executor.initialize_cache(*executor.determine_num_available_blocks())
    return executor


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 2, 5, 7, 12, 16, 20, 27, 33, 48)]


def dequantized_mixtral(hf_dir, gguf_path):
    """transformers' float32 Mixtral with every weight the file's, dequantized by gguf
    (transformers reads no Mixtral GGUF): each checkpoint tensor's GGUF name by gguf's own
    name map (an expert's: its part's 3-D tensor), llama.cpp's q/k row permutation undone."""
    from gguf import MODEL_ARCH, GGUFReader, get_tensor_name_map
    from gguf.quants import dequantize
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    reader = GGUFReader(str(gguf_path))
    data = {t.name: dequantize(t.data, t.tensor_type).reshape(
        tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    state = {}
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as st:
        for key in st.keys():
            parts = key.split(".")
            expert = None
            if "experts" in parts:  # ...experts.E.w1.weight -> ...experts.w1.weight
                i = parts.index("experts") + 1
                expert = int(parts.pop(i))
            w = data[names.get_name(".".join(parts), try_suffixes=(".weight",))]
            w = w[expert] if expert is not None else w
            if ".q_proj." in key or ".k_proj." in key:
                heads = config.num_attention_heads if ".q_proj." in key else \
                    config.num_key_value_heads
                w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2) \
                    .reshape(w.shape)
            state[key] = torch.from_numpy(np.array(w, dtype=np.float32))
            assert tuple(state[key].shape) == tuple(st.get_slice(key).get_shape()), key
    out = hf_dir.with_name(f"{hf_dir.name}-dequantized")
    out.mkdir(exist_ok=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def check_against_transformers(hf_dir, gguf_path, ours) -> None:
    """>= 90% of the requests give the greedy tokens of transformers' float32 model of the
    dequantized file (the checkpoint's config.json: transformers' GGUF config reads no expert
    width); every one within the other's top-5 at its first difference."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    if config.model_type == "mixtral":
        hf = dequantized_mixtral(hf_dir, gguf_path)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, config=config,
            dtype=torch.float32).eval()
    same = 0
    for prompt, (tokens, lps) in zip(_prompts(), ours, strict=True):
        ref_tokens, ref_rows = hf_greedy(hf, prompt, MAX_TOKENS)
        same += check_logprobs_close(tokens, lps, ref_tokens, ref_rows)
    assert same >= 0.9 * len(ours), f"{same} of {len(ours)} requests identical"


def _experts(executor) -> list[moe_experts.FusedExperts]:
    model = executor.driver_worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, moe_experts.FusedExperts)]


@pytest.mark.parametrize("kernel", ["chosen", "pytorch"])
@pytest.mark.parametrize("name", ["qwen3moe-Q8_0", "qwen3moe-Q4_K_M", "qwen2moe-Q8_0",
                                  "qwen2moe-Q4_K_M", "mixtral-Q8_0"])
def test_gguf_moe_matches_transformers(gguf_files, name, kernel, monkeypatch):
    if kernel == "pytorch":  # the path without the kernels: picked experts dequantized
        monkeypatch.setattr(moe_experts.FusedExperts, "choose_kernel", lambda self: setattr(
            self, "kernel", moe_experts.torch_quant_experts))
    hf_dir, path = gguf_files(name)
    with make_executor(path) as executor:
        experts = _experts(executor)
        assert experts, "no MoE layer was built"
        for m in experts:  # kept quantized: packed blocks, no dense copy
            assert m.packed is not None and m.w13 is None and m.w2 is None
        if kernel == "chosen" and cpu_kernels.available():
            assert all(m.kernel is moe_quant.cpu_quant_experts for m in experts)
        ours = greedy_run(executor, _prompts(), MAX_TOKENS)
    check_against_transformers(hf_dir, path, ours)


def test_unquantized_experts_load_dense(gguf_files):
    """An F16 file's experts are dequantized into w13 / w2 and run by the bf16/float32 op."""
    hf_dir, path = gguf_files("qwen3moe-F16")
    with make_executor(path) as executor:
        experts = _experts(executor)
        assert experts and all(m.packed is None and m.w13 is not None for m in experts)
        if cpu_kernels.available():
            assert all(m.kernel is moe_experts.cpu_experts for m in experts)
        ours = greedy_run(executor, _prompts(), MAX_TOKENS)
    check_against_transformers(hf_dir, path, ours)


def _one_tensor_an_expert(path, out):
    """The file rewritten as older Mixtral files are: blk.N.ffn_gate.E.weight for each expert
    E in place of blk.N.ffn_gate_exps.weight (the same blocks, the same metadata)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name.endswith("_exps.weight"):
            base = t.name.removesuffix("_exps.weight")
            for e in range(t.data.shape[0]):
                writer.add_tensor(f"{base}.{e}.weight", np.ascontiguousarray(t.data[e]),
                                  raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_mixtral_one_tensor_an_expert(gguf_files, tmp_path):
    """Older Mixtral files (a tensor an expert) give the same tokens as the 3-D layout."""
    _, path = gguf_files("mixtral-Q8_0")
    old = _one_tensor_an_expert(path, tmp_path / "old.gguf")
    with make_executor(path) as executor:
        want = greedy_run(executor, _prompts()[:4], MAX_TOKENS)
    with make_executor(old) as executor:
        assert all(m.packed is not None for m in _experts(executor))
        got = greedy_run(executor, _prompts()[:4], MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in want]


def _random_experts(num_experts: int, hidden: int, inter: int, types: tuple[QType, QType],
                    seed: int) -> list[tuple[QuantTensor, QuantTensor, QuantTensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_experts):
        trio = []
        for qtype, shape in ((types[0], (inter, hidden)), (types[0], (inter, hidden)),
                             (types[1], (hidden, inter))):
            raw = blocks.quantize(rng.normal(0, 0.1, shape).astype(np.float32), qtype.name)
            trio.append(QuantTensor(raw, qtype, shape))
        out.append(tuple(trio))
    return out


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", [(QType.Q8_0, QType.Q8_0), (QType.Q4_K, QType.Q6_K),
                                   (QType.Q5_K, QType.Q4_0)])
@pytest.mark.parametrize("tokens", [1, 3, 40, 150])
def test_quantized_op_matches_pytorch(types, dtype, tokens):
    """The C++ op against the PyTorch path on random packed experts: decode (1 token: k
    experts of one row), a small batch, prompts (40 tokens: experts of ~13 rows, gguf_linear's
    passes; 150: ~50 rows, its dequantized GEMM); experts 6 and 7 never picked, their copies
    made unreadable to prove they are not read."""
    num_experts, hidden, inter, k = 8, 256, 512, 2
    packed, bounds = moe_quant.pack_experts(_random_experts(num_experts, hidden, inter,
                                                            types, seed=tokens))
    b = bounds.tolist()
    packed[b[12]:b[16]] = 0xFF  # experts 6, 7: a garbage header (the op checks what it reads)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    got = moe_quant.cpu_quant_experts(x, ids, weights, packed, bounds)
    want = moe_experts.torch_quant_experts(x, ids, weights, packed, bounds)
    assert got.dtype == dtype and got.shape == x.shape
    # float32: the VNNI path's int8 planes of x (~3e-5 relative); bf16: a rounding step apart
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale
    with pytest.raises(RuntimeError, match="expert 6"):  # reading expert 6 fails loudly
        moe_quant.cpu_quant_experts(x, torch.full_like(ids, 6), weights, packed, bounds)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(pipeline_parallel_size=2)])
def test_parallel_on_mp(gguf_files, layout):
    """TP=2 splits each quantized expert (gate/up rows, down's blocks of columns); PP=2 gives
    each stage its layers' experts: the same tokens as transformers."""
    hf_dir, path = gguf_files("qwen3moe-Q8_0-wide")
    with make_executor(path, distributed_executor_backend="mp", **layout) as ex:
        ours = greedy_run(ex, _prompts(), MAX_TOKENS)
    check_against_transformers(hf_dir, path, ours)


def test_tensor_parallel_refused_where_blocks_would_split(gguf_files):
    """Experts of width 32 in Q8_0 (blocks of 32): 2 ranks would split down's blocks."""
    _, path = gguf_files("qwen3moe-Q8_0")
    with pytest.raises(ModelLoadError, match="down_proj.*does not divide its blocks"):
        make_executor(path, tensor_parallel_size=2, distributed_executor_backend="mp")


def test_unsupported_expert_type_refused_by_name(gguf_files, tmp_path):
    """An expert tensor of a ggml type fleetllm does not read (IQ2_XXS here): ModelLoadError
    naming it, when the config is built."""
    _, path = gguf_files("qwen3moe-Q8_0")
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_down_exps.weight"
    at = data.index(name) + len(name)  # then n_dims (u32), dims (u64 each), type (u32)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 16)  # GGML_TYPE_IQ2_XXS
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="blk.1.ffn_down_exps.weight.*IQ2_XXS"):
        EngineConfig.from_kwargs(model=str(bad), kv_cache_memory=32 << 20)


def test_sharded_state_save_refused(gguf_files, tmp_path):
    """Quantized experts have no sharded-state form yet: saving says so, writes no part."""
    _, path = gguf_files("qwen3moe-Q8_0")
    with make_executor(path) as executor, \
            pytest.raises(ConfigurationError, match="quantized experts cannot be saved"):
        executor.save_sharded_state(tmp_path / "state")
    assert not list((tmp_path / "state").glob("*.safetensors"))


def test_bfloat16_model(gguf_files, monkeypatch):
    """A bf16 model of the file (bf16 activations: each expert's output and the sum rounded
    to bf16) gives the same tokens through the C++ op as through the PyTorch path, which
    rounds at the same points (against float32 transformers, bf16 drifts: 7 of 10 here)."""
    _, path = gguf_files("qwen3moe-Q8_0")
    with make_executor(path, dtype="bfloat16") as executor:
        assert executor.driver_worker.model_runner.model.norm_dtype == torch.bfloat16
        if cpu_kernels.available():
            assert all(m.kernel is moe_quant.cpu_quant_experts for m in _experts(executor))
        ours = greedy_run(executor, _prompts(), MAX_TOKENS)
    monkeypatch.setattr(moe_experts.FusedExperts, "choose_kernel", lambda self: setattr(
        self, "kernel", moe_experts.torch_quant_experts))
    with make_executor(path, dtype="bfloat16") as executor:
        ref = greedy_run(executor, _prompts(), MAX_TOKENS)
    same = sum(a == b for (a, _), (b, _) in zip(ours, ref, strict=True))
    assert same >= 0.9 * len(ref), f"{same} of {len(ref)} requests identical"


def test_sleep_and_wake(gguf_files):
    """Sleep level 2 frees the packed experts (sleeping once failed on the experts' kernel, a
    function); waking loads them again, to the same tokens."""
    _, path = gguf_files("qwen2moe-Q8_0")
    with make_executor(path) as executor:
        want = greedy_run(executor, _prompts()[:4], MAX_TOKENS)
        copies = [weakref.ref(m.packed) for m in _experts(executor)]
        executor.sleep(2)
        gc.collect()
        assert all(ref() is None for ref in copies)
        executor.wake_up()
        assert all(m.packed is not None for m in _experts(executor))
        got = greedy_run(executor, _prompts()[:4], MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in want]


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
def test_quantized_op_same_bits_on_any_thread_count():
    """A batch of decodes (16 tokens, ~4 rows an expert: the experts shared among the threads)
    gives the bits one thread gives, each output being one thread's sum either way."""
    packed, bounds = moe_quant.pack_experts(_random_experts(8, 256, 512,
                                                            (QType.Q4_K, QType.Q6_K), seed=7))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 256, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(16)])
    weights = torch.softmax(torch.randn(16, 2, generator=gen), -1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        shared = moe_quant.cpu_quant_experts(x, ids, weights, packed, bounds)
        torch.set_num_threads(1)
        alone = moe_quant.cpu_quant_experts(x, ids, weights, packed, bounds)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
