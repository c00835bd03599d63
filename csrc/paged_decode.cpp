// Paged decode attention: one query per sequence over its context, read in place from the KV
// blocks (no gathered copy, no padding to the longest context), each K/V byte read once per
// step and layer. One work item is (sequence, group of KV heads); D is a literal in the
// specialized calls, so the inner loops vectorize with known trip counts. Queries and outputs
// in T, the cache in C (float32 or bfloat16); scores, softmax and sums in float32.
#include <cstring>
#include <type_traits>

#include "bf16_pairs.h"
#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

// q . k in float32, 32 elements at a time in two vectors (a bf16 cache row widened in
// registers), then a tree: GCC's own vectorization of the plain loop reduces every dot product
// lane by lane and widens bf16 poorly; this measured 1.35x (float32) and 2x (bf16) faster.
// Builds without AVX-512 keep the same 32 sums in four 8-lane registers (lane j of a[q] adds
// elements d + 8q + j) and reduce them in the same tree, so the same bits: GCC runs the 16-lane
// form there through the stack (v8's comment in kernels.h), which made decode attention 2-3x
// slower than this.
#if defined(__AVX512F__)
template <class C>
inline __attribute__((always_inline)) v16 sums32(const float *q, const C *k, const int D)
{
    v16 a0 = {}, a1 = {}, k0, k1, q0, q1;
    for (int d = 0; d < D; d += 32) {
        load16(k + d, k0);
        load16(k + d + 16, k1);
        load16(q + d, q0);
        load16(q + d + 16, q1);
        a0 += q0 * k0;
        a1 += q1 * k1;
    }
    return a0 + a1;
}
#endif

template <class C>
inline __attribute__((always_inline)) float dot(const float *q, const C *k, const int D)
{
    if (D % 32 == 0) {
#if defined(__AVX512F__)
        return hsum16(sums32(q, k, D));
#else
        v8 a[4] = {}, kq, qq;
        for (int d = 0; d < D; d += 32)
            for (int i = 0; i < 4; i++) {
                load8(k + d + 8 * i, kq);
                load8(q + d + 8 * i, qq);
                a[i] += qq * kq;
            }
        // hsum16(a0 + a1) with a0 = (a[0], a[1]) and a1 = (a[2], a[3]) as 8-lane halves
        v8 v = (a[0] + a[2]) + (a[1] + a[3]);
        v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
        v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
        return v[0] + v[1];
#endif
    }
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int d = 0; d < D; d++) s += q[d] * to_f32(k[d]);
    return s;
}

#if defined(__AVX512F__)
// dot for 16 rows of k (stride elements apart) at once, D a multiple of 32: each row's two
// vectors of sums as dot's, then one tree over the 16 whose pairings are hsum16's (lane i with
// i + 8, then + 4, + 2, + 1), so each score has the same bits as dot's; the tree's adds serve
// 16 rows at a time, where dot reduced each row alone.
template <class C>
inline __attribute__((always_inline)) v16 dot16(const float *q, const C *k, long stride,
                                                 const int D)
{
    v16 s[16];
    for (int p = 0; p < 16; p++) s[p] = sums32(q, k + p * stride, D);
    v16 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++)  // b[j]: rows 2j and 2j + 1, lane i + lane i + 8 (8 lanes each)
        b[j] = __builtin_shufflevector(s[2 * j], s[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(s[2 * j], s[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                         24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)  // c[j]'s 128-bit chunk m: row 4j + m, lane i + lane i + 4
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                         21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)  // d[j]'s chunk m: rows 8j + m and 8j + 4 + m, lane i + i + 2
        d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29)
               + __builtin_shufflevector(c[2 * j], c[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                         11, 26, 27, 14, 15, 30, 31);
    // chunk m: rows m, m + 4, m + 8, m + 12 (lane 0 + lane 1); then rows in order
    const v16 e = __builtin_shufflevector(d[0], d[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26,
                                          12, 14, 28, 30)
                  + __builtin_shufflevector(d[0], d[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27,
                                            13, 15, 29, 31);
    return __builtin_shufflevector(e, e, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
#endif

// acc += w * v in float32, 16 (AVX-512) or 8 at a time (a bf16 row widened as in dot).
template <class C>
inline __attribute__((always_inline)) void axpy(float w, const C *v, float *acc, const int D)
{
    if (D % 16 == 0) {
#if defined(__AVX512F__)
        v16 x;
        for (int d = 0; d < D; d += 16) {
            load16(v + d, x);
            *reinterpret_cast<v16u *>(acc + d) += w * x;
        }
#else
        v8 x;
        for (int d = 0; d < D; d += 8) {
            load8(v + d, x);
            *reinterpret_cast<v8u *>(acc + d) += w * x;
        }
#endif
        return;
    }
    #pragma omp simd
    for (int d = 0; d < D; d++) acc[d] += w * to_f32(v[d]);
}

// acc[h] += P[h, t] * V[t] for the positions t in [lo, hi) (relative to block b0's start).
template <class C>
inline __attribute__((always_inline)) void accumulate_pv(
    const C *v, const int32_t *table, int lo, int hi, int b0, int kh0, int nkv, float *acc,
    int G, int KVH, const int D, int bs, int n, const float *scores)
{
    const long tok = static_cast<long>(KVH) * D;
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 128) {
        // A head at a time, its D accumulators in registers over every position: the same
        // FMAs in the same order as the loop below, whose accumulators in memory made each
        // position wait on the previous one's store (a third of a decode item's time).
        for (int kh = 0; kh < nkv; kh++)
            for (int g = 0; g < G; g++) {
                const int h = kh * G + g;
                float *ah = acc + static_cast<long>(h) * D;
                const float *sh = scores + static_cast<long>(h) * n;
                v16 a[8];
                for (int d = 0; d < D / 16; d++) load16(ah + 16 * d, a[d]);
                for (int blk = b0 + lo / bs; blk * bs - b0 * bs < hi; blk++) {
                    const C *vb = v + static_cast<long>(table[blk]) * bs * tok
                                  + static_cast<long>(kh0 + kh) * D;
                    const int base = (blk - b0) * bs;
                    const int o0 = base < lo ? lo - base : 0;
                    const int o1 = base + bs <= hi ? bs : hi - base;
                    for (int o = o0; o < o1; o++) {
                        const float w = sh[base + o];
                        for (int d = 0; d < D / 16; d++) {
                            v16 x;
                            load16(vb + o * tok + 16 * d, x);
                            a[d] += w * x;
                        }
                    }
                }
                for (int d = 0; d < D / 16; d++) *reinterpret_cast<v16u *>(ah + 16 * d) = a[d];
            }
        return;
    }
#endif
    for (int blk = b0 + lo / bs; blk * bs - b0 * bs < hi; blk++) {
        const C *vb = v + static_cast<long>(table[blk]) * bs * tok + static_cast<long>(kh0) * D;
        const int base = (blk - b0) * bs;
        const int o0 = base < lo ? lo - base : 0;
        const int o1 = base + bs <= hi ? bs : hi - base;
        for (int o = o0; o < o1; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const C *vp = vb + o * tok + static_cast<long>(kh) * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    axpy(scores[static_cast<long>(h) * n + base + o], vp,
                         acc + static_cast<long>(h) * D, D);
                }
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// NS query heads' P . V over one chunk's m positions from c0 (relative to block b0's start)
// by bf16 pairs (bf16_pairs.h), the heads' sums in registers: acc and scores at the first
// head (D floats and n scores apart).
template <int NS, int D>
__attribute__((target("avx512bf16"))) void pv_heads_pairs(const bf16 *base, const int32_t *table,
                                                          int b0, int c0, int m, int bs, long tok,
                                                          float *acc, const float *scores, int n)
{
    constexpr int PB = TORCH_CHUNK + 32;
    alignas(64) uint16_t pb[NS][PB];
    __m512 a[NS][D / 16];
    for (int g = 0; g < NS; g++)
        pairs::pv_load<D>(acc + g * D, scores + static_cast<long>(g) * n + c0, m, pb[g], a[g]);
    int blk = b0 + c0 / bs, o = c0 % bs;
    for (int t = 0; t < m; t += 2) {
        const bf16 *r0 = base + (static_cast<long>(table[blk]) * bs + o) * tok;
        if (++o == bs) { o = 0; blk++; }
        const bf16 *r1 = t + 1 < m ? base + (static_cast<long>(table[blk]) * bs + o) * tok
                                   : nullptr;
        if (++o == bs) { o = 0; blk++; }
        pairs::pv_add<NS, D, PB>(a, pb, t, r0, r1);
    }
    for (int g = 0; g < NS; g++) pairs::pv_store<D>(a[g], acc + g * D);
}

// acc[h] += P[h, t] * V[t] for t in [lo, hi) (relative to block b0's start), for a bfloat16
// model with a bfloat16 cache where bf16_dot holds: accumulate_pv's sums by bf16 pairs, bit
// for bit (bf16_pairs.h), reading a V row once for up to 4 heads (2 at D = 128) where
// accumulate_pv widens it once per head and runs one FMA per element and position.
template <int D>
void accumulate_pv_dp(const bf16 *v, const int32_t *table, int lo, int hi, int b0, int kh0,
                      int nkv, float *acc, int G, int KVH, int bs, int n, const float *scores)
{
    constexpr int HG = D == 64 ? 4 : 2;  // heads per pass: 16 vectors of sums
    const long tok = static_cast<long>(KVH) * D;
    for (int c0 = lo; c0 < hi; c0 += TORCH_CHUNK) {
        const int m = (c0 + TORCH_CHUNK < hi ? c0 + TORCH_CHUNK : hi) - c0;
        for (int kh = 0; kh < nkv; kh++)
            for (int g0 = 0; g0 < G; g0 += HG) {
                const int gn = G - g0 < HG ? G - g0 : HG, h = kh * G + g0;
                const bf16 *base = v + static_cast<long>(kh0 + kh) * D;
                float *ah = acc + static_cast<long>(h) * D;
                const float *sh = scores + static_cast<long>(h) * n;
                if constexpr (D == 64) {
                    if (gn == 4) pv_heads_pairs<4, D>(base, table, b0, c0, m, bs, tok, ah, sh, n);
                    if (gn == 3) pv_heads_pairs<3, D>(base, table, b0, c0, m, bs, tok, ah, sh, n);
                }
                if (gn == 2) pv_heads_pairs<2, D>(base, table, b0, c0, m, bs, tok, ah, sh, n);
                if (gn == 1) pv_heads_pairs<1, D>(base, table, b0, c0, m, bs, tok, ah, sh, n);
            }
    }
}
#endif

// A bfloat16 model's softmax and P . V as PyTorch's CPU flash attention computes a decode
// query (the kernel transformers' bf16 models run), so that greedy tokens follow theirs: keys
// in chunks of 512 from position 0, a running max and sum; per chunk fexp_u20 on whole vectors
// summed lane by lane then reduced as a tree, expf on the remainder; the numerators rounded
// to bfloat16 before P . V; the sum divides at the end. Masked positions (before a sliding
// window's start) are zeros in their lanes.
template <class C>
inline __attribute__((always_inline)) void softmax_pv_as_torch(
    const C *v, const int32_t *table, int start, int len, int kh0, int nkv, float *acc, int G,
    int KVH, const int D, int bs, int b0, int n, float *scores, float *state)
{
    const int nh = nkv * G, p0 = b0 * bs;
    float *run_max = state, *run_sum = state + nh;
    for (int h = 0; h < nh; h++) { run_max[h] = -INFINITY; run_sum[h] = 0.f; }
    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(nh) * D);
    for (int c0 = start / TORCH_CHUNK * TORCH_CHUNK; c0 < len; c0 += TORCH_CHUNK) {
        const int c1 = c0 + TORCH_CHUNK < len ? c0 + TORCH_CHUNK : len;
        const int vis = c0 > start ? c0 : start;
        for (int h = 0; h < nh; h++)  // position t at scores[h * n + t - p0]
            chunk_softmax<true>(scores + static_cast<long>(h) * n, p0, c0, c1, vis, c1,
                                run_max[h], run_sum[h], acc + static_cast<long>(h) * D, D,
                                c0 <= start / TORCH_CHUNK * TORCH_CHUNK);
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if constexpr (std::is_same_v<C, bf16>)  // a bf16 model's bf16 cache (kernels.h)
            if (bf16_dot && (D == 64 || D == 128)) {
                (D == 64 ? accumulate_pv_dp<64> : accumulate_pv_dp<128>)(
                    v, table, vis - p0, c1 - p0, b0, kh0, nkv, acc, G, KVH, bs, n, scores);
                continue;
            }
#endif
        accumulate_pv(v, table, vis - p0, c1 - p0, b0, kh0, nkv, acc, G, KVH, D, bs, n, scores);
    }
    for (int h = 0; h < nh; h++) {
        const float inv = 1.f / run_sum[h];
        float *ah = acc + static_cast<long>(h) * D;
        #pragma omp simd
        for (int d = 0; d < D; d++) ah[d] *= inv;
    }
}

// One item: scores = q . K * scale, then a float32 model normalizes P and sums P . V; a
// bfloat16 one (RoundP) follows PyTorch's flash attention (softmax_pv_as_torch).
template <class C, bool RoundP>
inline __attribute__((always_inline)) void decode_item(
    const float *q, const C *k, const C *v, const int32_t *table, int start, int len, int kh0,
    int nkv, float *acc, int H, int KVH, const int D, int bs, float scale, float *scores,
    float *state)
{
    const int G = H / KVH, nh = nkv * G;
    const long tok = static_cast<long>(KVH) * D;  // elements per token slot in a block
    const int b0 = start / bs, b1 = (len + bs - 1) / bs;
    const int n = (b1 - b0) * bs;                  // whole blocks; the ends are masked
    const int lo = start - b0 * bs, hi = len - b0 * bs;
    const float *qb = q + static_cast<long>(kh0) * G * D;
    const long off = static_cast<long>(kh0) * D, tok_bytes = tok * sizeof(C);
    const int lines = (nkv * D * static_cast<int>(sizeof(C)) + 63) / 64;  // of a position's row
    for (int blk = b0; blk < b1; blk++) {  // scores = q . K, block by block
        const C *kb = k + static_cast<long>(table[blk]) * bs * tok + off;
        // Blocks lie anywhere in the cache, so the hardware prefetcher starts over at each:
        // fetch the next block's keys one block ahead, and this block's values for P . V (a
        // sequence's values fit in L2), a few lines beside each dot product
        // (tools/decode_ab.cpp measures it).
        const char *kn = blk + 1 < b1 ? reinterpret_cast<const char *>(
                             k + static_cast<long>(table[blk + 1]) * bs * tok + off) : nullptr;
        const char *vc = reinterpret_cast<const char *>(
            v + static_cast<long>(table[blk]) * bs * tok + off);
        const int base = (blk - b0) * bs;
        int next = 0;  // the next line to prefetch, position by position
        const auto prefetch = [&](int o0, int o1, int count) {
            for (const int end = o1 * lines; count > 0 && o0 * lines + next < end; count--, next++) {
                const long at = (o0 + next / lines) * tok_bytes + (next % lines) * 64;
                if (kn) __builtin_prefetch(kn + at, 0, 3);
                __builtin_prefetch(vc + at, 0, 2);
            }
        };
#if defined(__AVX512F__)
        if (D % 32 == 0 && bs % 16 == 0) {
            for (int o = 0; o < bs; o += 16) {
                next = 0;
                const int per = (16 * lines + nkv * G - 1) / (nkv * G);
                for (int kh = 0; kh < nkv; kh++)
                    for (int g = 0; g < G; g++) {
                        const int h = kh * G + g;
                        prefetch(o, o + 16, per);
                        const v16 s = dot16(qb + static_cast<long>(h) * D,
                                            kb + o * tok + static_cast<long>(kh) * D, tok, D);
                        *reinterpret_cast<v16u *>(scores + static_cast<long>(h) * n + base + o) =
                            s * scale;
                    }
            }
            continue;
        }
#endif
        for (int o = 0; o < bs; o++) {
            prefetch(0, bs, lines);
            for (int kh = 0; kh < nkv; kh++) {
                const C *kp = kb + o * tok + static_cast<long>(kh) * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float *qh = qb + static_cast<long>(h) * D;
                    scores[static_cast<long>(h) * n + base + o] = dot(qh, kp, D) * scale;
                }
            }
        }
    }
    if constexpr (RoundP) {
        softmax_pv_as_torch(v, table, start, len, kh0, nkv, acc, G, KVH, D, bs, b0, n, scores,
                            state);
        return;
    }
    for (int h = 0; h < nh; h++) {  // softmax over the visible positions
        float *sh = scores + static_cast<long>(h) * n;
        float m = -INFINITY, sum = 0.f;
        for (int t = lo; t < hi; t++) m = sh[t] > m ? sh[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int t = lo; t < hi; t++) { const float e = exp_f32(sh[t] - m); sh[t] = e; sum += e; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int t = lo; t < hi; t++) sh[t] *= inv;
    }
    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(nh) * D);
    accumulate_pv(v, table, lo, hi, b0, kh0, nkv, acc, G, KVH, D, bs, n, scores);
}

template <class T, class C>
struct DecodeCtx {
    const T *q;
    const C *k, *v;
    long q_stride, scratch_per;
    const DecodeBatch *batch;
    T *out;
    float *scratch, scale;
    int H, KVH, D, bs, window, split, nkv;
};

template <class T, class C>
void decode_body(void *arg, long begin, long end, int tid)
{
    const auto *c = static_cast<const DecodeCtx<T, C> *>(arg);
    const int H = c->H, D = c->D, G = H / c->KVH;
    float *scores = c->scratch + tid * c->scratch_per;
    float *acc = scores + static_cast<long>(H) * (c->batch->maxlen + 2 * c->bs);
    float *qf = acc + static_cast<long>(H) * D, *state = qf + static_cast<long>(H) * D;
    for (long item = begin; item < end; item++) {
        const int b = static_cast<int>(item / c->split);
        const int kh0 = static_cast<int>(item % c->split) * c->nkv;
        const long h0 = static_cast<long>(kh0) * G * D, nhd = static_cast<long>(c->nkv) * G * D;
        const int len = c->batch->ctx_lens[b];
        const int start = c->window > 0 && len > c->window ? len - c->window : 0;
        const T *qb = c->q + static_cast<long>(b) * c->q_stride;
        T *ob = c->out + static_cast<long>(b) * H * D;
        // The item's heads of q in float32, and their output (acc) in float32 until the end;
        // a float32 model reads q and sums into out in place.
        const float *qv;
        float *ov;
        if constexpr (std::is_same_v<T, float>) {
            qv = qb;
            ov = ob + h0;
        } else {
            convert(qb + h0, qf + h0, nhd);
            qv = qf;
            ov = acc;
        }
        const int32_t *table = c->batch->tables + c->batch->table_start[b];
        constexpr bool round_p = !std::is_same_v<T, float>;
        if (D == 64)
            decode_item<C, round_p>(qv, c->k, c->v, table, start, len, kh0, c->nkv, ov, H, c->KVH, 64,
                        c->bs, c->scale, scores, state);
        else if (D == 128)
            decode_item<C, round_p>(qv, c->k, c->v, table, start, len, kh0, c->nkv, ov, H, c->KVH, 128,
                        c->bs, c->scale, scores, state);
        else
            decode_item<C, round_p>(qv, c->k, c->v, table, start, len, kh0, c->nkv, ov, H, c->KVH, D,
                        c->bs, c->scale, scores, state);
        if constexpr (!std::is_same_v<T, float>)
            convert(acc, ob + h0, nhd);
    }
}

}  // namespace

long paged_decode_scratch(int H, int D, int bs, int maxlen, int nthreads)
{
    const long per = static_cast<long>(H) * (maxlen + 2L * bs) + 2L * H * D + 2L * H;
    return per * (nthreads > 0 ? nthreads : 1);
}

template <class T, class C>
void paged_decode(const T *q, long q_stride, const C *k, const C *v, const DecodeBatch &batch,
                  T *out, int B, int H, int KVH, int D, int bs, int window, float scale,
                  float *scratch, int nthreads)
{
    DecodeCtx<T, C> c{};
    c.q = q;
    c.k = k;
    c.v = v;
    c.q_stride = q_stride;
    c.batch = &batch;
    c.out = out;
    c.scratch = scratch;
    c.scale = scale;
    c.H = H;
    c.KVH = KVH;
    c.D = D;
    c.bs = bs;
    c.window = window;
    // Whole sequences per item read whole token rows (better prefetching), so a batch splits
    // by KV heads only until every thread has an item: with K/V cold (as after a step's
    // weights), whole sequences beat items of one KV head each (tools/decode_ab.cpp).
    // The split divides KVH: item (b, s) is sequence b's KV heads [s * nkv, (s + 1) * nkv).
    c.split = 1;
    while (B * c.split < nthreads && c.split < KVH) {
        int next = c.split + 1;
        while (KVH % next != 0) next++;
        c.split = next;
    }
    c.nkv = KVH / c.split;
    c.scratch_per = paged_decode_scratch(H, D, bs, batch.maxlen, 1);
    parallel_run(nthreads, decode_body<T, C>, &c, static_cast<long>(B) * c.split, 1,
                 B <= SPIN_ROWS);
}

#define FLEETLLM_DECODE(T, C)                                                                 \
    template void paged_decode<T, C>(const T *, long, const C *, const C *,                   \
                                     const DecodeBatch &, T *, int, int, int, int, int, int,  \
                                     float, float *, int);
FLEETLLM_DECODE(float, float)
FLEETLLM_DECODE(float, bf16)
FLEETLLM_DECODE(bf16, float)
FLEETLLM_DECODE(bf16, bf16)

}  // namespace fleetllm::kernels
