"""bfloat16 end to end on the CPU: the kernels round where transformers' modules round, greedy
outputs match transformers in bfloat16, dtype="auto" keeps a bf16 checkpoint in bf16, and the
KV cache may be kept in either dtype (kv_cache_dtype)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import simulate_no_onednn_bf16, simulate_onednn_amx
from kernel_cases import decode_inputs

from fleetllm import LLM, SamplingParams
from fleetllm.errors import ConfigurationError
from fleetllm.kernels import build as kernel_build
from fleetllm.kernels import cpu_kernels
from fleetllm.model import kernel_choice
from fleetllm.model import linear_kernels as lk

DEMO = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
BF16 = torch.bfloat16
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here")


def _beside_onednn(weight: torch.Tensor, packed_dtype: torch.dtype, head: bool = False
                   ) -> lk.Gemv:
    """The Gemv kernel a projection gets beside oneDNN's copy in `packed_dtype` (float32 for a
    bf16 weight: a CPU where oneDNN packs no bf16), with a stand-in for that copy."""
    rest = lk.OneDnn.__new__(lk.OneDnn)
    rest.tensor, rest.dtype = torch.zeros(1, dtype=packed_dtype), weight.dtype
    rest.out_features = weight.shape[0]
    return lk.Gemv(weight, rest, *lk.gemv_limits(rest, head))


def _hf_rmsnorm(x, weight, eps):  # transformers' LlamaRMSNorm
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _hf_rope(x, cos, sin):  # transformers' apply_rotary_pos_emb, x: [T, heads, d]
    half = x.shape[-1] // 2
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _close_in_bf16(got, want, atol: float = 1e-6):
    """Equal but for the order of a float32 sum: at most one bfloat16 step apart (atol: for
    sums that cancel to near zero, the float32 error of their terms)."""
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=atol)


@needs_kernels
def test_elementwise_kernels_round_where_transformers_rounds():
    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(5, 300, generator=g).to(BF16) for _ in range(3))
    residual = r.clone()
    out = cpu_kernels.add_rmsnorm(x, residual, w[0], 1e-5)
    assert torch.equal(residual, x + r)
    assert torch.equal(out, _hf_rmsnorm(x + r, w[0], 1e-5))
    assert torch.equal(cpu_kernels.add_rmsnorm(x, None, w[0], 1e-6), _hf_rmsnorm(x, w[0], 1e-6))
    gu = (torch.randn(5, 600, generator=g) * 4).to(BF16)
    assert torch.equal(cpu_kernels.silu_mul(gu), F.silu(gu[:, :300]) * gu[:, 300:])
    t, h, kvh, d = 3, 4, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d + 8, generator=g).to(BF16)[:, :-8]  # strided rows
    cos, sin = (torch.randn(t, 1, d // 2, generator=g).to(BF16) for _ in range(2))
    slots = torch.tensor([0, 5, 9])
    for cache_dtype in (BF16, torch.float32):
        cache = torch.zeros(2, 4, 4, kvh, d, dtype=cache_dtype)
        q, k = cpu_kernels.rope_qk_kv(qkv, cos, sin, h, kvh, cache, slots)
        want_k = _hf_rope(qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d), cos, sin)
        assert torch.equal(q, _hf_rope(qkv[:, :h * d].reshape(t, h, d), cos, sin))
        assert torch.equal(k, want_k)
        assert torch.equal(cache[0].view(-1, kvh, d)[slots], want_k.to(cache_dtype))
        assert torch.equal(cache[1].view(-1, kvh, d)[slots],
                           qkv[:, (h + kvh) * d:].reshape(t, kvh, d).to(cache_dtype))


@needs_kernels
@pytest.mark.parametrize("m, n, k", [(1, 700, 300), (3, 64, 17), (4, 2048, 768), (2, 5, 64),
                                     (6, 300, 200), (8, 2048, 768), (13, 64, 17),
                                     # rows in groups of 4-6 over blocks of 1024 of k, 16 at a
                                     # time, a short last tile, a tail of k
                                     (5, 301, 1100), (7, 64, 2080), (16, 33, 1030),
                                     (20, 96, 3100)])
def test_gemv_sums_in_float32_and_rounds_once(m, n, k):
    g = torch.Generator().manual_seed(m * n)
    x, w, b = (torch.randn(*s, generator=g).to(BF16) for s in ((m, k), (n, k), (n,)))
    want = (x.float() @ w.float().T + b.float()).to(BF16)
    _close_in_bf16(cpu_kernels.gemv(x, w, b), want, 1e-3)
    _close_in_bf16(cpu_kernels.gemv(x, w, None), (x.float() @ w.float().T).to(BF16), 1e-3)


@needs_kernels
@pytest.mark.parametrize("hidden, inter, packed_dtype, rows", [
    (64, 128, BF16, 8),            # small layer: the one-call layer up to 8 rows
    (896, 4864, BF16, 8),          # Qwen2-0.5B's 28 MiB layers, oneDNN packs bf16: 8 too
    (896, 4864, torch.float32, 16),  # the same without bf16 packing (AVX2): the kernel's 16
])
def test_one_call_layer_row_limit_follows_the_layer_size(hidden, inter, packed_dtype, rows):
    """A layer's projections take the GEMV kernel up to 8 rows, a large one too where oneDNN
    packs bf16 (the kernel's bf16 tile reads two weight rows at once: as fast as oneDNN or
    faster up to 8 rows; before it, such layers stopped at 3), and up to 16 rows where the
    packed copy is float32 (fused.py)."""
    from fleetllm.model import fused

    def proj(n, k):
        weight = torch.zeros(n, k, dtype=BF16)
        return SimpleNamespace(weight=weight, kernel=_beside_onednn(weight, packed_dtype),
                               bias=None)

    norm = SimpleNamespace(weight=torch.ones(hidden, dtype=BF16), eps=1e-6)
    layer = SimpleNamespace(
        self_attn=SimpleNamespace(qkv_proj=proj(hidden + 256, hidden), o_proj=proj(hidden, hidden),
                                  q_norm=None, num_heads=hidden // 64, sliding_window=None,
                                  scale=0.125),
        mlp=SimpleNamespace(gate_up_proj=proj(2 * inter, hidden), down_proj=proj(hidden, inter)),
        input_layernorm=norm, post_attention_layernorm=norm)
    assert fused._stack(SimpleNamespace(layers={"0": layer}, is_first_stage=False,
                                          is_last_stage=False)).gemv_rows == rows


@needs_kernels
def test_projections_take_the_gemv_kernel_up_to_their_row_limit(monkeypatch):
    """A projection's Gemv kernel runs the GEMV on the dense weight for up to 4 rows (a
    prompt's bits must not depend on whether it shares its step) and oneDNN's packed copy
    beyond; the LM head's (and the fused decode layers', decode_rows) up to 16 rows for a bf16
    weight whose packed copy is float32 (twice the bytes), 8 for the others."""
    calls = []
    gemv = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda *a: calls.append(a[0].shape[0]) or gemv(*a))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    simulate_no_onednn_bf16(monkeypatch)  # the bf16 weight's copy is float32
    for weight, decode_rows in ((w.to(BF16), 16), (w, 8)):
        for head, limit in ((False, 4), (True, decode_rows)):
            kernel = lk.Gemv(weight, lk.OneDnn(weight), *lk.gemv_limits(lk.OneDnn(weight), head))
            assert (kernel.gemv_rows, kernel.decode_rows) == (limit, decode_rows)
            for rows, by_gemv in ((limit, True), (limit + 1, False)):
                x = torch.randn(rows, 64, generator=g).to(weight.dtype)
                calls.clear()
                y = kernel(x)
                assert calls == ([rows] if by_gemv else []), (weight.dtype, rows, head)
                _close_in_bf16(y.to(BF16), (x.float() @ weight.float().T).to(BF16), 1e-2)


def test_large_float32_weights_keep_the_gemv_kernel_to_8_rows():
    """Since the float32 tile prefetches its 4 weight rows into L2, it beats oneDNN's float32
    matmul up to 8 rows on weights that stream from memory, with AVX-512 too (the 125M
    preset's decode batches of 5 and 8: 10-25% more tokens/s than through oneDNN): a large
    float32 weight, and a large float32 layer's one call, keep the kernel to 8 rows as small
    ones do (before: 4 on AVX-512 CPUs). bf16 weights: 16 where the packed copy is float32,
    else 8, a large layer packed in bf16 as well (it stopped at 3 before the bf16 tile read
    two weight rows at once)."""
    from fleetllm.model import fused

    def weight(dtype, nbytes):  # as large as nbytes, without the memory
        return torch.zeros(1, dtype=dtype).expand(nbytes // torch.tensor([], dtype=dtype)
                                                  .element_size())

    def rows(dtype, packed_dtype, nbytes):
        return _beside_onednn(weight(dtype, nbytes), packed_dtype).decode_rows

    def layer_rows(dtype, nbytes_each):
        proj = [SimpleNamespace(bias=None) for _ in range(4)]
        layer = SimpleNamespace(
            self_attn=SimpleNamespace(qkv_proj=proj[0], o_proj=proj[1], q_norm=None,
                                      num_heads=1, sliding_window=None, scale=0.5),
            mlp=SimpleNamespace(gate_up_proj=proj[2], down_proj=proj[3]),
            input_layernorm=SimpleNamespace(weight=torch.ones(4), eps=1e-6),
            post_attention_layernorm=SimpleNamespace(weight=torch.ones(4), eps=1e-6))
        for p in proj:  # each below the limit, the four together maybe not
            p.weight = torch.empty(1, nbytes_each // dtype.itemsize, dtype=dtype)
            p.kernel = _beside_onednn(p.weight, dtype)
        return fused._stack(SimpleNamespace(layers={"0": layer}, is_first_stage=False,
                                          is_last_stage=False)).gemv_rows

    large, small = 64 << 20, 4 << 20
    assert rows(torch.float32, torch.float32, large) == 8
    assert rows(torch.float32, torch.float32, small) == 8
    assert rows(BF16, BF16, large) == 8
    assert rows(BF16, torch.float32, large) == 16
    assert layer_rows(torch.float32, 6 << 20) == 8  # 24 MiB in all: the 125M preset's
    assert layer_rows(torch.float32, 1 << 20) == 8
    assert layer_rows(BF16, 6 << 20) == 8  # 24 MiB of bf16, packed in bf16
    assert layer_rows(BF16, 1 << 20) == 8


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_a_gemv_row_does_not_depend_on_the_rows_beside_it(dtype):
    """Each output row is the same bits whether its row of x is alone in the call or shares
    it with up to 19 others (a prompt alone in its step or in a shared one; the decode batch):
    the kernel's sums for one row never mix in how many rows are grouped with it (bf16: in
    groups of 4-6 rows, 16 at a time, k in blocks past 6 rows)."""
    g = torch.Generator().manual_seed(5)
    for n, k in ((300, 200), (64, 17), (1280, 768), (96, 2051), (301, 48), (7, 264),
                 (37, 3100)):
        x = torch.randn(20, k, generator=g).to(dtype)
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        for bias in (b, None):
            alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], w, bias) for i in range(20)])
            for m in range(2, 21):
                assert torch.equal(cpu_kernels.gemv(x[:m], w, bias), alone[:m]), (n, k, m)


@needs_kernels
@pytest.mark.parametrize("m", range(1, 9))
def test_float32_gemv_matches_a_float64_matmul_at_every_row_count(m):
    """The float32 tile changes its loop with the rows of x (with AVX-512: one weight row at a
    time at 1 and 2 rows, four at once at 3 to 6, 7 and 8 as 4 + 3 and 4 + 4) and its ending
    (a whole tile and K a multiple of 16 stores 4 outputs at once): every count, a short last
    tile (N not a multiple of 4), a last half block of 16 and a scalar tail of K, with and
    without a bias."""
    g = torch.Generator().manual_seed(m)
    for n, k in ((301, 200), (5, 33), (1027, 768), (64, 2051), (3, 16)):
        x, w, b = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n,)))
        want = x.double() @ w.double().T
        torch.testing.assert_close(cpu_kernels.gemv(x, w, None).double(), want,
                                   rtol=1e-5, atol=1e-4 * k ** 0.5)
        torch.testing.assert_close(cpu_kernels.gemv(x, w, b).double(), want + b.double(),
                                   rtol=1e-5, atol=1e-4 * k ** 0.5)


@needs_kernels
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_the_lm_head_gives_a_sequence_the_same_logits_in_batches_up_to_its_gemv_limit(dtype):
    """A decode step's sequences up to decode_gemv_rows (8, or 16 for a bf16 weight packed in
    float32) get their logits from the GEMV kernel (as the fused layers under them), so a
    sequence's logits are the same bits in any such batch; oneDNN's packed matmul, past it,
    sums in another order. A bf16 weight packed by pairs (AVX-512 BF16: limit 0) takes the
    kernels' GEMM at every size, whose bits do not depend on the batch at all: checked to 70
    rows (several groups of rows, uneven splits)."""
    from torch import nn

    from fleetllm.model import layers

    g = torch.Generator().manual_seed(0)
    head = layers.ParallelLMHead(1000, 256)
    head.weight.data = torch.randn(1000, 256, generator=g).to(dtype)
    kernel_choice.select_kernels(nn.ModuleList([head]))  # as a loaded model's
    limit = head.kernel.decode_rows
    pairs = isinstance(head.kernel, lk.Pairs | lk.Amx)
    small = isinstance(head.kernel, lk.SmallBatches)  # beside oneDNN on AMX: limit 0 too
    assert limit == 0 if pairs or small else limit in (8, 16)
    rows = 70 if pairs else head.kernel.rows if small else limit
    hidden = torch.randn(rows, 256, generator=g).to(dtype)
    alone = torch.cat([head.logits(hidden[i:i + 1]) for i in range(rows)])
    for m in range(2, rows + 1):
        assert torch.equal(head.logits(hidden[:m]), alone[:m]), m


# PyTorch's CPU kernels dispatch on this (its flash attention's lane width follows it), the
# kernels on their variant (FLEETLLM_CPU_ISA may pick avx2 where PyTorch runs AVX-512).
_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_KERNELS_AVX512 = cpu_kernels.available() and kernel_build.chosen_variant() == "avx512"
_SAME_LANES = _AVX512 == _KERNELS_AVX512  # both sum in 16-float lanes, or both in 8


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [BF16, torch.float32])
@pytest.mark.parametrize("q_dtype", [BF16, torch.float32])
def test_paged_decode_in_either_dtype(q_dtype, cache_dtype):
    g = torch.Generator().manual_seed(3)
    for batch, heads, kvh, d, bs, window in ((1, 12, 4, 64, 16, 0), (9, 8, 2, 128, 1, 7),
                                             (5, 4, 4, 16, 4, 0)):
        cache, tables, starts, lens = decode_inputs(g, batch, heads, kvh, d, bs)
        cache = cache.to(cache_dtype)
        q = torch.randn(batch, heads, d, generator=g).to(q_dtype)
        out = torch.empty_like(q)
        cpu_kernels.paged_decode(q, cache, tables, starts, lens, window, d ** -0.5, out)
        for b in range(batch):
            n = int(lens[b])
            table = tables[starts[b]: starts[b] + -(-n // bs)].long()
            slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:n]
            first = max(0, n - window) if window else 0
            keys, values = (cache[i].view(-1, kvh, d)[slots[first:]].float()
                            .repeat_interleave(heads // kvh, 1) for i in (0, 1))
            s = torch.einsum("hd,thd->ht", q[b].float(), keys) * d ** -0.5
            if q_dtype == BF16:  # as PyTorch's flash attention: P in bf16, divided at the end
                e = (s - s.amax(-1, keepdim=True)).exp()  # (its exp is ~20 ulp: atol)
                want = torch.einsum("ht,thd->hd", e.to(BF16).float(), values) / e.sum(-1)[:, None]
                _close_in_bf16(out[b], want.to(BF16), 2e-3)
                if cache_dtype == BF16:  # and so the same as transformers' call of it
                    k_, v_ = (x.to(BF16).transpose(0, 1)[None] for x in (keys, values))
                    sdpa = F.scaled_dot_product_attention(q[b][None, :, None], k_, v_,
                                                          scale=d ** -0.5)
                    # PyTorch's flash attention sums in 16-float lanes with AVX-512 (what
                    # the kernel repeats), in 8 without: there (or the kernels' avx2 build
                    # beside it), one element of 1,024 came 1.1e-3 off (a near-cancelling
                    # sum); the reference's bound holds.
                    _close_in_bf16(out[b], sdpa[0, :, 0],
                                   1e-3 if _AVX512 and _KERNELS_AVX512 else 2e-3)
            else:
                want = torch.einsum("ht,thd->hd", s.softmax(-1), values)
                torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("length", [5, 40, 100, 600])
def test_bf16_decode_attention_is_pytorch_flash_attention_bit_for_bit(length):
    """A bf16 model's decode attention computes what PyTorch's CPU flash attention (the kernel
    transformers' bf16 models call) computes: the same exp (fexp_u20 on whole vectors, expf on
    the rest), lane sums, bf16 numerators and 512-key chunks, so the outputs agree bit for bit
    (but for float32 summation-order ties: >= 99.8% of the elements; with expf alone it was
    ~95%), and greedy tokens follow transformers' (test below). On the Zen 4 and Zen 5 every
    case here is >= 99.9%; on both Intel Xeons, with AMX (2026-11-29) and without (2026-12-02),
    PyTorch's sums of a long context go in an order of their own: 99.85% at 600 keys (4,090 of
    4,096 there: five elements of one head and one of another, 1-7 bf16 ulps apart). Where
    the kernels' lanes are not PyTorch's (FLEETLLM_CPU_ISA=avx2 on an AVX-512 CPU: 8 floats
    against 16) the sums' order differs and only the bound holds: 99.3% at 40 keys."""
    g = torch.Generator().manual_seed(length)
    heads, kvh, d, bs = 8, 2, 64, 16
    same = total = 0
    for _ in range(8):
        blocks = -(-length // bs)
        cache = torch.randn(2, blocks + 2, bs, kvh, d, generator=g).to(BF16)
        table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32)
        q = (torch.randn(1, heads, d, generator=g) * 2).to(BF16)
        k, v = (torch.cat([cache[i, b] for b in table.tolist()])[:length] for i in (0, 1))
        want = F.scaled_dot_product_attention(q[:, :, None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], enable_gqa=True)
        out = torch.empty_like(q)
        cpu_kernels.paged_decode(q, cache, table, torch.tensor([0], dtype=torch.int32),
                                 torch.tensor([length], dtype=torch.int32), None, d ** -0.5, out)
        same += int((out[0] == want[0, :, 0]).sum())
        total += out.numel()
    assert same >= (0.998 if _SAME_LANES else 0.98) * total, same / total


@needs_kernels
def test_ops_refuse_mixed_dtypes():
    x, w = torch.randn(2, 8).to(BF16), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="weight must be BFloat16 as the op's input"):
        cpu_kernels.gemv(x, w, None)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Half"):
        cpu_kernels.gemv(x.half(), w.half(), None)
    with pytest.raises(RuntimeError, match="cos and sin must be BFloat16"):
        cpu_kernels.rope_qk_kv(torch.randn(3, 64).to(BF16), torch.randn(3, 1, 8),
                               torch.randn(3, 1, 8), 2, 1, None, None)


def _bf16_checkpoint(src: Path, dst: Path) -> Path:
    """The same checkpoint saved in bfloat16 (config.json then says so)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(src, dtype=BF16).save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def _prompts(vocab: int, count: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 40, (count,), generator=g)]


def _hf_reference(path: Path, prompts: list[list[int]], max_tokens: int):
    """transformers in bfloat16, greedy: per prompt (tokens, logits per step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=BF16).eval()
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0,
                                 eos_token_id=None)
        refs.append((out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]))
    return refs


def _agreement(ours: list[list[int]], refs) -> tuple[int, list[str]]:
    """(requests token-identical to the reference, problems): at a request's first divergence
    our token must be in the reference's top 5 and a near-tie there: its bf16 logit at most
    four bf16 steps below the reference's largest (the decode attention's float32 sums and
    exp differ from PyTorch's flash attention in the last bits, which a bf16 rounding can
    turn into a step)."""
    same, problems = 0, []
    for i, (tokens, (want, logits)) in enumerate(zip(ours, refs, strict=True)):
        want = want[:len(tokens)]
        if tokens == want:
            same += 1
            continue
        step = next(j for j, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b)
        row = logits[step].float()
        top = row.max().item()
        ulp = 2.0 ** (torch.tensor(abs(top)).log2().floor().item() - 7)
        if tokens[step] not in row.topk(5).indices.tolist() or row[tokens[step]] < top - 4 * ulp:
            problems.append(f"request {i} step {step}: {tokens[step]} (logit "
                            f"{row[tokens[step]]:.4f}) vs {want[step]} ({top:.4f})")
    return same, problems


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "llama_tied", "qwen3_qknorm",
                                  "llama3_rope", "demo"])
def test_greedy_outputs_match_transformers_in_bf16(name, tiny_models, tmp_path):
    """dtype="auto" on a bf16 checkpoint: bf16 weights, activations and KV cache; the batch
    runs the oneDNN bf16 matmuls, then (as requests finish) the fused bf16 small-batch layer.
    bf16 ties are real (two logits within a bf16 step, which summation order decides), so a
    request may diverge: at least 90% must be token-identical (measured: all of them, 240 of
    240 with 40 prompts per model; docs/performance.md), and every first divergence must be
    such a tie within transformers' top 5. (With the decode attention's own exp instead of
    PyTorch's, 203 of 240 were.) 40 prompts: with 16, two ties on an AMX CPU (where
    transformers' matmuls sum in AMX's order) read 87.5% on the demo model, 98% over 48."""
    path = _bf16_checkpoint(DEMO if name == "demo" else tiny_models[name], tmp_path / name)
    with LLM(path, kv_cache_memory=32 << 20) as llm:
        assert llm.llm_engine.model_config.torch_dtype("cpu") == BF16
        vocab = llm.llm_engine.model_config.arch.vocab_size
        prompts = _prompts(vocab, 40)
        params = [SamplingParams(temperature=0, max_tokens=4 + i % 16, ignore_eos=True)
                  for i in range(len(prompts))]  # finishing at different steps
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    same, problems = _agreement(ours, _hf_reference(path, prompts, 4 + 15))
    print(f"{name}: {same}/{len(prompts)} requests token-identical to transformers' bf16")
    assert same >= 0.9 * len(prompts) and not problems, (same, problems)


def _projections(worker) -> list[tuple[torch.dtype | None, torch.dtype | None, object]]:
    """(packed weight's dtype, dense weight's dtype, a state tensor's dtype) per projection."""
    from fleetllm.model.layers import ColumnParallelLinear, RowParallelLinear
    from fleetllm.model.sharded_state import state_tensors

    model = worker.model_runner.model
    state = state_tensors(model)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            packed = m.kernel.for_rows(1000)  # the copy past the small batches
            out.append((None if packed.kind is None else packed.tensor.dtype,
                        None if m.weight is None else m.weight.dtype,
                        state[f"{name}.weight"].dtype))
    return out


def _packed_projection(monkeypatch, budget: str | None):
    """A 96 x 128 bf16 projection packed by kernel_choice.select_kernels under the budget
    FLEETLLM_GEMV_MAX_BYTES (None: the default); (projection, its dense weight, generator)."""
    from torch import nn

    from fleetllm.model import layers

    if budget is not None:
        monkeypatch.setenv("FLEETLLM_GEMV_MAX_BYTES", budget)
    g = torch.Generator().manual_seed(0)
    proj = layers.RowParallelLinear(128, 96, bias=False)
    proj.weight.data = torch.randn(96, 128, generator=g).to(BF16)
    dense = proj.weight.detach().clone()
    assert kernel_choice.select_kernels(nn.ModuleList([proj])) == 1
    return proj, dense, g


@pytest.mark.parametrize("onednn_bf16", [True, False], ids=["bf16-packing", "no-bf16-packing"])
def test_bf16_projections_are_packed_on_every_cpu(onednn_bf16, tiny_models, tmp_path,
                                                  monkeypatch):
    """oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on
    the others PyTorch's plain bf16 matmul runs 3-7x slower than float32, so where the kernels'
    GEMM by pairs does not apply either (no AVX2) each bf16 projection gets a float32 packed
    copy instead (layers.py). Either way: every projection is packed, the saved state is bf16,
    and greedy outputs match transformers in bf16. Here the CPU without bf16 packing is
    simulated wherever this runs."""
    if not onednn_bf16:
        simulate_no_onednn_bf16(monkeypatch)
        # and no pair packing: a CPU with neither AVX2 nor AVX-512 (linear_kernels.Pairs)
        monkeypatch.setattr(lk.Pairs, "applies", lambda weight: False)
    elif not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("this CPU has no oneDNN bf16 packing")
    monkeypatch.setenv("FLEETLLM_LINEAR", "packed")  # no dense copy: only the packed one
    path = _bf16_checkpoint(tiny_models["qwen2_bias"], tmp_path / "qwen2")  # biases too
    with LLM(path, kv_cache_memory=16 << 20) as llm:
        [projections] = llm.llm_engine.model_executor.collective_rpc(_projections)
        packed = BF16 if onednn_bf16 else torch.float32
        assert projections and all(p == (packed, None, BF16) for p in projections), projections
        prompts = _prompts(llm.llm_engine.model_config.arch.vocab_size, 10)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    same, problems = _agreement([o.outputs[0].token_ids for o in outs],
                                _hf_reference(path, prompts, 8))
    assert same >= 0.9 * len(prompts) and not problems, (same, problems)


@needs_kernels
def test_bf16_decode_steps_of_up_to_16_take_the_kernel_without_bf16_packing(
        tiny_models, tmp_path, monkeypatch):
    """Where oneDNN packs no bf16 and the projections are not packed by pairs (AVX2 within
    FLEETLLM_GEMV_MAX_BYTES; simulated here), a bf16 projection's packed copy is float32 (twice
    the bytes), and the GEMV kernel on the bf16 weight is faster up to ~24 rows; decode steps
    of up to 16 sequences run the fused layers (and the LM head the kernel), with greedy
    outputs that still follow transformers in bf16."""
    from fleetllm.model import fused

    simulate_no_onednn_bf16(monkeypatch)
    monkeypatch.setattr(lk.Pairs, "applies", lambda weight: False)  # no AVX2 / AVX-512
    seen = {"layer": 0, "head": 0}
    run_layers, gemv = fused.run_layers, cpu_kernels.gemv

    def counted_layer(model, rope, hidden, *rest):
        out = run_layers(model, rope, hidden, *rest)
        if out is not None:
            seen["layer"] = max(seen["layer"], hidden.shape[0])
        return out

    def counted_gemv(x, weight, bias):
        if weight.shape[0] == vocab:
            seen["head"] = max(seen["head"], x.shape[0])
        return gemv(x, weight, bias)

    monkeypatch.setattr(fused, "run_layers", counted_layer)
    monkeypatch.setattr(cpu_kernels, "gemv", counted_gemv)
    path = _bf16_checkpoint(tiny_models["llama_gqa"], tmp_path / "llama")
    with LLM(path, kv_cache_memory=16 << 20) as llm:
        vocab = llm.llm_engine.model_config.arch.vocab_size
        prompts = _prompts(vocab, 14)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
    assert seen == {"layer": 14, "head": 14}, seen
    same, problems = _agreement([o.outputs[0].token_ids for o in outs],
                                _hf_reference(path, prompts, 6))
    assert same >= 0.9 * len(prompts) and not problems, (same, problems)


@needs_kernels
@pytest.mark.parametrize("small_kind", ["amx", "pairs"])
@pytest.mark.parametrize("budget", [None, "0"], ids=["both-copies", "over-budget"])
def test_with_amx_bf16_projections_keep_onednn_and_a_copy_for_small_batches(
        budget, small_kind, monkeypatch):
    """Where oneDNN runs on AMX (2-8x the pairs' GEMM from 12 rows up; simulated here), a bf16
    projection keeps oneDNN's packed copy for every batch and a second copy for small batches
    while the projections fit FLEETLLM_GEMV_MAX_BYTES: packed for the kernels' AMX GEMM (up to
    Amx.MAX_ROWS rows) where the CPU has AMX, else by pairs (up to SMALL_ROWS); over the
    budget oneDNN's alone. The dense weight goes either way; each copy gives its own kernel's
    bits."""
    simulate_onednn_amx(monkeypatch, small_kind)
    proj, dense, g = _packed_projection(monkeypatch, budget)
    kernel = proj.kernel
    assert proj.weight is None and kernel.decode_rows == 0
    small = kernel.small if isinstance(kernel, lk.SmallBatches) else None
    assert (small is None) == (budget is not None)
    large = kernel if small is None else kernel.large
    assert isinstance(large, lk.OneDnn) and large.tensor.is_mkldnn
    assert small is None or isinstance(small, lk.Amx if small_kind == "amx" else lk.Pairs)
    assert small is None or kernel.rows == (lk.Amx.MAX_ROWS if small_kind == "amx"
                                            else lk.Pairs.SMALL_ROWS)
    gemm = cpu_kernels.gemm_amx if small_kind == "amx" else cpu_kernels.gemm_pairs
    for rows in (1, lk.Pairs.SMALL_ROWS, lk.Pairs.SMALL_ROWS + 1, 40, lk.Amx.MAX_ROWS,
                 lk.Amx.MAX_ROWS + 1):
        x = torch.randn(rows, 128, generator=g).to(BF16)
        if small is not None and rows <= kernel.rows:
            want = gemm(x, small.tensor, None, 96)
        else:
            want = torch.ops.mkldnn._linear_pointwise(x, large.tensor, None, "none", [None], "")
        assert torch.equal(kernel(x), want), rows
        _close_in_bf16(want, (x.float() @ dense.float().T).to(BF16), 1e-2)


@needs_kernels
@pytest.mark.parametrize("budget", [None, "0"], ids=["within-budget", "over-budget"])
def test_without_onednn_bf16_packing_the_pairs_take_over_where_the_dense_weights_go(
        budget, monkeypatch):
    """Where oneDNN packs no bf16 (AVX2 CPUs; simulated on others) but the pairs' GEMM runs, a
    bf16 projection keeps the dense weight for the GEMV and a float32 copy for oneDNN (the
    faster pair there) while the dense weights fit FLEETLLM_GEMV_MAX_BYTES; past it the
    projection is packed by pairs alone (2 bytes a parameter, not the float32 copy's 4),
    whose GEMM takes every batch with its own bits."""
    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("no AVX2 or AVX-512: no copies by pairs")
    simulate_no_onednn_bf16(monkeypatch)
    monkeypatch.setattr(lk, "onednn_amx", lambda: False)
    proj, dense, g = _packed_projection(monkeypatch, budget)
    kernel = proj.kernel
    if budget is None:
        assert isinstance(kernel, lk.Gemv) and isinstance(kernel.rest, lk.OneDnn)
        assert kernel.rest.tensor.is_mkldnn and kernel.rest.tensor.dtype == torch.float32
        assert proj.weight is not None and kernel.decode_rows == 16
        return
    assert isinstance(kernel, lk.Pairs) and proj.weight is None and kernel.decode_rows == 0
    for rows in (1, 5, 300):
        x = torch.randn(rows, 128, generator=g).to(BF16)
        want = lk.Pairs.pack(dense)(x)
        assert torch.equal(kernel(x), want), rows
        _close_in_bf16(want, (x.float() @ dense.float().T).to(BF16), 1e-2)


def test_packing_frees_the_dense_weights(tiny_models, tmp_path, monkeypatch):
    """The dense weights that packed copies replace are freed, not kept alive by the loader's
    name -> Parameter index (a Llama-1B-shaped bf16 model held 2 GB more for it)."""
    import gc
    import weakref

    from fleetllm.model import layers, loader

    dense = []
    pack = kernel_choice.select_kernels

    def recorded(model):
        linears = [m for m in model.modules() if getattr(m, "weight", None) is not None
                   and isinstance(m, layers.ColumnParallelLinear | layers.RowParallelLinear)]
        dense.extend((m, weakref.ref(m.weight)) for m in linears)
        return pack(model)

    monkeypatch.setattr(loader, "select_kernels", recorded)
    # no dense copies kept for the GEMV (a CPU without oneDNN bf16 packing keeps them within it)
    monkeypatch.setenv("FLEETLLM_GEMV_MAX_BYTES", "0")
    path = _bf16_checkpoint(tiny_models["llama_gqa"], tmp_path / "llama")
    with LLM(path, kv_cache_memory=16 << 20):
        gc.collect()
        freed = [ref() is None for m, ref in dense if m.weight is None]
        assert freed and all(freed), freed


def test_dtype_auto_follows_the_checkpoint(tiny_models, tmp_path):
    """bf16 checkpoints run in bf16 on the CPU; float16 ones in float32 (no fast float16 CPU
    path: float32 holds every float16 exactly); float32 stays float32."""
    from transformers import AutoModelForCausalLM

    src = tiny_models["llama_gqa"]
    cases = {"float32": torch.float32, "bfloat16": BF16, "float16": torch.float32}
    for stored, expected in cases.items():
        path = tmp_path / stored
        AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, stored)).save_pretrained(
            path)
        with LLM(path, tokenizer=str(src), kv_cache_memory=8 << 20) as llm:
            dtypes = llm.llm_engine.model_executor.collective_rpc(_model_and_cache_dtypes)
            assert dtypes == [(expected, expected)], stored


def _model_and_cache_dtypes(worker) -> tuple[torch.dtype, torch.dtype]:
    return worker.model_runner.dtype, worker.cache_engine.gpu_cache[0].dtype


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("bfloat16", "float32"),
                                                   ("float32", "bfloat16")])
def test_kv_cache_dtype(dtype, kv_cache_dtype, tiny_models, monkeypatch):
    """The cache in the other dtype: its tensors have it, the kernels and the PyTorch path give
    the same tokens, and a bf16 cache holds twice the blocks of a float32 one."""
    path = tiny_models["llama_gqa"]
    prompts = [{"prompt_token_ids": p} for p in _prompts(512, 6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results, blocks = [], {}
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(cpu_kernels, "usable", lambda *t: False)
            monkeypatch.setattr(cpu_kernels, "available", lambda: False)
        with LLM(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=8 << 20,
                 enable_prefix_caching=False) as llm:
            [(_, cache)] = llm.llm_engine.model_executor.collective_rpc(_model_and_cache_dtypes)
            assert cache == getattr(torch, kv_cache_dtype)
            blocks[kv_cache_dtype] = llm.llm_engine.config.cache_config.num_gpu_blocks
            results.append([o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1] or not cpu_kernels.available()
    with LLM(path, dtype=dtype, kv_cache_memory=8 << 20) as llm:
        auto_blocks = llm.llm_engine.config.cache_config.num_gpu_blocks
    ratio = 2 if kv_cache_dtype == "bfloat16" else 0.5
    assert blocks[kv_cache_dtype] == pytest.approx(auto_blocks * ratio, rel=0.02)


def test_kv_cache_dtype_is_validated(tiny_models):
    with pytest.raises(ConfigurationError, match="kv_cache_dtype: 'fp8' is not supported"):
        LLM(tiny_models["llama_gqa"], kv_cache_dtype="fp8")


@needs_kernels
@pytest.mark.parametrize("cpu", ["this-cpu", "amx", "no-bf16-packing"])
def test_batch_invariant_bf16_rows_are_the_same_bits_in_any_batch(cpu, monkeypatch):
    """FLEETLLM_BATCH_INVARIANT=1 (issue 70, 9): a bf16 projection keeps the kernels' own copy
    alone (on AMX tiles where the CPU has them and the sizes are multiples of 32, else by
    pairs), on every CPU whose kernels run that GEMM (AVX2 or AVX-512), so a row's outputs are
    the same bits alone or among any number of rows. By default the layers switch kernels with the
    batch's rows (the GEMV up to 16 rows then oneDNN's float32 copy without oneDNN bf16
    packing; the small batches' copy then oneDNN with AMX), whose sums round differently: a
    speculative step's k + 1 rows a sequence then gave other tokens than plain decode steps.
    Every CPU kind is simulated here (oneDNN on AMX; oneDNN packing no bf16), at sizes that
    suit no tile (130 x 688) and the GEMV's, the small copies' and oneDNN's row counts."""
    from torch import nn

    from fleetllm.model import layers

    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("no AVX2 or AVX-512: no copies by pairs")
    if cpu == "amx":
        monkeypatch.setattr(lk, "onednn_amx", lambda: True)
    elif cpu == "no-bf16-packing":
        simulate_no_onednn_bf16(monkeypatch)
        monkeypatch.setattr(lk, "onednn_amx", lambda: False)
    monkeypatch.setenv("FLEETLLM_BATCH_INVARIANT", "1")
    g = torch.Generator().manual_seed(9)
    for n, k in ((130, 688), (256, 96)):
        proj = layers.RowParallelLinear(k, n, bias=False)
        proj.weight.data = torch.randn(n, k, generator=g).to(BF16)
        dense = proj.weight.detach().clone()
        assert kernel_choice.select_kernels(nn.ModuleList([proj])) == 1
        kind = lk.Amx if lk.Amx.applies(dense) else lk.Pairs
        assert type(proj.kernel) is kind and proj.weight is None
        assert proj.kernel.decode_rows == 0
        x = torch.randn(300, k, generator=g).to(BF16)
        alone = torch.cat([proj.kernel(x[i:i + 1]) for i in range(6)])
        for rows in (2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 257, 300):
            assert torch.equal(proj.kernel(x[:rows])[:6], alone[:min(rows, 6)]), \
                (n, k, rows)
        _close_in_bf16(alone, (x[:6].float() @ dense.float().T).to(BF16), 1e-2)
