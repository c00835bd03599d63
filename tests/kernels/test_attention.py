"""The attention backend against a dense per-sequence reference: mixed batches of decodes,
fresh prefills (grouped and padded) and prefills after a cached prefix, with GQA, sliding
windows, several block sizes and head sizes; through the C decode kernel and through the
pure-PyTorch path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import simulate_onednn_amx

from fleetllm.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSpan,
    TorchAttentionBackend,
)
from fleetllm.kernels import cpu_kernels
from fleetllm.kernels.cpu_kernels import LinearKind


def reference(q, k_all, v_all, ctx_len, q_len, scale, window):
    """Dense attention of the last q_len positions of one sequence over its ctx_len keys."""
    h, kvh = q.shape[1], k_all.shape[1]
    k = k_all[:ctx_len].repeat_interleave(h // kvh, 1).transpose(0, 1)
    v = v_all[:ctx_len].repeat_interleave(h // kvh, 1).transpose(0, 1)
    pos = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
    j = torch.arange(ctx_len).unsqueeze(0)
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def build_case(rng: random.Random, heads: int, kv_heads: int, d: int, bs: int):
    """Sequences with (cached prefix, new tokens): decodes, fresh prompts, prefixed chunks.
    Returns the metadata, q/k/v of the new tokens, the cache, and per sequence the full K/V
    plus where its new rows sit in the batch."""
    kinds = [rng.choice(["decode", "decode", "fresh", "prefix"]) for _ in range(rng.randint(1, 9))]
    num_blocks = 2000
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d)
    seqs = []
    for kind in kinds:
        if kind == "decode":
            prefix, new = rng.randint(0, 120), 1
        elif kind == "fresh":
            prefix, new = 0, rng.choice([2, 3, rng.randint(2, 70)])
        else:
            prefix, new = rng.randint(1, 90), rng.randint(2, 30)
        total = prefix + new
        table = [free.pop() for _ in range(-(-total // bs))]
        k_all, v_all = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
        for p in range(prefix):  # the cached prefix is already in the cache
            cache[0, table[p // bs], p % bs] = k_all[p]
            cache[1, table[p // bs], p % bs] = v_all[p]
        seqs.append((prefix, new, table, k_all, v_all))
    # decodes first, as the model runner orders the batch
    seqs.sort(key=lambda s: s[1] != 1)
    slot_of = [[t[p // bs] * bs + p % bs for p in range(pre + n)] for pre, n, t, _, _ in seqs]
    q_rows, k_rows, v_rows, slots, spans = [], [], [], [], []
    tables, starts, lens = [], [], []
    row = 0
    for i, (prefix, new, table, k_all, v_all) in enumerate(seqs):
        total = prefix + new
        q_rows.append(torch.randn(new, heads, d))
        k_rows.append(k_all[prefix:])
        v_rows.append(v_all[prefix:])
        slots += slot_of[i][prefix:]
        if new == 1:
            starts.append(len(tables))
            tables += table
            lens.append(total)
        else:
            ctx = None if prefix == 0 else torch.tensor(slot_of[i])
            spans.append(PrefillSpan(row, new, total, ctx))
        row += new
    meta = AttentionMetadata(torch.tensor(slots), spans)
    if lens:
        i32 = torch.int32
        meta.decode = DecodeBatch(torch.tensor(tables, dtype=i32), torch.tensor(starts, dtype=i32),
                                  torch.tensor(lens, dtype=i32))
    return meta, torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), cache, seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False])
def test_backend_matches_dense_reference(kernel, dtype, monkeypatch):
    """The C kernels (decode, prefill) or the PyTorch path; float32 to float32 rounding,
    bfloat16 (model and cache) to about a bf16 step of the float64 reference."""
    if kernel and not cpu_kernels.available():
        pytest.skip("no C compiler: the kernel path is not used here")
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
        monkeypatch.setattr(cpu_kernels, "usable", lambda *a: False)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    rng = random.Random(5)
    for case in range(40):
        heads, kv_heads = rng.choice([(4, 2), (4, 4), (12, 4), (8, 1), (24, 8), (10, 2)])
        d = rng.choice([16, 40, 64, 128])  # 40: not whole vectors of 16
        bs = rng.choice([1, 4, 16])
        window = rng.choice([None, None, 7, 20])
        meta, q, k, v, cache, seqs = build_case(rng, heads, kv_heads, d, bs)
        q, k, v, cache = (x.to(dtype) for x in (q, k, v, cache))
        scale = d ** -0.5
        out = TorchAttentionBackend.forward(q, k, v, cache, meta, scale, window)
        row = 0
        for prefix, new, _, k_all, v_all in seqs:
            k_all, v_all = (x.to(dtype).double() for x in (k_all, v_all))
            want = reference(q[row:row + new].double(), k_all, v_all, prefix + new, new, scale,
                             window)
            torch.testing.assert_close(out[row:row + new].double(), want, **tol,
                                       msg=f"case {case}: prefix {prefix}, new {new}")
            row += new


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("length", [5, 40, 100, 600, 1100])
def test_bf16_prefill_attention_is_pytorch_flash_attention_bit_for_bit(length):
    """A bf16 prompt's attention computes what PyTorch's CPU flash attention (transformers'
    bf16 prompt forward) computes: per query the same scores, exp (fexp_u20 on whole
    vectors of a 512-key chunk, expf on its tail, the tail counted over the whole prompt),
    lane sums, bf16 numerators and chunk rescaling, so the outputs agree bit for bit but for
    float32 summation-order ties (>= 99.9% of the elements)."""
    assert _share_equal_to_flash_attention(length) >= 0.999


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.amx_available(),
                    reason="no AMX")
@pytest.mark.parametrize("length", [600, 1100, 2000])
def test_bf16_prefill_attention_on_amx_tiles_sums_as_pytorch_does_on_them(length):
    """Where the CPU has AMX, q . K and P . V run on the tiles, as PyTorch's flash attention
    does there (oneDNN's brgemm): the tiles' own order of sums is PyTorch's too, so >= 99.99%
    of the outputs are bit-equal (the AVX-512 pairs' order measured 99.89-99.92% on this
    test's prompts on an AMX Xeon)."""
    assert _share_equal_to_flash_attention(length) >= 0.9999


def _share_equal_to_flash_attention(length: int) -> float:
    """The share of the kernel's outputs bit-equal to PyTorch SDPA's for one causal bf16 prompt
    of `length` tokens (12 query heads over 4 KV heads of 64, shuffled slots)."""
    g = torch.Generator().manual_seed(length)
    heads, kvh, d, bs = 12, 4, 64, 16
    blocks = -(-length // bs) + 3
    cache = torch.zeros(2, blocks, bs, kvh, d, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * bs, generator=g)[:length]
    q = (torch.randn(length, heads, d, generator=g) * 2).to(torch.bfloat16)
    k, v = (torch.randn(length, kvh, d, generator=g).to(torch.bfloat16) for _ in range(2))
    cache[0].view(-1, kvh, d)[slots], cache[1].view(-1, kvh, d)[slots] = k, v
    out = torch.empty_like(q)
    spans = torch.tensor([[0, length, length, 0]], dtype=torch.int32)
    cpu_kernels.prefill_attention(q, cache, spans, slots, None, d ** -0.5, out)
    want = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)),
                                          is_causal=True, scale=d ** -0.5, enable_gqa=True)
    return int((out == want[0].transpose(0, 1)).sum()) / out.numel()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("kv_heads, length, prefix", [(1, 700, 0), (2, 300, 50), (4, 40, 0)])
def test_prefill_attention_does_not_depend_on_the_thread_count(kv_heads, length, prefix):
    """With few KV heads, a long span splits into row ranges, more with more threads (one
    item per thread would leave the others idle); every query's result stays the same."""
    g = torch.Generator().manual_seed(kv_heads)
    ctx = prefix + length
    cache = torch.randn(2, ctx // 16 + 4, 16, kv_heads, 64, generator=g).to(torch.bfloat16)
    slots = torch.randperm(cache.shape[1] * 16, generator=g)[:ctx]
    q = torch.randn(length, 4 * kv_heads, 64, generator=g).to(torch.bfloat16)
    spans = torch.tensor([[0, length, ctx, 0]], dtype=torch.int32)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            outs.append(torch.empty_like(q))
            cpu_kernels.prefill_attention(q, cache, spans, slots, None, 0.125, outs[-1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
def test_prefill_attention_checks_its_arguments():
    cache = torch.randn(2, 4, 16, 2, 16)
    q, out = torch.randn(10, 4, 16), torch.empty(10, 4, 16)
    slots = torch.arange(10)
    i32 = torch.int32
    cases = [
        (torch.tensor([[0, 10, 10, 0]], dtype=torch.int64), slots, "spans must be"),
        (torch.tensor([[5, 10, 10, 0]], dtype=i32), slots, "rows \\[5, 15\\) of 10"),
        (torch.tensor([[0, 10, 9, 0]], dtype=i32), slots, "with context 9"),
        (torch.tensor([[0, 0, 3, 0]], dtype=i32), slots, "rows \\[0, 0\\)"),
        (torch.tensor([[0, 10, 12, 0]], dtype=i32), slots, "12 slots from 0 exceed the 10"),
        (torch.tensor([[0, 10, 10, 0]], dtype=i32), slots + 60, "slot 64 of span 0"),
    ]
    for spans, sl, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cpu_kernels.prefill_attention(q, cache, spans, sl, None, 0.25, out)
    with pytest.raises(RuntimeError, match="out must have shape"):
        cpu_kernels.prefill_attention(q, cache, torch.tensor([[0, 10, 10, 0]], dtype=i32),
                                      slots, None, 0.25, out[:9])


def test_kernel_reads_strided_query_rows():
    """The model passes q as a view into the fused qkv output (rows wider than H * d)."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    rng = random.Random(1)
    meta, q, k, v, cache, seqs = build_case(rng, 12, 4, 64, 16)
    wide = torch.randn(q.shape[0], 20, 64)
    wide[:, :12] = q
    out = TorchAttentionBackend.forward(wide[:, :12], k, v, cache.clone(), meta, 0.125, None)
    ref = TorchAttentionBackend.forward(q.contiguous(), k, v, cache.clone(), meta, 0.125, None)
    torch.testing.assert_close(out, ref)


def _fused_and_module_outputs(tiny_models, monkeypatch, prompts, params, **llm_kwargs) -> dict:
    """{tiny model: (outputs with the one-call layers, outputs module by module)}, each output
    a completion's (token ids, [{token: logprob}])."""
    from fleetllm import LLM
    from fleetllm.model import fused

    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    state = {"on": True}
    applies = fused.applies
    monkeypatch.setattr(fused, "applies", lambda *a: state["on"] and applies(*a))
    runs = {}
    for name in ("llama_gqa", "qwen2_bias"):
        results = []
        for on in (True, False):
            state["on"] = on
            with LLM(tiny_models[name], kv_cache_memory=16 << 20, **llm_kwargs) as llm:
                outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([(c.token_ids, [{k: v.logprob for k, v in d.items()}
                                           for d in c.logprobs])
                            for o in outs for c in o.outputs])
        runs[name] = tuple(results)
    return runs


def test_fused_small_batch_layers_match_the_modules(tiny_models, monkeypatch):
    """Decode steps of up to 8 sequences run each layer as one C call: same tokens and
    logprobs as the module-by-module path (biases, GQA; 7 sequences, so the kernel's second
    group of 4 rows runs too)."""
    from fleetllm import SamplingParams
    from fleetllm.model import fused

    prompts = [{"prompt_token_ids": list(range(7 + i, 40 + 9 * i))} for i in range(7)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    state = {"calls": 0, "rows": 0}
    run_layers = fused.run_layers

    def counted(*args):
        out = run_layers(*args)
        if out is not None:
            state["calls"] += 1
            state["rows"] = max(state["rows"], args[2].shape[0])
        return out

    monkeypatch.setattr(fused, "run_layers", counted)
    runs = _fused_and_module_outputs(tiny_models, monkeypatch, prompts, params)
    for name, (fused_out, modules_out) in runs.items():
        for (ta, la), (tb, lb) in zip(fused_out, modules_out, strict=True):
            assert ta == tb, name
            for da, db in zip(la, lb, strict=True):
                assert da.keys() == db.keys()
                assert all(abs(da[k] - db[k]) < 1e-4 for k in da), name
    assert state["calls"] > 0 and state["rows"] == 7  # the fused path ran, 7 rows at most


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_past_the_gemv_limit_give_the_modules_bits(tiny_models, monkeypatch, dtype):
    """Decode steps of more sequences than the GEMV kernel takes (8; 16 for bf16 on a CPU
    without bf16 packing) run each layer as one C call too, its projections through oneDNN's
    packed weights as the modules' kernels run them: tokens and logprobs exactly equal to
    the module-by-module path's (biases, GQA; 20 sequences)."""
    from fleetllm import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    state = {"rows": 0}
    decoder_layers = cpu_kernels.decoder_layers

    def counted(*args, **kwargs):
        if args[16] != LinearKind.GEMV:  # packed copies inside the one-call layers
            state["rows"] = max(state["rows"], args[0].shape[0])
        return decoder_layers(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "decoder_layers", counted)
    runs = _fused_and_module_outputs(tiny_models, monkeypatch, prompts, params, dtype=dtype)
    for name, (fused_out, modules_out) in runs.items():
        assert fused_out == modules_out, name
    assert state["rows"] == 20  # the packed weights ran inside the one-call layer


@pytest.mark.parametrize("small_kind", ["amx", "pairs"])
@pytest.mark.parametrize("sequences", [3, 9])
def test_fused_layers_beside_onednn_on_amx_give_the_modules_bits(tiny_models, monkeypatch,
                                                                  sequences, small_kind):
    """Where oneDNN runs on AMX (simulated here: only the choice of copies differs), a bf16
    projection keeps oneDNN's packed copy and a copy for small batches (for the kernels' AMX
    GEMM where the CPU has AMX, else by pairs), its dense weight freed: the one-call layers
    take the small copies up to their row limit (4 here for both) and oneDNN's above, with
    tokens and logprobs exactly the modules' (biases, GQA)."""
    from fleetllm import SamplingParams
    from fleetllm.model import linear_kernels as lk

    simulate_onednn_amx(monkeypatch, small_kind)
    monkeypatch.setattr(lk.Amx, "MAX_ROWS", lk.Pairs.SMALL_ROWS)
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(sequences)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    seen = set()
    decoder_layers = cpu_kernels.decoder_layers

    def counted(*args, **kwargs):
        seen.add((args[0].shape[0], args[16]))  # rows, the copies' kind
        return decoder_layers(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "decoder_layers", counted)
    runs = _fused_and_module_outputs(tiny_models, monkeypatch, prompts, params,
                                     dtype="bfloat16")
    for name, (fused_out, modules_out) in runs.items():
        assert fused_out == modules_out, name
    small = LinearKind.AMX if small_kind == "amx" else LinearKind.PAIRS
    assert seen == {(sequences, small if sequences <= lk.Pairs.SMALL_ROWS
                     else LinearKind.ONEDNN)}, seen


@pytest.mark.parametrize("variant", ["sdpa", "math32", "varlen"])
def test_decode_variants_match_dense_reference(variant, monkeypatch):
    """Each pure-PyTorch decode variant (FLEETLLM_CUDA_DECODE; varlen's packing with a
    per-sequence loop standing in for FlashAttention off CUDA), sliding windows included."""
    from fleetllm.attention import backend

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "usable", lambda *a: False)
    monkeypatch.setattr(backend, "_DECODE_VARIANT", variant)
    rng = random.Random(11)
    for case in range(30):
        heads, kv_heads = rng.choice([(4, 2), (4, 4), (12, 4), (8, 1)])
        d = rng.choice([16, 64])
        bs = rng.choice([1, 4, 16])
        window = rng.choice([None, 7, 20])
        meta, q, k, v, cache, seqs = build_case(rng, heads, kv_heads, d, bs)
        scale = d ** -0.5
        out = TorchAttentionBackend.forward(q, k, v, cache, meta, scale, window)
        row = 0
        for prefix, new, _, k_all, v_all in seqs:
            want = reference(q[row:row + new], k_all, v_all, prefix + new, new, scale, window)
            torch.testing.assert_close(out[row:row + new], want, atol=2e-5, rtol=1e-4,
                                       msg=f"{variant} case {case}: prefix {prefix}, new {new}")
            row += new
