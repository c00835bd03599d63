// The CPU kernels on raw float32 buffers (paged_decode.cpp, fused_ops.cpp). Nothing here checks
// its arguments or allocates: ops.cpp checks every tensor against the op's schema and shapes
// and allocates outputs and scratch with at::empty (so an allocation failure is a c10 error,
// not a null pointer), then calls these.
#pragma once

#include <cmath>
#include <cstdint>

namespace fleetllm::kernels {

// Sizes at which work is split: below PAR_MIN elements an op runs on the calling thread alone
// (waking threads costs more); up to SPIN_ROWS rows (a small decode batch) the pool stays
// awake after a call, because the step's next kernel follows within microseconds.
constexpr long PAR_MIN = 32768;
constexpr int SPIN_ROWS = 4;

// The decode batch: seq b's blocks are tables[table_start[b]...], it attends to positions
// [max(0, len - window), len) of its context (window <= 0: all); maxlen: the largest len.
struct DecodeBatch {
    const int32_t *tables, *table_start, *ctx_lens;
    int maxlen;
};

// Floats of scratch paged_decode_f32 needs: per thread, scores of H heads over the longest
// context (plus a block at each end) and an H x D accumulator.
long paged_decode_scratch(int H, int D, int bs, int maxlen, int nthreads);

// out[b] = attention of q[b] (H heads of D floats; rows q_stride floats apart) over sequence
// b's context, read in place from one layer's k and v caches [num_blocks, bs, KVH, D].
// out: [B, H, D] contiguous.
void paged_decode_f32(const float *q, long q_stride, const float *k, const float *v,
                      const DecodeBatch &batch, float *out, int B, int H, int KVH, int D, int bs,
                      int window, float scale, float *scratch, int nthreads);

// residual (if not null) += x, in place; out = rmsnorm(residual or x) * w. [T, H] rows.
void add_rmsnorm_f32(const float *x, float *residual, const float *w, float *out, int T, int H,
                     float eps, int nthreads);

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu: [T, 2I], out: [T, I].
void silu_mul_f32(const float *gu, float *out, int T, int I, int nthreads);

// Neox RoPE of q and k from the fused qkv rows ([T] rows of (H + 2 KVH) * D floats, row_stride
// apart): q -> q_out [T, H, D], k -> k_out [T, KVH, D]; with caches (not null), k (rotated)
// and v are also written at each token's slot of the [num_slots, KVH, D] caches. cos, sin:
// [T, D/2].
void rope_qk_kv_f32(const float *qkv, long row_stride, const float *cos, const float *sin,
                    float *q_out, float *k_out, float *k_cache, float *v_cache,
                    const int64_t *slots, int T, int H, int KVH, int D, int nthreads);

// y = x @ w^T (+ bias): x [M, K], w [N, K], y [M, N], all contiguous; bias may be null.
void gemv_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
              int nthreads);

// One decoder layer's weights (contiguous; biases may be null).
struct LayerWeights {
    const float *w_in, *w_post, *w_qkv, *b_qkv, *w_o, *b_o, *w_gu, *b_gu, *w_down, *b_down;
    float eps;
};

struct LayerDims {
    int T, hid, H, KVH, D, I, bs, window;
    float scale;
};

// Floats of work space decoder_layer_f32 needs (its activations, then paged_decode's scratch).
long decoder_layer_work(const LayerDims &d, int maxlen, int nthreads);

// One decoder layer of a decode step of a few sequences (one new token each), no tensor
// parallelism: the kernels above in sequence. x: the layer input [T, hid]; residual: in/out
// (first: x is copied into it, as the model's first layer does); out: [T, hid].
void decoder_layer_f32(const float *x, float *residual, bool first, float *out,
                       const LayerWeights &w, const LayerDims &d, const float *cos,
                       const float *sin, float *k_cache, float *v_cache, const int64_t *slots,
                       const DecodeBatch &batch, float *work, int nthreads);

// exp(x) for float, vectorizable (glibc's expf is not, without -ffast-math): Cody-Waite
// reduction x = n ln2 + r, Cephes' degree-6 polynomial for exp(r), times 2^n built in the
// exponent bits. Within ~2 ulp of expf over [-87, 88]; inputs are clamped to that range.
static inline float exp_f32(float x)
{
    x = x < -87.33654f ? -87.33654f : (x > 88.37626f ? 88.37626f : x);
    const float n = std::floor(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    // n is in [-126, 128] after the clamp, so the shift cannot overflow (128 gives +inf, as
    // in the C original this replaces: only inputs within 0.35 of the clamp reach it).
    return y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace fleetllm::kernels
