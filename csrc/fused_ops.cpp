// Fused elementwise ops (residual add + RMSNorm, SiLU * up, RoPE of q and k + the K/V cache
// write): one pass and at most one parallel region each instead of 2-6 torch kernels and their
// temporaries, and no parallel region at all for a few rows, where waking a sleeping thread
// costs more than the work. A small-M GEMV streaming a dense [out, in] weight at the memory's
// bandwidth (oneDNN and MKL stream it at half that for 1-4 rows). A whole decoder layer of a
// small decode batch as one call: about 3 of the 21 ms of a batch-1 step on the 125M preset
// were the ~10 Python calls per layer it replaces.
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

struct RowsCtx {
    const float *x, *w, *cos, *sin, *qkv;
    float *residual, *out, *q_out, *k_out, *k_cache, *v_cache;
    const int64_t *slots;
    long row_stride;
    int H, I, KVH, D;
    float eps;
};

void rmsnorm_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const RowsCtx *>(arg);
    const int H = c->H;
    for (long t = begin; t < end; t++) {
        const float *xr = c->x + t * H;
        const float *r = c->residual ? c->residual + t * H : xr;
        float ss = 0.f;
        if (c->residual) {
            float *rw = c->residual + t * H;
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < H; i++) { const float v = xr[i] + rw[i]; rw[i] = v; ss += v * v; }
        } else {
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < H; i++) ss += r[i] * r[i];
        }
        const float inv = 1.f / std::sqrt(ss / H + c->eps);
        float *o = c->out + t * H;
        #pragma omp simd
        for (int i = 0; i < H; i++) o[i] = (r[i] * inv) * c->w[i];
    }
}

void silu_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const RowsCtx *>(arg);
    const int I = c->I;
    for (long t = begin; t < end; t++) {
        const float *g = c->x + t * 2 * I, *u = g + I;
        float *o = c->out + t * I;
        #pragma omp simd
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
    }
}

inline void rope_row(const float *x, float *o, const float *c, const float *s, int half)
{
    #pragma omp simd
    for (int i = 0; i < half; i++) {
        o[i] = x[i] * c[i] - x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i] + x[i] * s[i];
    }
}

void rope_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const RowsCtx *>(arg);
    const int H = c->H, KVH = c->KVH, D = c->D, half = D / 2;
    for (long t = begin; t < end; t++) {
        const float *row = c->qkv + t * c->row_stride;
        const float *cs = c->cos + t * half, *sn = c->sin + t * half;
        for (int h = 0; h < H; h++)
            rope_row(row + static_cast<long>(h) * D, c->q_out + (t * H + h) * D, cs, sn, half);
        float *ko = c->k_out + t * KVH * D;
        for (int h = 0; h < KVH; h++)
            rope_row(row + static_cast<long>(H + h) * D, ko + static_cast<long>(h) * D, cs, sn,
                     half);
        if (c->k_cache) {
            const long slot = c->slots[t] * KVH * D;
            std::memcpy(c->k_cache + slot, ko, sizeof(float) * static_cast<size_t>(KVH) * D);
            std::memcpy(c->v_cache + slot, row + static_cast<long>(H + KVH) * D,
                        sizeof(float) * static_cast<size_t>(KVH) * D);
        }
    }
}

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for a few rows m: each weight row is streamed once
// per 4 rows of x, 4 weight rows at a time (16 independent FMA chains). Memory-bound: it runs
// at the machine's read bandwidth where a GEMM library re-packs or underuses it. may_alias:
// the vector loads read float arrays.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

template <int MT>
void gemv_tile(const float *x, const float *w, const float *bias, float *y, long n0, int N,
               int K)
{
    v16 acc[4][MT];
    std::memset(acc, 0, sizeof(acc));
    const int rows = N - n0 < 4 ? static_cast<int>(N - n0) : 4, kv = K & ~15;
    const float *wr[4];
    for (int r = 0; r < 4; r++) wr[r] = w + (n0 + (r < rows ? r : 0)) * K;
    for (int k = 0; k < kv; k += 16) {
        v16 xv[MT];
        for (int m = 0; m < MT; m++)
            xv[m] = *reinterpret_cast<const v16u *>(x + static_cast<long>(m) * K + k);
        for (int r = 0; r < 4; r++) {
            const v16 wv = *reinterpret_cast<const v16u *>(wr[r] + k);
            for (int m = 0; m < MT; m++) acc[r][m] += xv[m] * wv;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int m = 0; m < MT; m++) {
            float s = bias ? bias[n0 + r] : 0.f;
            for (int i = 0; i < 16; i++) s += acc[r][m][i];
            for (int k = kv; k < K; k++) s += x[static_cast<long>(m) * K + k] * wr[r][k];
            y[static_cast<long>(m) * N + n0 + r] = s;
        }
}

struct GemvCtx {
    const float *x, *w, *bias;
    float *y;
    int mt, N, K;
};

void gemv_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const GemvCtx *>(arg);
    for (long tile = begin; tile < end; tile++) {
        const long n0 = tile * 4;
        switch (c->mt) {
        case 1: gemv_tile<1>(c->x, c->w, c->bias, c->y, n0, c->N, c->K); break;
        case 2: gemv_tile<2>(c->x, c->w, c->bias, c->y, n0, c->N, c->K); break;
        case 3: gemv_tile<3>(c->x, c->w, c->bias, c->y, n0, c->N, c->K); break;
        default: gemv_tile<4>(c->x, c->w, c->bias, c->y, n0, c->N, c->K);
        }
    }
}

}  // namespace

void add_rmsnorm_f32(const float *x, float *residual, const float *w, float *out, int T, int H,
                     float eps, int nthreads)
{
    RowsCtx c{};
    c.x = x;
    c.residual = residual;
    c.w = w;
    c.out = out;
    c.H = H;
    c.eps = eps;
    parallel_run(nthreads, rmsnorm_body, &c, T, 1 + PAR_MIN / H, T <= SPIN_ROWS);
}

void silu_mul_f32(const float *gu, float *out, int T, int I, int nthreads)
{
    RowsCtx c{};
    c.x = gu;
    c.out = out;
    c.I = I;
    parallel_run(nthreads, silu_body, &c, T, 1 + PAR_MIN / I, T <= SPIN_ROWS);
}

void rope_qk_kv_f32(const float *qkv, long row_stride, const float *cos, const float *sin,
                    float *q_out, float *k_out, float *k_cache, float *v_cache,
                    const int64_t *slots, int T, int H, int KVH, int D, int nthreads)
{
    RowsCtx c{};
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
    parallel_run(nthreads, rope_body, &c, T, 1 + PAR_MIN / ((H + 2 * KVH) * D), T <= SPIN_ROWS);
}

void gemv_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
              int nthreads)
{
    const long tiles = (N + 3) / 4;
    // ~4 chunks per thread: long sequential streams, some balance; inline if small
    const long chunk = static_cast<long>(N) * K < 4 * PAR_MIN
                           ? tiles : 1 + tiles / (4 * (nthreads > 0 ? nthreads : 1));
    for (int m0 = 0; m0 < M; m0 += 4) {
        GemvCtx c{x + static_cast<long>(m0) * K, w, bias, y + static_cast<long>(m0) * N,
                  M - m0 < 4 ? M - m0 : 4, N, K};
        parallel_run(nthreads, gemv_body, &c, tiles, chunk, true);
    }
}

long decoder_layer_work(const LayerDims &d, int maxlen, int nthreads)
{
    const long qkv_dim = static_cast<long>(d.H + 2 * d.KVH) * d.D;
    const long acts = static_cast<long>(d.T) * (2L * d.hid + qkv_dim + 2L * d.H * d.D
                                                + static_cast<long>(d.KVH) * d.D + 3L * d.I);
    return acts + paged_decode_scratch(d.H, d.D, d.bs, maxlen, nthreads);
}

void decoder_layer_f32(const float *x, float *residual, bool first, float *out,
                       const LayerWeights &w, const LayerDims &d, const float *cos,
                       const float *sin, float *k_cache, float *v_cache, const int64_t *slots,
                       const DecodeBatch &batch, float *work, int nthreads)
{
    const int T = d.T, hid = d.hid, H = d.H, KVH = d.KVH, D = d.D, I = d.I;
    const int qkv_dim = (H + 2 * KVH) * D;
    float *normed = work, *qkv = normed + static_cast<long>(T) * hid;
    float *q = qkv + static_cast<long>(T) * qkv_dim, *k = q + static_cast<long>(T) * H * D;
    float *att = k + static_cast<long>(T) * KVH * D, *o = att + static_cast<long>(T) * H * D;
    float *gu = o + static_cast<long>(T) * hid, *act = gu + static_cast<long>(T) * 2 * I;
    float *scratch = act + static_cast<long>(T) * I;
    if (first) {
        std::memcpy(residual, x, sizeof(float) * static_cast<size_t>(T) * hid);
        add_rmsnorm_f32(residual, nullptr, w.w_in, normed, T, hid, w.eps, nthreads);
    } else {
        add_rmsnorm_f32(x, residual, w.w_in, normed, T, hid, w.eps, nthreads);
    }
    gemv_f32(normed, w.w_qkv, w.b_qkv, qkv, T, qkv_dim, hid, nthreads);
    rope_qk_kv_f32(qkv, qkv_dim, cos, sin, q, k, k_cache, v_cache, slots, T, H, KVH, D,
                   nthreads);
    paged_decode_f32(q, static_cast<long>(H) * D, k_cache, v_cache, batch, att, T, H, KVH, D,
                     d.bs, d.window, d.scale, scratch, nthreads);
    gemv_f32(att, w.w_o, w.b_o, o, T, hid, H * D, nthreads);
    add_rmsnorm_f32(o, residual, w.w_post, normed, T, hid, w.eps, nthreads);
    gemv_f32(normed, w.w_gu, w.b_gu, gu, T, 2 * I, hid, nthreads);
    silu_mul_f32(gu, act, T, I, nthreads);
    gemv_f32(act, w.w_down, w.b_down, out, T, hid, I, nthreads);
}

}  // namespace fleetllm::kernels
