// Fused elementwise ops (residual add + RMSNorm, SiLU * up, RoPE of q and k + the K/V cache
// write): one pass and at most one parallel region each instead of 2-6 torch kernels and their
// temporaries, and no parallel region at all for a few rows, where waking a sleeping thread
// costs more than the work. A whole decoder layer of a small decode batch as one call (its
// projections through gemv.cpp's GEMV, gemm.cpp's GEMM on weights packed by pairs, or the
// caller's oneDNN matmul): about 3 of the 21 ms of
// a batch-1 step on the 125M preset were the ~10 Python calls per layer it replaces. Each in
// float32 and bfloat16 (kernels.h).
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

template <class T, class C = T>
struct RowsCtx {
    const T *x, *w, *cos, *sin, *qkv;
    T *residual, *out, *q_out, *k_out;
    C *k_cache, *v_cache;
    const int64_t *slots;
    long row_stride;
    int H, I, KVH, D;
    float eps;
};

// As transformers' LlamaRMSNorm: (x + residual) is stored in T, normalized in float32,
// rounded to T, then times the weight (rounded again).
template <class T>
void rmsnorm_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const RowsCtx<T> *>(arg);
    const int H = c->H;
    for (long t = begin; t < end; t++) {
        const T *xr = c->x + t * H;
        const T *r = c->residual ? c->residual + t * H : xr;
        float ss = 0.f;
        if (c->residual) {
            T *rw = c->residual + t * H;
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < H; i++) {
                const float v = round_to<T>(to_f32(xr[i]) + to_f32(rw[i]));
                rw[i] = from_f32<T>(v);
                ss += v * v;
            }
        } else {
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < H; i++) ss += to_f32(r[i]) * to_f32(r[i]);
        }
        const float inv = 1.f / std::sqrt(ss / H + c->eps);
        T *o = c->out + t * H;
        #pragma omp simd
        for (int i = 0; i < H; i++)
            o[i] = from_f32<T>(round_to<T>(to_f32(r[i]) * inv) * to_f32(c->w[i]));
    }
}

template <class T>
void silu_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const RowsCtx<T> *>(arg);
    const int I = c->I;
    for (long t = begin; t < end; t++) {
        const T *g = c->x + t * 2 * I, *u = g + I;
        T *o = c->out + t * I;
        int i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        for (vec gv, uv; i + VEC_LANES <= I; i += VEC_LANES) {
            loadv(g + i, gv);
            loadv(u + i, uv);
            const vec s = round_lanes<T, vec, vec_u32>(gv / (1.f + exp_lanes(-gv)));
            store_lanes<T, vec, vec_u32, vec_h16>(o + i, s * uv);
        }
#endif
        for (; i < I; i++) {
            const float gi = to_f32(g[i]);
            o[i] = from_f32<T>(round_to<T>(gi / (1.f + exp_f32(-gi))) * to_f32(u[i]));
        }
    }
}

// As transformers' apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, each product and the
// sum stored in T.
template <class T>
inline void rope_row(const T *x, T *o, const T *cs, const T *sn, int half)
{
    #pragma omp simd
    for (int i = 0; i < half; i++) {
        const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
        const float c = to_f32(cs[i]), s = to_f32(sn[i]);
        o[i] = from_f32<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
        o[i + half] = from_f32<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
    }
}

template <class T, class C>
void rope_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const RowsCtx<T, C> *>(arg);
    const int H = c->H, KVH = c->KVH, D = c->D, half = D / 2;
    for (long t = begin; t < end; t++) {
        const T *row = c->qkv + t * c->row_stride;
        const T *cs = c->cos + t * half, *sn = c->sin + t * half;
        for (int h = 0; h < H; h++)
            rope_row(row + static_cast<long>(h) * D, c->q_out + (t * H + h) * D, cs, sn, half);
        T *ko = c->k_out + t * KVH * D;
        for (int h = 0; h < KVH; h++)
            rope_row(row + static_cast<long>(H + h) * D, ko + static_cast<long>(h) * D, cs, sn,
                     half);
        if (c->k_cache) {
            const long slot = c->slots[t] * KVH * D, n = static_cast<long>(KVH) * D;
            if constexpr (std::is_same_v<T, C>) {
                std::memcpy(c->k_cache + slot, ko, sizeof(T) * n);
                std::memcpy(c->v_cache + slot, row + static_cast<long>(H + KVH) * D,
                            sizeof(T) * n);
            } else {
                convert(ko, c->k_cache + slot, n);
                convert(row + static_cast<long>(H + KVH) * D, c->v_cache + slot, n);
            }
        }
    }
}

}  // namespace

template <class T>
void add_rmsnorm(const T *x, T *residual, const T *w, T *out, int rows, int H, float eps,
                 int nthreads)
{
    RowsCtx<T> c{};
    c.x = x;
    c.residual = residual;
    c.w = w;
    c.out = out;
    c.H = H;
    c.eps = eps;
    parallel_run(nthreads, rmsnorm_body<T>, &c, rows, 1 + PAR_MIN / H, rows <= SPIN_ROWS);
}

template <class T>
void silu_mul(const T *gu, T *out, int rows, int I, int nthreads)
{
    RowsCtx<T> c{};
    c.x = gu;
    c.out = out;
    c.I = I;
    parallel_run(nthreads, silu_body<T>, &c, rows, 1 + PAR_MIN / I, rows <= SPIN_ROWS);
}

template <class T, class C>
void rope_qk_kv(const T *qkv, long row_stride, const T *cos, const T *sin, T *q_out, T *k_out,
                C *k_cache, C *v_cache, const int64_t *slots, int rows, int H, int KVH, int D,
                int nthreads)
{
    RowsCtx<T, C> c{};
    c.qkv = qkv;
    c.row_stride = row_stride;
    c.cos = cos;
    c.sin = sin;
    c.q_out = q_out;
    c.k_out = k_out;
    c.k_cache = k_cache;
    c.v_cache = v_cache;
    c.slots = slots;
    c.H = H;
    c.KVH = KVH;
    c.D = D;
    parallel_run(nthreads, rope_body<T, C>, &c, rows, 1 + PAR_MIN / ((H + 2 * KVH) * D),
                 rows <= SPIN_ROWS);
}

// Floats reserved for a layer's activations (a bf16 layer uses half of them).
static long activation_floats(const LayerDims &d)
{
    const long qkv_dim = static_cast<long>(d.H + 2 * d.KVH) * d.D;
    return static_cast<long>(d.T) * (2L * d.hid + qkv_dim + 2L * d.H * d.D
                                     + static_cast<long>(d.KVH) * d.D + 3L * d.I);
}

// The activations, then one scratch area that paged_decode and the GEMVs' widened x take in
// turn.
long decoder_layer_work(const LayerDims &d, int maxlen, int nthreads)
{
    const long widest = std::max({d.hid, d.H * d.D, d.I});
    return activation_floats(d) + std::max(paged_decode_scratch(d.H, d.D, d.bs, maxlen, nthreads),
                                           static_cast<long>(d.T) * widest);
}

template <class T, class C>
void decoder_layer(const T *x, T *residual, bool first, T *out, const LayerWeights<T> &w,
                   const LayerDims &d, const T *cos, const T *sin, C *k_cache, C *v_cache,
                   const int64_t *slots, const DecodeBatch &batch, float *work, int nthreads)
{
    const int T_ = d.T, hid = d.hid, H = d.H, KVH = d.KVH, D = d.D, I = d.I;
    const int qkv_dim = (H + 2 * KVH) * D;
    // The activations in T (as many floats are reserved: a bf16 layer uses half), then the
    // float scratch of the attention and of the GEMVs.
    T *normed = reinterpret_cast<T *>(work), *qkv = normed + static_cast<long>(T_) * hid;
    T *q = qkv + static_cast<long>(T_) * qkv_dim, *k = q + static_cast<long>(T_) * H * D;
    T *att = k + static_cast<long>(T_) * KVH * D, *o = att + static_cast<long>(T_) * H * D;
    T *gu = o + static_cast<long>(T_) * hid, *act = gu + static_cast<long>(T_) * 2 * I;
    float *scratch = work + activation_floats(d);
    // A projection's result: in y (the GEMV kernel), or where the caller's projection put it.
    const auto project = [&](int which, const T *in, const T *wt, const T *b, T *y, int n,
                             int k) -> const T * {
        if (w.project != nullptr)
            return static_cast<const T *>(w.project(w.project_ctx, which, in));
        if constexpr (std::is_same_v<T, bf16>) {
            if (w.packed[which] != nullptr) {
                // o and down add their bias after the matmul's rounding, as RowParallelLinear
                // adds it after the all-reduce: the modules' bits
                const bool after = which == 1 || which == 3;
                w.gemm(in, w.packed[which], after ? nullptr : b, y, T_, n, k, nthreads);
                if (after && b != nullptr)
                    for (long i = 0; i < static_cast<long>(T_) * n; i++)
                        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(b[i % n]));
                return y;
            }
        }
        gemv<T>(in, wt, b, y, T_, n, k, scratch, nthreads);
        return y;
    };
    if (first) {
        std::memcpy(residual, x, sizeof(T) * static_cast<size_t>(T_) * hid);
        add_rmsnorm<T>(residual, nullptr, w.w_in, normed, T_, hid, w.eps, nthreads);
    } else {
        add_rmsnorm<T>(x, residual, w.w_in, normed, T_, hid, w.eps, nthreads);
    }
    const T *qkv_out = project(0, normed, w.w_qkv, w.b_qkv, qkv, qkv_dim, hid);
    rope_qk_kv<T, C>(qkv_out, qkv_dim, cos, sin, q, k, k_cache, v_cache, slots, T_, H, KVH, D,
                     nthreads);
    paged_decode<T, C>(q, static_cast<long>(H) * D, k_cache, v_cache, batch, att, T_, H, KVH,
                       D, d.bs, d.window, d.scale, scratch, nthreads);
    const T *o_out = project(1, att, w.w_o, w.b_o, o, hid, H * D);
    add_rmsnorm<T>(o_out, residual, w.w_post, normed, T_, hid, w.eps, nthreads);
    const T *gu_out = project(2, normed, w.w_gu, w.b_gu, gu, 2 * I, hid);
    silu_mul<T>(gu_out, act, T_, I, nthreads);
    const T *down = project(3, act, w.w_down, w.b_down, out, hid, I);
    if (down != out)
        std::memcpy(out, down, sizeof(T) * static_cast<size_t>(T_) * hid);
}

#define FLEETLLM_ROW_OPS(T)                                                                   \
    template void add_rmsnorm<T>(const T *, T *, const T *, T *, int, int, float, int);      \
    template void silu_mul<T>(const T *, T *, int, int, int);
#define FLEETLLM_CACHE_OPS(T, C)                                                              \
    template void rope_qk_kv<T, C>(const T *, long, const T *, const T *, T *, T *, C *, C *, \
                                   const int64_t *, int, int, int, int, int);                 \
    template void decoder_layer<T, C>(const T *, T *, bool, T *, const LayerWeights<T> &,     \
                                      const LayerDims &, const T *, const T *, C *, C *,      \
                                      const int64_t *, const DecodeBatch &, float *, int);
FLEETLLM_ROW_OPS(float)
FLEETLLM_ROW_OPS(bf16)
FLEETLLM_CACHE_OPS(float, float)
FLEETLLM_CACHE_OPS(float, bf16)
FLEETLLM_CACHE_OPS(bf16, float)
FLEETLLM_CACHE_OPS(bf16, bf16)

}  // namespace fleetllm::kernels
