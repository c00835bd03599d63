// The torch.ops.fleetllm.* operators: schemas (the dispatcher checks argument kinds and that
// tensors are on the CPU), checks of dtype (float32 or bfloat16: activations and weights of
// one, the KV cache of either), layout, shapes and index ranges (TORCH_CHECK:
// a RuntimeError in Python, never a wild read or write), allocation of outputs and scratch
// with at::empty (an allocation failure raises torch.OutOfMemoryError, which
// fleetllm.errors.as_out_of_memory classifies), then the kernels of kernels.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <climits>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "moe.h"
#include "quant_ops.h"

namespace fleetllm {
namespace {

using at::Tensor;
using kernels::bf16;
using std::optional;

int to_int(int64_t v, const char *what)
{
    TORCH_CHECK(v >= 0 && v <= INT_MAX, what, " out of range: ", v);
    return static_cast<int>(v);
}

// Activations, weights and KV caches: float32 or bfloat16 (kernels.h).
void check_float(const Tensor &t, const char *name, int64_t dim)
{
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                " must be float32 or bfloat16, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.sizes());
}

// Of the dtype the op runs in (its first tensor's), contiguous, of these sizes.
void check_dense(const Tensor &t, const char *name, at::IntArrayRef sizes, at::ScalarType type)
{
    check_float(t, name, static_cast<int64_t>(sizes.size()));
    TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, " as the op's input, got ",
                t.scalar_type());
    TORCH_CHECK(t.sizes() == sizes, name, " must have shape ", sizes, ", got ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A bf16 weight [out, in] packed by pairs (linear_kernels.Pairs): [ceil(out/48), in/2, 48, 2].
void check_pair_packed(const Tensor &w, int64_t out, int64_t in)
{
    constexpr int64_t P = kernels::PAIR_PANEL;
    check_dense(w, "packed", {(out + P - 1) / P, in / 2, P, 2}, at::kBFloat16);
}

// A weight packed for AMX tiles (linear_kernels.Amx): [N/32, K/32, 2, 16, 32] bf16.
void check_amx_packed(const Tensor &w, int64_t out, int64_t in)
{
    TORCH_CHECK(out % 32 == 0 && in % 32 == 0, "AMX-packed weights need in and out features "
                "that are multiples of 32, got ", in, " and ", out);
    check_dense(w, "packed", {out / 32, in / 32, 2, 16, 32}, at::kBFloat16);
}

void check_index(const Tensor &t, at::ScalarType type, const char *name, int64_t n)
{
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D tensor");
    TORCH_CHECK(n < 0 || t.size(0) == n, name, " must have ", n, " entries, got ", t.size(0));
}

// f(float{}) or f(bf16{}) by the tensor type: the kernels' instantiations.
template <class F>
void dispatch(at::ScalarType type, F &&f)
{
    if (type == at::kBFloat16)
        f(bf16{});
    else
        f(float{});
}

// f(T{}, C{}): activations in T, the KV cache in C.
template <class F>
void dispatch2(at::ScalarType t, at::ScalarType c, F &&f)
{
    dispatch(t, [&](auto a) { dispatch(c, [&](auto b) { f(a, b); }); });
}

template <class T>
const T *cptr(const Tensor &t)
{
    return static_cast<const T *>(t.const_data_ptr());
}

template <class T>
T *mptr(const Tensor &t)
{
    return static_cast<T *>(t.mutable_data_ptr());
}

template <class T>
const T *opt_ptr(const optional<Tensor> &t)
{
    return t.has_value() ? cptr<T>(*t) : nullptr;
}

struct Cache {
    int blocks, bs, kvh, d;
    long half;  // elements of the K half; V follows
};

// One layer's KV cache [2, num_blocks, block_size, KVH, D].
Cache check_cache(const Tensor &kv)
{
    check_float(kv, "kv_cache", 5);
    TORCH_CHECK(kv.is_contiguous() && kv.size(0) == 2,
                "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
    Cache c{to_int(kv.size(1), "num_blocks"), to_int(kv.size(2), "block_size"),
            to_int(kv.size(3), "kv_heads"), to_int(kv.size(4), "head_dim"), 0};
    TORCH_CHECK(c.bs > 0 && c.kvh > 0 && c.d > 0, "kv_cache has an empty dimension");
    c.half = static_cast<long>(c.blocks) * c.bs * c.kvh * c.d;
    return c;
}

// Every token's cache slot exists.
void check_slots(const Tensor &slots, int64_t t, const Cache &c)
{
    check_index(slots, at::kLong, "slots", t);
    const int64_t *s = slots.const_data_ptr<int64_t>(), num = static_cast<int64_t>(c.blocks) * c.bs;
    for (int64_t i = 0; i < t; i++)
        TORCH_CHECK(s[i] >= 0 && s[i] < num, "slot ", s[i], " of token ", i, " is outside the ",
                    num, " cache slots");
}

// Every sequence's context lies in blocks that exist. Returns the batch for the kernel.
kernels::DecodeBatch check_batch(const Tensor &tables, const Tensor &table_start,
                                 const Tensor &ctx_lens, int64_t b, const Cache &c)
{
    check_index(tables, at::kInt, "tables", -1);
    check_index(table_start, at::kInt, "table_start", b);
    check_index(ctx_lens, at::kInt, "ctx_lens", b);
    const int32_t *tab = tables.const_data_ptr<int32_t>();
    const int32_t *start = table_start.const_data_ptr<int32_t>();
    const int32_t *lens = ctx_lens.const_data_ptr<int32_t>();
    int maxlen = 0;
    for (int64_t i = 0; i < b; i++) {
        TORCH_CHECK(lens[i] > 0, "sequence ", i, " has context length ", lens[i]);
        const int64_t blocks = (static_cast<int64_t>(lens[i]) + c.bs - 1) / c.bs;
        TORCH_CHECK(start[i] >= 0 && start[i] + blocks <= tables.size(0), "sequence ", i,
                    "'s ", blocks, " blocks from table entry ", start[i], " exceed the ",
                    tables.size(0), " table entries");
        for (int64_t j = start[i]; j < start[i] + blocks; j++)
            TORCH_CHECK(tab[j] >= 0 && tab[j] < c.blocks, "table entry ", j, " names block ",
                        tab[j], " of ", c.blocks);
        maxlen = lens[i] > maxlen ? lens[i] : maxlen;
    }
    return {tab, start, lens, maxlen};
}

// The step's RoPE tables, [T, (1,) head_dim / 2] each, in the activations' dtype.
void check_rope(const Tensor &cos, const Tensor &sin, int64_t t, int d, at::ScalarType type)
{
    for (const Tensor *table : {&cos, &sin}) {
        TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == type,
                    "cos and sin must be ", type, " CPU tensors");
        TORCH_CHECK(table->is_contiguous() && table->dim() >= 1 && table->size(0) == t
                    && table->numel() == t * (d / 2),
                    "cos and sin must be contiguous [T, (1,) head_dim / 2], got ", table->sizes());
    }
}

Tensor scratch(long floats)
{
    return at::empty({floats}, at::TensorOptions().dtype(at::kFloat));
}

void paged_decode(const Tensor &q, const Tensor &kv_cache, const Tensor &tables,
                  const Tensor &table_start, const Tensor &ctx_lens, int64_t window, double scale,
                  const Tensor &out)
{
    const Cache c = check_cache(kv_cache);
    check_float(q, "q", 3);
    const int b = to_int(q.size(0), "batch"), h = to_int(q.size(1), "heads");
    TORCH_CHECK(q.size(2) == c.d && h % c.kvh == 0, "q ", q.sizes(), " does not match kv_cache ",
                kv_cache.sizes(), " (heads a multiple of kv_heads, the same head_dim)");
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == c.d && (b <= 1 || q.stride(0) >= h * c.d),
                "q's heads and dims must be contiguous (rows may be strided)");
    check_dense(out, "out", {b, h, c.d}, q.scalar_type());
    const kernels::DecodeBatch batch = check_batch(tables, table_start, ctx_lens, b, c);
    const int nthreads = at::get_num_threads();
    Tensor work = scratch(kernels::paged_decode_scratch(h, c.d, c.bs, batch.maxlen, nthreads));
    dispatch2(q.scalar_type(), kv_cache.scalar_type(), [&](auto t, auto cache) {
        using T = decltype(t);
        using C = decltype(cache);
        const C *k = cptr<C>(kv_cache);
        kernels::paged_decode<T, C>(cptr<T>(q), q.stride(0), k, k + c.half, batch, mptr<T>(out),
                                    b, h, c.kvh, c.d, c.bs, to_int(window, "window"),
                                    static_cast<float>(scale), mptr<float>(work), nthreads);
    });
}

void prefill_attention(const Tensor &q, const Tensor &kv_cache, const Tensor &spans,
                       const Tensor &slots, int64_t window, double scale, const Tensor &out)
{
    const Cache c = check_cache(kv_cache);
    check_float(q, "q", 3);
    const int t = to_int(q.size(0), "tokens"), h = to_int(q.size(1), "heads");
    TORCH_CHECK(q.size(2) == c.d && h % c.kvh == 0, "q ", q.sizes(), " does not match kv_cache ",
                kv_cache.sizes(), " (heads a multiple of kv_heads, the same head_dim)");
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == c.d && (t <= 1 || q.stride(0) >= h * c.d),
                "q's heads and dims must be contiguous (rows may be strided)");
    check_dense(out, "out", {t, h, c.d}, q.scalar_type());
    TORCH_CHECK(spans.device().is_cpu() && spans.scalar_type() == at::kInt && spans.dim() == 2
                && spans.size(1) == 4 && spans.is_contiguous(),
                "spans must be a contiguous int32 [S, 4] CPU tensor");
    check_index(slots, at::kLong, "slots", -1);
    const int S = to_int(spans.size(0), "spans");
    const int32_t *sp = spans.const_data_ptr<int32_t>();
    const int64_t *sl = slots.const_data_ptr<int64_t>();
    const int64_t num = static_cast<int64_t>(c.blocks) * c.bs;
    int maxctx = 0;
    for (int i = 0; i < S; i++) {
        const int32_t q0 = sp[4 * i], ql = sp[4 * i + 1], ctx = sp[4 * i + 2], s0 = sp[4 * i + 3];
        TORCH_CHECK(ql > 0 && q0 >= 0 && q0 + static_cast<int64_t>(ql) <= t && ctx >= ql,
                    "span ", i, ": rows [", q0, ", ", q0 + static_cast<int64_t>(ql), ") of ", t,
                    " with context ", ctx);
        TORCH_CHECK(s0 >= 0 && s0 + static_cast<int64_t>(ctx) <= slots.size(0), "span ", i,
                    "'s ", ctx, " slots from ", s0, " exceed the ", slots.size(0), " slots");
        for (int64_t j = s0; j < s0 + ctx; j++)
            TORCH_CHECK(sl[j] >= 0 && sl[j] < num, "slot ", sl[j], " of span ", i,
                        " is outside the ", num, " cache slots");
        maxctx = ctx > maxctx ? ctx : maxctx;
    }
    const int nthreads = at::get_num_threads();
    Tensor work = scratch(kernels::prefill_attention_scratch(h, c.kvh, c.d, maxctx, nthreads));
    dispatch2(q.scalar_type(), kv_cache.scalar_type(), [&](auto tq, auto cache) {
        using T = decltype(tq);
        using C = decltype(cache);
        const C *k = cptr<C>(kv_cache);
        kernels::prefill_attention<T, C>(cptr<T>(q), q.stride(0), k, k + c.half, sp, S, sl,
                                         mptr<T>(out), h, c.kvh, c.d, to_int(window, "window"),
                                         static_cast<float>(scale), maxctx, mptr<float>(work),
                                         nthreads);
    });
}

Tensor add_rmsnorm(const Tensor &x, const optional<Tensor> &residual, const Tensor &weight,
                   double eps)
{
    check_float(x, "x", 2);
    const int t = to_int(x.size(0), "rows"), h = to_int(x.size(1), "hidden size");
    TORCH_CHECK(h > 0 && x.is_contiguous(), "x must be a contiguous [T, H], H > 0");
    if (residual.has_value())
        check_dense(*residual, "residual", {t, h}, x.scalar_type());
    check_dense(weight, "weight", {h}, x.scalar_type());
    Tensor out = at::empty({t, h}, x.options());
    dispatch(x.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        kernels::add_rmsnorm<T>(cptr<T>(x), residual ? mptr<T>(*residual) : nullptr,
                                cptr<T>(weight), mptr<T>(out), t, h, static_cast<float>(eps),
                                at::get_num_threads());
    });
    return out;
}

Tensor silu_mul(const Tensor &gate_up)
{
    check_float(gate_up, "gate_up", 2);
    const int t = to_int(gate_up.size(0), "rows"), two_i = to_int(gate_up.size(1), "width");
    TORCH_CHECK(gate_up.is_contiguous() && two_i > 0 && two_i % 2 == 0,
                "gate_up must be a contiguous [T, 2I], I > 0");
    Tensor out = at::empty({t, two_i / 2}, gate_up.options());
    dispatch(gate_up.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        kernels::silu_mul<T>(cptr<T>(gate_up), mptr<T>(out), t, two_i / 2,
                             at::get_num_threads());
    });
    return out;
}

std::tuple<Tensor, Tensor> rope_qk_kv(const Tensor &qkv, const Tensor &cos, const Tensor &sin,
                                      int64_t heads, int64_t kv_heads,
                                      const optional<Tensor> &kv_cache,
                                      const optional<Tensor> &slots)
{
    check_float(qkv, "qkv", 2);
    const int t = to_int(qkv.size(0), "rows"), h = to_int(heads, "heads");
    const int kvh = to_int(kv_heads, "kv_heads");
    const int64_t width = qkv.size(1);
    TORCH_CHECK(h > 0 && kvh > 0 && width % (h + 2 * kvh) == 0 && width / (h + 2 * kvh) % 2 == 0,
                "qkv's width ", width, " is not (heads + 2 kv_heads) * an even head_dim");
    const int d = to_int(width / (h + 2 * kvh), "head_dim");
    TORCH_CHECK(d > 0 && qkv.stride(1) == 1 && (t <= 1 || qkv.stride(0) >= width),
                "qkv's rows must be contiguous (they may be strided)");
    check_rope(cos, sin, t, d, qkv.scalar_type());
    TORCH_CHECK(kv_cache.has_value() == slots.has_value(), "kv_cache and slots go together");
    Cache c{};
    if (kv_cache) {
        c = check_cache(*kv_cache);
        TORCH_CHECK(c.kvh == kvh && c.d == d, "kv_cache ", kv_cache->sizes(),
                    " does not match kv_heads ", kvh, ", head_dim ", d);
        check_slots(*slots, t, c);
    }
    Tensor q = at::empty({t, h, d}, qkv.options()), k = at::empty({t, kvh, d}, qkv.options());
    const at::ScalarType cache_type = kv_cache ? kv_cache->scalar_type() : qkv.scalar_type();
    dispatch2(qkv.scalar_type(), cache_type, [&](auto tag, auto cache) {
        using T = decltype(tag);
        using C = decltype(cache);
        C *k_cache = kv_cache ? mptr<C>(*kv_cache) : nullptr;
        kernels::rope_qk_kv<T, C>(cptr<T>(qkv), qkv.stride(0), cptr<T>(cos), cptr<T>(sin),
                                  mptr<T>(q), mptr<T>(k), k_cache,
                                  k_cache ? k_cache + c.half : nullptr,
                                  slots ? slots->const_data_ptr<int64_t>() : nullptr, t, h, kvh,
                                  d, at::get_num_threads());
    });
    return {q, k};
}

Tensor gemv(const Tensor &x, const Tensor &weight, const optional<Tensor> &bias)
{
    check_float(x, "x", 2);
    check_float(weight, "weight", 2);
    const int m = to_int(x.size(0), "rows"), k = to_int(x.size(1), "in_features");
    const int n = to_int(weight.size(0), "out_features");
    const at::ScalarType type = x.scalar_type();
    check_dense(x, "x", {m, k}, type);
    check_dense(weight, "weight", {n, k}, type);
    if (bias)
        check_dense(*bias, "bias", {n}, type);
    Tensor y = at::empty({m, n}, x.options());
    Tensor xf = scratch(type == at::kBFloat16 ? static_cast<long>(m) * k : 0);
    dispatch(type, [&](auto tag) {
        using T = decltype(tag);
        kernels::gemv<T>(cptr<T>(x), cptr<T>(weight), opt_ptr<T>(bias), mptr<T>(y), m, n, k,
                         mptr<float>(xf), at::get_num_threads());
    });
    return y;
}

// y = x @ w^T (+ bias) for a bf16 x [m, k] and a weight packed for one of the kernels' GEMMs
// (check: its layout's shape check; gemm: the kernel, false where the CPU lacks `needs`).
template <class Check, class Gemm>
Tensor packed_gemm(const char *name, const char *needs, const Tensor &x, const Tensor &packed,
                   const optional<Tensor> &bias, int64_t n, Check check, Gemm gemm)
{
    check_float(x, "x", 2);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": x must be bfloat16, got ",
                x.scalar_type());
    const int m = to_int(x.size(0), "rows"), k = to_int(x.size(1), "in_features");
    const int out = to_int(n, "out_features");
    check_dense(x, "x", {m, k}, at::kBFloat16);
    check(packed, out, k);
    if (bias)
        check_dense(*bias, "bias", {out}, at::kBFloat16);
    Tensor y = at::empty({m, out}, x.options());
    TORCH_CHECK(gemm(cptr<kernels::bf16>(x), cptr<kernels::bf16>(packed),
                     opt_ptr<kernels::bf16>(bias), mptr<kernels::bf16>(y), m, out, k,
                     at::get_num_threads()),
                name, ": needs ", needs);
    return y;
}

Tensor gemm_pairs(const Tensor &x, const Tensor &packed, const optional<Tensor> &bias, int64_t n)
{
    TORCH_CHECK(x.dim() != 2 || (x.size(1) % 2 == 0 && n > 0), "gemm_pairs: in_features must "
                "be even and out_features positive, got ", x.size(-1), " and ", n);
    return packed_gemm("gemm_pairs", "AVX2 or AVX-512 (kernels.gemm_pairs_available())", x,
                       packed, bias, n, check_pair_packed, kernels::gemm_pairs);
}

// Every AVX-512 build (by vdpbf16ps or by FMAs: kernels::pairs_by_fma) and AVX2 build (by
// FMAs: gemm_avx2.h).
bool gemm_pairs_available()
{
#if defined(__AVX512F__) || defined(__AVX2__)
    return true;
#else
    return false;
#endif
}

Tensor gemm_amx(const Tensor &x, const Tensor &packed, const optional<Tensor> &bias, int64_t n)
{
    return packed_gemm("gemm_amx", "AMX (kernels.amx_available())", x, packed, bias, n,
                       check_amx_packed, kernels::gemm_amx);
}

bool amx_available() { return kernels::amx_available(); }

// MKL's packed sgemm for float32 projections (mkl_sgemm.cpp): the packed weight is a uint8
// tensor of kernels::mkl_pack_bytes(n, k) bytes.
bool mkl_available() { return kernels::mkl_packed_available(); }

void check_mkl_packed(const Tensor &packed, int64_t n, int64_t k)
{
    TORCH_CHECK(kernels::mkl_packed_available(), "mkl_linear: needs MKL on an Intel CPU "
                "(kernels.mkl_available())");
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                    packed.dim() == 1 && packed.is_contiguous(),
                "an MKL-packed weight must be a contiguous 1-d uint8 CPU tensor, got ",
                packed.scalar_type(), " ", packed.sizes());
    TORCH_CHECK(packed.numel() >= static_cast<int64_t>(kernels::mkl_pack_bytes(
                                      to_int(n, "out_features"), to_int(k, "in_features"))),
                "an MKL-packed weight of ", packed.numel(), " bytes is too small for [", n,
                ", ", k, "]");
}

Tensor mkl_pack(const Tensor &weight)
{
    check_float(weight, "weight", 2);
    const int n = to_int(weight.size(0), "out_features");
    const int k = to_int(weight.size(1), "in_features");
    check_dense(weight, "weight", {n, k}, at::kFloat);
    TORCH_CHECK(kernels::mkl_packed_available(), "mkl_pack: needs MKL on an Intel CPU "
                "(kernels.mkl_available())");
    Tensor out = at::empty({static_cast<int64_t>(kernels::mkl_pack_bytes(n, k))},
                           weight.options().dtype(at::kByte));
    kernels::mkl_pack(cptr<float>(weight), n, k, out.mutable_data_ptr());
    return out;
}

// x @ w^T (+ bias) as F.linear computes it: the bias rows first, the product added to them.
Tensor mkl_linear(const Tensor &x, const Tensor &packed, const optional<Tensor> &bias, int64_t n)
{
    check_float(x, "x", 2);
    const int m = to_int(x.size(0), "rows"), k = to_int(x.size(1), "in_features");
    check_dense(x, "x", {m, k}, at::kFloat);
    check_mkl_packed(packed, n, k);
    if (bias)
        check_dense(*bias, "bias", {n}, at::kFloat);
    // One row with beta 1 gave MKL's GEMV path wrong sums (torch 2.13's MKL): there the bias
    // is added after the product, the same single rounding (a + b == b + a).
    const bool accumulate = bias.has_value() && m > 1;
    Tensor y = accumulate ? bias->expand({m, n}).contiguous() : at::empty({m, n}, x.options());
    if (m > 0)
        kernels::mkl_compute(cptr<float>(x), m, to_int(n, "out_features"), k,
                             packed.const_data_ptr(), mptr<float>(y), accumulate);
    if (bias && !accumulate)
        y.add_(*bias);
    return y;
}

// How the one-call paths read a projection (fleetllm/kernels/cpu_kernels.py LinearKind, set by
// the projection's kernel: model/linear_kernels.py): the dense weight through the GEMV, oneDNN's
// or MKL's packed copy, a copy packed for the kernels' own GEMMs (by pairs, AMX tiles), or
// GGUF: each projection's quantized packed copy (quant.h), or its dense weight where the file
// stores it unquantized.
enum LinearKind : int64_t { GEMV = 0, ONEDNN = 1, MKL = 2, PAIRS = 3, AMX = 4, GGUF = 5 };

void check_kind(int64_t kind, const char *name)
{
    TORCH_CHECK(kind >= GEMV && kind <= GGUF, name, ": ", kind, " is not a LinearKind (0-5)");
}

// A GGUF-kind projection: the quantized copy, or a dense weight of the layer's dtype.
Tensor gguf_or_dense(const Tensor &x, const Tensor &w, const optional<Tensor> &bias)
{
    if (is_gguf_packed(w))
        return gguf_linear(x, w, bias);
    check_dense(w, "a GGUF layer's dense weight", {w.size(0), x.size(1)}, x.scalar_type());
    return gemv(x, w, bias);
}

// A decoder layer's projections through oneDNN's packed weights or MKL's (1-d bytes: float32
// on Intel CPUs, mkl_linear) (decoder_layer's `packed`; weights packed for the kernels' own
// GEMMs the layer multiplies itself), computed as
// model/layers.py's linear() and the Linear modules compute them, so that the one-call layer
// gives the modules' bits: the packed matmul with the bias inside for qkv and
// gate_up, added after it for o and down (RowParallelLinear adds its bias after the
// all-reduce); a bfloat16 layer whose packed copy is float32 (a CPU without bf16 packing)
// multiplies its rows widened to float32 and rounds the result once.
struct PackedProjections {
    Tensor weight[4], result[4];
    const optional<Tensor> *bias[4];
    int64_t rows, in[4], out[4];
    at::ScalarType type;
    int64_t kind;
};

const void *project_packed(void *ctx, int which, const void *x)
{
    PackedProjections &p = *static_cast<PackedProjections *>(ctx);
    const Tensor &w = p.weight[which];
    const bool bias_after = which == 1 || which == 3;
    const bool widen = w.scalar_type() != p.type;
    Tensor in = at::from_blob(const_cast<void *>(x), {p.rows, p.in[which]},
                              at::TensorOptions().dtype(p.type));
    optional<Tensor> bias = bias_after ? optional<Tensor>() : *p.bias[which];
    if (widen) {
        in = in.to(at::kFloat);
        if (bias.has_value())
            bias = bias->to(at::kFloat);
    }
    Tensor out = p.kind == MKL    ? mkl_linear(in, w, bias, p.out[which])
                 : p.kind == GGUF ? gguf_or_dense(in, w, bias)
                                  : onednn_linear(in, w, bias);
    if (widen)
        out = out.to(p.type);
    if (bias_after && p.bias[which]->has_value())
        out = at::add(out, **p.bias[which]);
    out = out.contiguous();
    TORCH_CHECK(out.scalar_type() == p.type && out.numel() == p.rows * p.out[which],
                "decoder_layer: the packed projection ", which, " gave ", out.sizes());
    p.result[which] = out;  // kept alive for the rest of the layer
    return out.const_data_ptr();
}

Tensor decoder_layer(const Tensor &x, const Tensor &residual, bool first, const Tensor &w_in,
                     const Tensor &w_post, double eps, const Tensor &w_qkv,
                     const optional<Tensor> &b_qkv, const Tensor &w_o,
                     const optional<Tensor> &b_o, const Tensor &w_gu,
                     const optional<Tensor> &b_gu, const Tensor &w_down,
                     const optional<Tensor> &b_down, int64_t heads, int64_t window, double scale,
                     const Tensor &cos, const Tensor &sin, const Tensor &kv_cache,
                     const Tensor &slots, const Tensor &tables, const Tensor &table_start,
                     const Tensor &ctx_lens, const c10::List<optional<Tensor>> &packed,
                     int64_t kind)
{
    const Cache c = check_cache(kv_cache);
    check_float(x, "x", 2);
    check_kind(kind, "decoder_layer: kind");
    TORCH_CHECK(kind == GEMV ? packed.empty() : packed.size() == 4, "decoder_layer: kind ",
                kind, " needs ", kind == GEMV ? "no packed weight" : "4 packed weights",
                ", got ", packed.size());
    // Past the GEMV, packed weights are all the layer reads of its projections (the dense ones
    // may be gone: empty tensors here) and the intermediate size comes from down's packed copy,
    // [hid/48, I/2, 48, 2] by pairs, [hid/32, I/32, 2, 16, 32] for AMX tiles or oneDNN's
    // [hid, I]. (MKL's bytes say nothing of it: there the dense weights stay.)
    const bool by_pairs = kind == PAIRS, by_tiles = kind == AMX;
    const bool dense_down = kind == GEMV || kind == MKL;
    const Tensor inter_of = dense_down ? w_down : *packed.get(3);
    const bool gguf_down = kind == GGUF && is_gguf_packed(inter_of);
    if (!gguf_down)
        check_float(inter_of, dense_down ? "w_down" : "packed down",
                    by_pairs ? 4 : by_tiles ? 5 : 2);
    const int64_t inter = gguf_down  ? gguf_features(inter_of).first
                          : by_pairs ? 2 * inter_of.size(1)
                          : by_tiles ? 32 * inter_of.size(1) : inter_of.size(1);
    const at::ScalarType type = x.scalar_type();
    kernels::LayerDims d{to_int(x.size(0), "rows"), to_int(x.size(1), "hidden size"),
                         to_int(heads, "heads"), c.kvh, c.d, to_int(inter, "inter"),
                         c.bs, to_int(window, "window"), static_cast<float>(scale)};
    TORCH_CHECK(d.hid > 0 && d.H > 0 && d.I > 0 && d.H % d.KVH == 0 && d.D % 2 == 0,
                "decoder_layer: bad dimensions");
    const int64_t qkv_dim = static_cast<int64_t>(d.H + 2 * d.KVH) * d.D;
    check_dense(x, "x", {d.T, d.hid}, type);
    check_dense(residual, "residual", {d.T, d.hid}, type);
    check_dense(w_in, "w_in", {d.hid}, type);
    check_dense(w_post, "w_post", {d.hid}, type);
    if (kind == GEMV) {
        check_dense(w_qkv, "w_qkv", {qkv_dim, d.hid}, type);
        check_dense(w_o, "w_o", {d.hid, static_cast<int64_t>(d.H) * d.D}, type);
        check_dense(w_gu, "w_gu", {2L * d.I, d.hid}, type);
    }
    if (dense_down)  // the intermediate size came from the dense w_down
        check_dense(w_down, "w_down", {d.hid, d.I}, type);
    const std::tuple<const optional<Tensor> *, const char *, int64_t> biases[] = {
        {&b_qkv, "b_qkv", qkv_dim}, {&b_o, "b_o", d.hid}, {&b_gu, "b_gu", 2L * d.I},
        {&b_down, "b_down", d.hid}};
    for (const auto &[bias, name, n] : biases)
        if (bias->has_value())
            check_dense(**bias, name, {n}, type);
    check_rope(cos, sin, d.T, d.D, type);
    check_slots(slots, d.T, c);
    const kernels::DecodeBatch batch = check_batch(tables, table_start, ctx_lens, d.T, c);
    // packed: empty (GEMV: the kernel on the dense weights) or the packed weights of qkv, o,
    // gate_up, down, all of `kind`: oneDNN's or MKL's (project_packed), or by pairs or for
    // AMX tiles (the layer calls gemm_pairs or gemm_amx itself)
    PackedProjections proj{};
    const kernels::bf16 *own[4] = {};
    const bool own_gemm = by_pairs || by_tiles;
    if (kind != GEMV) {
        const int64_t in[4] = {d.hid, static_cast<int64_t>(d.H) * d.D, d.hid, d.I};
        const int64_t out[4] = {qkv_dim, d.hid, 2L * d.I, d.hid};
        for (int i = 0; i < 4; i++) {
            const optional<Tensor> w = packed.get(i);
            TORCH_CHECK(w.has_value() && w->device().is_cpu(),
                        "decoder_layer: packed weight ", i, " must be a CPU tensor");
            proj.weight[i] = *w;
            if (own_gemm) {
                TORCH_CHECK(type == at::kBFloat16, "decoder_layer: weights packed for the "
                            "kernels' GEMMs are bf16");
                if (by_pairs)
                    check_pair_packed(*w, out[i], in[i]);
                else
                    check_amx_packed(*w, out[i], in[i]);
                own[i] = cptr<kernels::bf16>(*w);
            } else if (kind == GGUF) {  // quantized (checked at each call) or dense
                if (is_gguf_packed(*w)) {
                    TORCH_CHECK(gguf_features(*w) == std::pair(in[i], out[i]),
                                "decoder_layer: packed quantized weight ", i, " must be [",
                                out[i], ", ", in[i], "]");
                } else {
                    check_dense(*w, "dense weight", {out[i], in[i]}, type);
                }
            } else if (kind == MKL) {  // MKL's packed sgemm (float32, dense weights kept)
                TORCH_CHECK(type == at::kFloat, "decoder_layer: MKL-packed weights are float32");
                check_mkl_packed(*w, out[i], in[i]);
            } else {  // oneDNN's (an opaque layout: its sizes are the dense weight's)
                TORCH_CHECK(w->is_mkldnn() && w->dim() == 2 && w->size(0) == out[i] &&
                                w->size(1) == in[i],
                            "decoder_layer: packed weight ", i, " must be oneDNN's [", out[i],
                            ", ", in[i], "], got ", w->sizes());
            }
            proj.bias[i] = std::get<0>(biases[i]);
            proj.in[i] = in[i];
            proj.out[i] = out[i];
        }
        TORCH_CHECK(!by_tiles || kernels::amx_available(),
                    "gemm_amx: needs AMX (kernels.amx_available())");
        proj.rows = d.T;
        proj.type = type;
        proj.kind = kind;
    }
    const int nthreads = at::get_num_threads();
    Tensor work = scratch(kernels::decoder_layer_work(d, batch.maxlen, nthreads));
    Tensor out = at::empty({d.T, d.hid}, x.options());
    dispatch2(type, kv_cache.scalar_type(), [&](auto tag, auto cache) {
        using T = decltype(tag);
        using C = decltype(cache);
        const kernels::LayerWeights<T> w{
            cptr<T>(w_in), cptr<T>(w_post), cptr<T>(w_qkv), opt_ptr<T>(b_qkv), cptr<T>(w_o),
            opt_ptr<T>(b_o), cptr<T>(w_gu), opt_ptr<T>(b_gu), cptr<T>(w_down),
            opt_ptr<T>(b_down), static_cast<float>(eps),
            kind == GEMV || own_gemm ? nullptr : &project_packed, &proj,
            {own[0], own[1], own[2], own[3]}, by_tiles ? kernels::gemm_amx
                                                       : kernels::gemm_pairs};
        C *k_cache = mptr<C>(kv_cache);
        kernels::decoder_layer<T, C>(cptr<T>(x), mptr<T>(residual), first, mptr<T>(out), w, d,
                                     cptr<T>(cos), cptr<T>(sin), k_cache, k_cache + c.half,
                                     slots.const_data_ptr<int64_t>(), batch,
                                     mptr<float>(work), nthreads);
    });
    return out;
}

// The rows of `table` ([V, ...], contiguous; a row is all past dim 0) at `ids` (int64 [T]):
// an embedding lookup, or the step's rows of the RoPE tables; each id checked to lie in
// [0, V) (`id` and `range` name them in the error). A plain loop, not at::index_select: that
// one opens an OpenMP region past 32K elements (~40 rows of 768), whose threads then spin
// beside the kernels' pool.
Tensor table_rows(const Tensor &ids, const Tensor &table, const char *id, const char *range)
{
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                range, ": the ids must be a contiguous int64 [T], got ", ids.sizes(), " ",
                ids.scalar_type());
    TORCH_CHECK(table.device().is_cpu() && table.dim() >= 1 && table.is_contiguous(),
                range, " must be a contiguous CPU tensor");
    const int64_t t = ids.size(0), v = table.size(0);
    const int64_t row = v ? table.numel() / v * table.element_size() : 0;
    std::vector<int64_t> shape(table.sizes().begin(), table.sizes().end());
    shape[0] = t;
    Tensor out = at::empty(shape, table.options());
    const int64_t *i = ids.const_data_ptr<int64_t>();
    const char *src = static_cast<const char *>(table.const_data_ptr());
    char *dst = static_cast<char *>(out.mutable_data_ptr());
    for (int64_t r = 0; r < t; r++) {
        TORCH_CHECK(i[r] >= 0 && i[r] < v, id, " ", i[r], " is outside the ", range, " [0, ",
                    v, ")");
        std::memcpy(dst + r * row, src + i[r] * row, static_cast<size_t>(row));
    }
    return out;
}

// Every decoder layer of a decode step in one call (model/fused.py, run_layers): decoder_layer
// for each in turn (the first setting the residual when `first`), so that Python and the
// dispatcher are crossed once a step, not once a layer (~8 us a layer here). weights: 10 a
// layer (w_in, w_post, w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down; the biases may be
// None); windows and kv_caches: one a layer; packed: none, or 4 a layer (decoder_layer's).
// With `embed` x is the step's token ids (int64 [T]) and the layers' input their rows of it;
// with `final_norm` the output is the model's final norm of (output + residual), as
// add_rmsnorm computes it. Both spare a step a Python module call and a dispatcher crossing
// that ran cold after the weights streamed by. cos and sin are the whole RoPE tables
// ([positions, (1,) d/2]) and the rows of the step's `positions` (int64 [T]) are looked up
// here: two index_selects fewer a step.
Tensor decoder_layers(const Tensor &x, const optional<Tensor> &embed, const Tensor &residual,
                      bool first, const c10::List<optional<Tensor>> &weights, double eps,
                      int64_t heads, c10::IntArrayRef windows, double scale, const Tensor &cos,
                      const Tensor &sin, const std::vector<Tensor> &kv_caches,
                      const Tensor &slots, const Tensor &tables, const Tensor &table_start,
                      const Tensor &ctx_lens, const c10::List<optional<Tensor>> &packed,
                      int64_t kind, const optional<Tensor> &final_norm,
                      const Tensor &positions)
{
    const size_t layers = kv_caches.size();
    TORCH_CHECK(layers > 0 && weights.size() == 10 * layers && windows.size() == layers &&
                    (packed.empty() || packed.size() == 4 * layers),
                "decoder_layers: ", layers, " caches need 10 weights, a window and no or 4 "
                "packed weights each; got ", weights.size(), ", ", windows.size(), ", ",
                packed.size());
    Tensor h = x;
    if (embed.has_value() && is_gguf_packed(*embed)) {  // a quantized embedding: its rows
        TORCH_CHECK(weights.get(0).has_value(), "decoder_layers: layer 0's w_in is None");
        h = gguf_rows(*embed, x, weights.get(0)->scalar_type());
    } else if (embed.has_value()) {
        check_float(*embed, "embed", 2);
        h = table_rows(x, *embed, "token id", "vocabulary");
    }
    const Tensor cos_rows = table_rows(positions, cos, "position", "RoPE tables");
    const Tensor sin_rows = table_rows(positions, sin, "position", "RoPE tables");
    for (size_t l = 0; l < layers; l++) {
        optional<Tensor> w[10];
        for (size_t i = 0; i < 10; i++)
            w[i] = weights.get(10 * l + i);
        for (size_t i : {0, 1, 2, 4, 6, 8})
            TORCH_CHECK(w[i].has_value(), "decoder_layers: layer ", l, "'s weight ", i,
                        " is None (only biases may be)");
        c10::List<optional<Tensor>> own;
        for (size_t i = 0; i < packed.size() / layers; i++)
            own.push_back(packed.get(4 * l + i));
        h = decoder_layer(h, residual, first && l == 0, *w[0], *w[1], eps, *w[2], w[3], *w[4],
                          w[5], *w[6], w[7], *w[8], w[9], heads, windows[l], scale, cos_rows,
                          sin_rows, kv_caches[l], slots, tables, table_start, ctx_lens, own,
                          kind);
    }
    return final_norm.has_value() ? add_rmsnorm(h, residual, *final_norm, eps) : h;
}

// The LM head's logits of h ([T, hid]) as its kernel computes them: `head` is the tensor its
// kernel reads at T rows, of `kind` (fused.run_passes picks both): the dense weight (GEMV),
// oneDNN's packed copy (a float32 copy of a bf16 weight takes h widened, the result rounded
// once), MKL's packed bytes, or packed by pairs or for AMX tiles. n: the head's outputs (the
// vocabulary: one rank).
Tensor head_logits(const Tensor &h, const Tensor &head, int64_t kind, int64_t n)
{
    const optional<Tensor> none;  // an LM head has no bias
    switch (kind) {
    case GEMV: return gemv(h, head, none);
    case ONEDNN:
        TORCH_CHECK(head.is_mkldnn(), "greedy_passes: a oneDNN head must be oneDNN's copy");
        return head.scalar_type() == h.scalar_type()
                   ? onednn_linear(h, head, none)
                   : onednn_linear(h.to(at::kFloat), head, none).to(h.scalar_type());
    case MKL: return mkl_linear(h, head, none, n);
    case PAIRS: return gemm_pairs(h, head, none, n);
    case GGUF: return gguf_or_dense(h, head, none);
    default: return gemm_amx(h, head, none, n);
    }
}

// Up to k greedy decode passes in one call (worker/greedy_passes.py, through fused.run_passes):
// each pass is decoder_layers (embedding, every layer, the final norm) at its row of
// `positions`, `slots` and `ctx_lens` ([k, T]), then the LM head (head_logits) and each row's
// argmax, which is the next pass's input: no Python between passes (~0.1 ms a token at batch
// 1, from cold caches after the weights stream). tables must hold the blocks of the last
// pass. `interrupts` (int64 [1], the rank's StepInterrupts, which another thread bumps while
// this call runs without the GIL) is read after each pass: a count other than
// interrupts_before (the multi-step call's) ends the call there. So does the pass after which
// every row has drawn one of its stop tokens (`stops`: int64 [T, S], -1 where a row has
// fewer; S may be 0): the engine ends each such sequence there and would discard the rest.
// Returns the tokens of the passes done (int64 [passes, T]).
Tensor greedy_passes(const Tensor &ids, const Tensor &embed,
                     const c10::List<optional<Tensor>> &weights, double eps, int64_t heads,
                     c10::IntArrayRef windows, double scale, const Tensor &cos,
                     const Tensor &sin, const std::vector<Tensor> &kv_caches,
                     const Tensor &slots, const Tensor &tables, const Tensor &table_start,
                     const Tensor &ctx_lens, const c10::List<optional<Tensor>> &packed,
                     int64_t kind, const Tensor &final_norm, const Tensor &positions,
                     const Tensor &head, int64_t head_kind, int64_t head_n, const Tensor &stops,
                     const Tensor &interrupts, int64_t interrupts_before)
{
    check_kind(head_kind, "greedy_passes: head_kind");
    const int64_t t = ids.size(0), k = positions.size(0);
    check_index(ids, at::kLong, "ids", t);
    for (const auto &[m, type, name] :
         {std::tuple{&positions, at::kLong, "positions"}, {&slots, at::kLong, "slots"},
          {&ctx_lens, at::kInt, "ctx_lens"}})
        TORCH_CHECK(m->dim() == 2 && m->size(0) == k && m->size(1) == t &&
                        m->scalar_type() == type && m->is_contiguous() && m->device().is_cpu(),
                    "greedy_passes: ", name, " must be a contiguous CPU ", type, " [", k, ", ",
                    t, "], got ", m->sizes(), " ", m->scalar_type());
    TORCH_CHECK(interrupts.numel() == 1 && interrupts.scalar_type() == at::kLong &&
                    interrupts.device().is_cpu() &&
                    reinterpret_cast<uintptr_t>(interrupts.const_data_ptr()) % 8 == 0,
                "greedy_passes: interrupts must be one aligned CPU int64");
    TORCH_CHECK(stops.dim() == 2 && stops.size(0) == t && stops.scalar_type() == at::kLong &&
                    stops.is_contiguous() && stops.device().is_cpu(),
                "greedy_passes: stops must be a contiguous CPU Long [", t, ", S], got ",
                stops.sizes(), " ", stops.scalar_type());
    const int64_t s = stops.size(1), *stop = stops.const_data_ptr<int64_t>();
    std::vector<char> ended(t, 0);
    const auto *count = interrupts.const_data_ptr<int64_t>();
    Tensor tokens = at::empty({k, t}, at::TensorOptions().dtype(at::kLong));
    Tensor x = ids;
    int64_t done = 0;
    while (done < k) {
        const Tensor residual = at::empty({t, final_norm.size(0)}, final_norm.options());
        const Tensor h = decoder_layers(x, embed, residual, true, weights, eps, heads, windows,
                                        scale, cos, sin, kv_caches, slots[done], tables,
                                        table_start, ctx_lens[done], packed, kind, final_norm,
                                        positions[done]);
        const Tensor logits = head_logits(h, head, head_kind, head_n);
        check_float(logits, "logits", 2);
        TORCH_CHECK(logits.size(0) == t && logits.stride(1) == 1 && logits.size(1) > 0,
                    "greedy_passes: the LM head gave ", logits.sizes());
        x = tokens[done++];
        dispatch(logits.scalar_type(), [&](auto tag) {
            using T = decltype(tag);
            kernels::argmax<T>(cptr<T>(logits), logits.stride(0), static_cast<int>(t),
                               to_int(logits.size(1), "vocabulary"), mptr<int64_t>(x),
                               at::get_num_threads());
        });
        if (__atomic_load_n(count, __ATOMIC_ACQUIRE) != interrupts_before)
            break;
        if (s > 0) {
            const int64_t *drawn = x.const_data_ptr<int64_t>();
            bool all = true;
            for (int64_t r = 0; r < t; r++) {
                for (int64_t j = 0; j < s && !ended[r]; j++)
                    ended[r] = stop[r * s + j] == drawn[r];
                all = all && ended[r];
            }
            if (all)
                break;
        }
    }
    return tokens.narrow(0, 0, done);
}

Tensor argmax(const Tensor &x)
{
    check_float(x, "x", 2);
    const int rows = to_int(x.size(0), "rows"), n = to_int(x.size(1), "columns");
    TORCH_CHECK(n > 0, "argmax of rows of no elements");
    TORCH_CHECK(x.stride(1) == 1 && (rows <= 1 || x.stride(0) >= n), "x's rows must be "
                "contiguous (rows may be strided)");
    Tensor out = at::empty({rows}, at::TensorOptions().dtype(at::kLong));
    dispatch(x.scalar_type(), [&](auto t) {
        using T = decltype(t);
        kernels::argmax<T>(cptr<T>(x), x.stride(0), rows, n, mptr<int64_t>(out),
                           at::get_num_threads());
    });
    return out;
}

// What this library was built as: its instruction sets, sanitizers and thread mode (tests
// check that the variant asked for is the one loaded).
std::string build_info()
{
    std::string s = "isa:";
#if defined(__AVX512F__)
    s += " avx512f";
#endif
#if defined(__AVX2__)
    s += " avx2";
#endif
#if defined(__FMA__)
    s += " fma";
#endif
    if (kernels::bf16_dot)
        s += " avx512bf16";
    if (kernels::pairs_by_fma())
        s += " (pairs by fma)";
#if defined(__SANITIZE_ADDRESS__)
    s += "; sanitize: address,undefined";
#endif
    return s + "; threads: " + (torch_threads() ? "torch" : "pool");
}

}  // namespace
}  // namespace fleetllm

TORCH_LIBRARY(fleetllm, m)
{
    m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor tables, Tensor table_start, "
          "Tensor ctx_lens, int window, float scale, Tensor(a!) out) -> ()");
    m.def("prefill_attention(Tensor q, Tensor kv_cache, Tensor spans, Tensor slots, int window, "
          "float scale, Tensor(a!) out) -> ()");
    m.def("add_rmsnorm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("rope_qk_kv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, "
          "Tensor(a!)? kv_cache, Tensor? slots) -> (Tensor, Tensor)");
    m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("decoder_layer(Tensor x, Tensor(a!) residual, bool first, Tensor w_in, Tensor w_post, "
          "float eps, Tensor w_qkv, Tensor? b_qkv, Tensor w_o, Tensor? b_o, Tensor w_gu, "
          "Tensor? b_gu, Tensor w_down, Tensor? b_down, int heads, int window, float scale, "
          "Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slots, Tensor tables, "
          "Tensor table_start, Tensor ctx_lens, Tensor?[] packed, int kind) -> Tensor");
    m.def("decoder_layers(Tensor x, Tensor? embed, Tensor(a!) residual, bool first, "
          "Tensor?[] weights, float eps, int heads, int[] windows, float scale, Tensor cos, "
          "Tensor sin, Tensor(b!)[] kv_caches, Tensor slots, Tensor tables, Tensor table_start, "
          "Tensor ctx_lens, Tensor?[] packed, int kind, Tensor? final_norm, Tensor positions) "
          "-> Tensor");
    m.def("greedy_passes(Tensor ids, Tensor embed, Tensor?[] weights, float eps, int heads, "
          "int[] windows, float scale, Tensor cos, Tensor sin, Tensor(a!)[] kv_caches, "
          "Tensor slots, Tensor tables, Tensor table_start, Tensor ctx_lens, Tensor?[] packed, "
          "int kind, Tensor final_norm, Tensor positions, Tensor head, int head_kind, "
          "int head_n, Tensor stops, Tensor interrupts, int interrupts_before) -> Tensor");
    m.def("argmax(Tensor x) -> Tensor");
    m.def("gemm_pairs(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
    m.def("gemm_pairs_available() -> bool", &fleetllm::gemm_pairs_available);
    m.def("gemm_amx(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
    m.def("amx_available() -> bool", &fleetllm::amx_available);
    m.def("mkl_pack(Tensor weight) -> Tensor");
    m.def("mkl_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
    m.def("mkl_available() -> bool", &fleetllm::mkl_available);
    m.def("build_info() -> str", &fleetllm::build_info);
    m.def("fused_moe(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleetllm, CPU, m)
{
    m.impl("paged_decode", &fleetllm::paged_decode);
    m.impl("add_rmsnorm", &fleetllm::add_rmsnorm);
    m.impl("silu_mul", &fleetllm::silu_mul);
    m.impl("prefill_attention", &fleetllm::prefill_attention);
    m.impl("rope_qk_kv", &fleetllm::rope_qk_kv);
    m.impl("gemv", &fleetllm::gemv);
    m.impl("decoder_layer", &fleetllm::decoder_layer);
    m.impl("decoder_layers", &fleetllm::decoder_layers);
    m.impl("greedy_passes", &fleetllm::greedy_passes);
    m.impl("argmax", &fleetllm::argmax);
    m.impl("gemm_pairs", &fleetllm::gemm_pairs);
    m.impl("gemm_amx", &fleetllm::gemm_amx);
    m.impl("mkl_pack", &fleetllm::mkl_pack);
    m.impl("mkl_linear", &fleetllm::mkl_linear);
    m.impl("fused_moe", &fleetllm::fused_moe);
}

// oneDNN's packed float32 weights are opaque MkldnnCPU tensors; given as decoder_layer's
// `packed`, they make the dispatcher look for a MkldnnCPU kernel.
TORCH_LIBRARY_IMPL(fleetllm, MkldnnCPU, m)
{
    m.impl("decoder_layer", &fleetllm::decoder_layer);
    m.impl("decoder_layers", &fleetllm::decoder_layers);
    m.impl("greedy_passes", &fleetllm::greedy_passes);
}
