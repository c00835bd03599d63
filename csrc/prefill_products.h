// Prompt attention's two products for prefill_attention.cpp, in its three ways: q . K^T of a
// tile of queries against keys transposed to [D][keys], and P . V summed into the queries'
// accumulators, on float32 vectors (any CPU), by bf16 pairs (AVX-512 BF16: bf16_pairs.h) and
// on AMX tiles (attention_amx.h). Each way gives the bits the file's header describes; which
// one runs is prefill_body's choice.
#pragma once

#include <algorithm>
#include <cstring>
#include <utility>

#include "attention_amx.h"
#include "bf16_pairs.h"
#include "kernels.h"

namespace fleetllm::kernels::prefill {

// Registers P . V may keep its sums in (kernels.h's vec is one register).
#if defined(__AVX512F__)
constexpr int ACC_REGS = 16;
#else
constexpr int ACC_REGS = 8;
#endif
constexpr int W = VEC_LANES;
constexpr int QK_GROUP = 8;  // queries whose scores share one K vector (8 accumulators)
constexpr int PV_GROUP = 4;  // queries whose softmax steps go together before their P . V

// W vectors transposed in place (r[i][j] <- r[j][i]): log2(W) butterfly
// stages, each swapping the off-diagonal B x B blocks of every 2B x 2B block (two two-source
// shuffles per pair of rows).
template <int B, std::size_t... L>
inline void swap_blocks(vec &a, vec &b, std::index_sequence<L...>)
{
    const vec lo = __builtin_shufflevector(a, b, ((L & B) ? L - B + W : L)...);
    const vec hi = __builtin_shufflevector(a, b, ((L & B) ? L + W : L + B)...);
    a = lo;
    b = hi;
}

template <int B>
inline void transpose_stage(vec *r)
{
    for (int i = 0; i < W; i++)
        if (!(i & B))
            swap_blocks<B>(r[i], r[i + B], std::make_index_sequence<W>{});
}

inline void transpose(vec *r)
{
    if constexpr (W == 16)
        transpose_stage<8>(r);
    transpose_stage<4>(r);
    transpose_stage<2>(r);
    transpose_stage<1>(r);
}

// A key row of zeros (as float or bf16: zero bits either way) for the lanes past a context's
// end, for head sizes up to MAX_D.
constexpr int MAX_D = 512;
alignas(64) inline constexpr float ZEROS[MAX_D] = {};

// kt[d * kstride + j] = element d of key j, in float32, for the W keys whose rows
// start at rows[j] (null: a key of zeros, past a context's end), so that attention scores 16
// (AVX2: 8) keys per vector FMA (scores_group). Whole vectors transposed in registers where D
// allows, element by element otherwise.
template <class C>
inline void transpose_keys(const C *const *rows, int D, float *kt, long kstride)
{
    if (D % W == 0 && D <= MAX_D) {
        const C *zeros = reinterpret_cast<const C *>(ZEROS);
        for (int d0 = 0; d0 < D; d0 += W) {
            vec r[W];
            for (int j = 0; j < W; j++) loadv((rows[j] ? rows[j] : zeros) + d0, r[j]);
            transpose(r);
            for (int i = 0; i < W; i++)
                *reinterpret_cast<vecu *>(kt + (d0 + i) * kstride) = r[i];
        }
        return;
    }
    for (int d = 0; d < D; d++)
        for (int j = 0; j < W; j++)
            kt[d * kstride + j] = rows[j] ? to_f32(rows[j][d]) : 0.f;
}

// S[i][j] = scale * q_i . K^T[:, j] for the queries of one group and 16 keys at a time.
template <int NQ>
inline __attribute__((always_inline)) void scores_group(const float *qf, const float *kt,
                                                        int kstride, float *s, int D, int npad,
                                                        float scale)
{
    for (int j = 0; j < npad; j += W) {
        vec acc[NQ] = {};
        for (int d = 0; d < D; d++) {
            vec kv;
            loadv(kt + static_cast<long>(d) * kstride + j, kv);
            for (int i = 0; i < NQ; i++) acc[i] += qf[static_cast<long>(i) * D + d] * kv;
        }
        for (int i = 0; i < NQ; i++)
            *reinterpret_cast<vecu *>(s + static_cast<long>(i) * npad + j) = acc[i] * scale;
    }
}

// acc[i] += P[i][t] * V[t] for the keys t in [t0, t1) (P zero where query i does not see t).
template <class C, int NQ, int D>
inline __attribute__((always_inline)) void pv_group(const C *v, const int64_t *slots, long tok,
                                                    const float *p, int npad, int lo, int t0,
                                                    int t1, float *acc)
{
    vec a[NQ][D / W];
    for (int i = 0; i < NQ; i++)
        for (int c = 0; c < D / W; c++) loadv(acc + i * D + W * c, a[i][c]);
    for (int t = t0; t < t1; t++) {
        const C *vr = v + slots[t] * tok;
        for (int c = 0; c < D / W; c++) {
            vec x;
            loadv(vr + W * c, x);
            for (int i = 0; i < NQ; i++) a[i][c] += p[static_cast<long>(i) * npad + t - lo] * x;
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int c = 0; c < D / W; c++) *reinterpret_cast<vecu *>(acc + i * D + W * c) = a[i][c];
}

template <class C>
void pv_any(const C *v, const int64_t *slots, long tok, const float *p, int npad, int lo,
            int t0, int t1, float *acc, int nq, int D)
{
    for (int t = t0; t < t1; t++) {
        const C *vr = v + slots[t] * tok;
        for (int i = 0; i < nq; i++) {
            const float w = p[static_cast<long>(i) * npad + t - lo];
            float *ai = acc + static_cast<long>(i) * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ai[d] += w * to_f32(vr[d]);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A bf16 model with a bf16 cache on CPUs with AVX-512 BF16: q . K and P . V by bf16 pairs
// (bf16_pairs.h: the same bits as scores_group and pv_group, two elements per instruction).

// kt2[p * kstride + j] = elements 2p and 2p + 1 of key j as a pair (2p upper), for the 16
// keys whose rows start at rows[j] (null: zeros): transpose_keys by pairs. D % 32 == 0.
inline __attribute__((target("avx512bf16"))) void transpose_key_pairs(const bf16 *const *rows,
                                                                      int D, uint32_t *kt2,
                                                                      long kstride)
{
    const bf16 *zeros = reinterpret_cast<const bf16 *>(ZEROS);
    for (int d0 = 0; d0 < D; d0 += 32) {
        vec r[W];
        for (int j = 0; j < W; j++)
            r[j] = (vec)_mm512_loadu_si512((rows[j] ? rows[j] : zeros) + d0);
        transpose(r);  // 32-bit lanes: each pair moves whole
        for (int i = 0; i < W; i++)
            _mm512_storeu_si512(kt2 + (d0 / 2 + i) * kstride,
                                _mm512_rol_epi32((__m512i)r[i], 16));
    }
}

// S for nq queries (their pairs in q2, D / 2 each) against the keys' pairs in kt2.
inline __attribute__((target("avx512bf16"))) void scores_pairs(const uint32_t *q2,
                                                               const uint32_t *kt2, long kstride,
                                                               float *s, int D, int npad,
                                                               float scale, int nq)
{
    const int P = D / 2;
    for (int j = 0; j < npad; j += W) {
        int i = 0;
        for (; i + QK_GROUP <= nq; i += QK_GROUP)
            pairs::scores16<QK_GROUP>(q2 + i * P, P, kt2 + j, kstride, s + i * npad + j, npad,
                                      scale);
        for (; i + 4 <= nq; i += 4)
            pairs::scores16<4>(q2 + i * P, P, kt2 + j, kstride, s + i * npad + j, npad, scale);
        for (; i < nq; i++)
            pairs::scores16<1>(q2 + i * P, P, kt2 + j, kstride, s + i * npad + j, npad, scale);
    }
}

// pv_group by pairs of positions, for NQ queries.
template <int NQ, int D>
__attribute__((target("avx512bf16"))) void pv_group_pairs(const bf16 *v, const int64_t *slots,
                                                          long tok, const float *p, int npad,
                                                          int lo, int t0, int t1, float *acc)
{
    constexpr int PB = TORCH_CHUNK + 32;
    alignas(64) uint16_t pb[NQ][PB];
    __m512 a[NQ][D / 16];
    const int m = t1 - t0;
    for (int i = 0; i < NQ; i++)
        pairs::pv_load<D>(acc + i * D, p + i * npad + t0 - lo, m, pb[i], a[i]);
    for (int t = 0; t < m; t += 2)
        pairs::pv_add<NQ, D, PB>(a, pb, t, v + slots[t0 + t] * tok,
                                 t + 1 < m ? v + slots[t0 + t + 1] * tok : nullptr);
    for (int i = 0; i < NQ; i++) pairs::pv_store<D>(a[i], acc + i * D);
}

// P . V for nq queries by pairs: 4 at a time at D = 64 (2 at D = 128), then the rest.
template <int D>
void pv_pairs(const bf16 *v, const int64_t *slots, long tok, const float *s, int npad, int lo,
              int t0, int t1, float *acc, int nq)
{
    for (int i = 0; i < nq;) {
        const int n = std::min(D == 64 ? 4 : 2, nq - i);
        const float *si = s + static_cast<long>(i) * npad;
        float *ai = acc + static_cast<long>(i) * D;
        if constexpr (D == 64) {
            if (n == 4) pv_group_pairs<4, D>(v, slots, tok, si, npad, lo, t0, t1, ai);
            if (n == 3) pv_group_pairs<3, D>(v, slots, tok, si, npad, lo, t0, t1, ai);
        }
        if (n == 2) pv_group_pairs<2, D>(v, slots, tok, si, npad, lo, t0, t1, ai);
        if (n == 1) pv_group_pairs<1, D>(v, slots, tok, si, npad, lo, t0, t1, ai);
        i += n;
    }
}
#endif

// Queries rounded up to whole AMX tiles of 16: the rows the scratch has for a tile of queries.
constexpr int tile_queries(int n) { return (n + 15) / 16 * 16; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// P . V of a tile's nq queries on AMX tiles for the keys [t0, t1) of one chunk: their P (bf16
// values in s, rows npad apart, from key lo) as bf16 into pb from t0 rounded down to 32 to
// t1 rounded up, zeros around them and in the rows past nq up to a whole tile of 16.
inline void amx_pv(const float *s, int npad, int lo, int t0, int t1, uint16_t *pb,
                   const uint32_t *vt2, float *acc, int D, int nq)
{
    constexpr int PB = TORCH_CHUNK;  // t1 - t0 <= a chunk, which starts at a multiple of 32
    const int ta = t0 / 32 * 32, tb = (t1 + 31) / 32 * 32;
    for (int q = 0; q < tile_queries(nq); q++) {
        uint16_t *row = pb + static_cast<long>(q) * PB - ta;
        if (q >= nq) {
            std::memset(row + ta, 0, sizeof(uint16_t) * static_cast<size_t>(tb - ta));
            continue;
        }
        const float *sq = s + static_cast<long>(q) * npad - lo;
        for (int t = ta; t < t0; t++) row[t] = 0;
        #pragma omp simd
        for (int t = t0; t < t1; t++)
            row[t] = static_cast<uint16_t>(__builtin_bit_cast(uint32_t, sq[t]) >> 16);
        for (int t = t1; t < tb; t++) row[t] = 0;
    }
    amx::pv(pb, PB, vt2, ta, tb, acc, D, tile_queries(nq));
}
#endif

// S = scale * q . K^T for nq float32 queries (qf, D apart) against kt from key lo: QK_GROUP
// queries share each K vector, then 4, then one at a time.
inline void scores_tile(const float *qf, const float *kt, int kstride, float *s, int D,
                        int npad, float scale, int nq)
{
    int i = 0;
    for (; i + QK_GROUP <= nq; i += QK_GROUP)
        scores_group<QK_GROUP>(qf + static_cast<long>(i) * D, kt, kstride,
                               s + static_cast<long>(i) * npad, D, npad, scale);
    for (; i + 4 <= nq; i += 4)
        scores_group<4>(qf + static_cast<long>(i) * D, kt, kstride,
                        s + static_cast<long>(i) * npad, D, npad, scale);
    for (; i < nq; i++)
        scores_group<1>(qf + static_cast<long>(i) * D, kt, kstride,
                        s + static_cast<long>(i) * npad, D, npad, scale);
}

// P . V on float32 vectors for the queries [g0, g1) over keys [t0, t1): as many queries at a
// time as keep their sums in ACC_REGS registers at D = 64 or 128, any D element by element.
template <class C>
void pv_tile(const C *v, const int64_t *slots, long tok, const float *s, int npad, int lo,
             int t0, int t1, float *acc, int g0, int g1, int D)
{
    constexpr int N64 = ACC_REGS / (64 / W), N128 = ACC_REGS / (128 / W);
    int i = g0;
    if (D == 64)
        for (; i + N64 <= g1; i += N64)
            pv_group<C, N64, 64>(v, slots, tok, s + static_cast<long>(i) * npad, npad, lo, t0,
                                 t1, acc + static_cast<long>(i) * D);
    if constexpr (N128 > 0)
        if (D == 128)
            for (; i + N128 <= g1; i += N128)
                pv_group<C, N128, 128>(v, slots, tok, s + static_cast<long>(i) * npad, npad,
                                       lo, t0, t1, acc + static_cast<long>(i) * D);
    if (i < g1)
        pv_any(v, slots, tok, s + static_cast<long>(i) * npad, npad, lo, t0, t1,
               acc + static_cast<long>(i) * D, g1 - i, D);
}

}  // namespace fleetllm::kernels::prefill
