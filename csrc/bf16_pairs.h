// Attention sums by bf16 pairs: AVX-512 BF16's vdpbf16ps multiplies two bf16 elements per
// float32 lane and adds both products, so q . K and P . V run two elements (positions) per
// instruction instead of widening each to float32 for one FMA. Used for a bf16 model with a
// bf16 cache where `bf16_dot` holds (kernels.h): decode attention's P . V (paged_decode.cpp)
// and prompt attention's q . K and P . V (prefill_attention.cpp).
//
// The same bits as the float32 loops they replace: the product of two bf16s is exact in
// float32 (P is rounded to bf16 before P . V, as PyTorch's flash attention rounds it), and
// vdpbf16ps adds a pair's upper product, then its lower one, each rounded (the order Intel's
// manual gives; measured on Zen 4), as two FMAs in a row would. So element d (position t) goes
// in a pair's upper half and d + 1 (t + 1) in the lower; an odd last one pairs with zeros.
// Denormals differ: vdpbf16ps reads and writes them as zeros.
#pragma once

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace fleetllm::kernels::pairs {

#define FLEETLLM_PAIRS __attribute__((target("avx512bf16"), always_inline)) inline

// Elements 2p and 2p + 1 of a row of bf16s as one pair, 2p upper (memory holds it lower).
inline uint32_t pair_at(const uint16_t *x, long p)
{
    uint32_t u;
    std::memcpy(&u, x + 2 * p, sizeof u);
    return u << 16 | u >> 16;
}

// q . K for NQ queries and 16 keys: s[i][j] = scale * sum over pairs p of q2[i][p] . kt2[p][j],
// where q2 holds each query's D / 2 pairs and kt2 (row stride kstride) the keys' pairs, key j
// in lane j.
template <int NQ>
FLEETLLM_PAIRS void scores16(const uint32_t *q2, int P, const uint32_t *kt2, long kstride,
                             float *s, long sstride, float scale)
{
    __m512 acc[NQ];
    for (int i = 0; i < NQ; i++) acc[i] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kt2 + p * kstride);
        for (int i = 0; i < NQ; i++)
            acc[i] = _mm512_dpbf16_ps(
                acc[i], k, (__m512bh)_mm512_set1_epi32(static_cast<int>(q2[i * P + p])));
    }
    for (int i = 0; i < NQ; i++)
        _mm512_storeu_ps(s + i * sstride, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
}

// P . V: NS sums of D elements each (query heads, or queries) kept in registers, a[g] for
// sum g, fed a pair of positions at a time. Interleaving two V rows element by element
// (unpacklo/hi_epi16) leaves each 32 elements' sums in two vectors in the order (0-3, 8-11,
// 16-19, 24-27) and (4-7, ..., 28-31): pv_load permutes a sum so, pv_store back. (The sums
// are locals of the caller, apart from P's bf16 copy: in one struct with it, they lived on
// the stack.)

// Row pb of P as bf16 for m positions (float32 holding bf16 values: exact), and a zero past
// an odd last one for its partner; a's sum from acc (D floats).
template <int D>
FLEETLLM_PAIRS void pv_load(const float *acc, const float *p, int m, uint16_t *pb, __m512 *a)
{
    for (int t = 0; t < m; t += 16) {
        const __mmask16 k = m - t >= 16 ? 0xffff : (1u << (m - t)) - 1;
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(pb + t),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, p + t)));
    }
    pb[m] = 0;
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                         27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                         31);
    for (int c = 0; c < D / 32; c++) {
        const __m512 n0 = _mm512_loadu_ps(acc + 32 * c);
        const __m512 n1 = _mm512_loadu_ps(acc + 32 * c + 16);
        a[2 * c] = _mm512_permutex2var_ps(n0, lo, n1);
        a[2 * c + 1] = _mm512_permutex2var_ps(n0, hi, n1);
    }
}

// Positions t and t + 1 (their V rows r0, r1; r1 null past the end) into every sum; pb[g]
// is sum g's P (pv_load), PB apart.
template <int NS, int D, int PB>
FLEETLLM_PAIRS void pv_add(__m512 (&a)[NS][D / 16], const uint16_t (*pb)[PB], int t,
                           const bf16 *r0, const bf16 *r1)
{
    __m512bh w[NS];
    for (int g = 0; g < NS; g++)
        w[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(pb[g] + t, 0)));
    for (int c = 0; c < D / 32; c++) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c);
        const __m512i x1 = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x1, x0);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x1, x0);
        for (int g = 0; g < NS; g++) {
            a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], lo, w[g]);
            a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], hi, w[g]);
        }
    }
}

template <int D>
FLEETLLM_PAIRS void pv_store(const __m512 *a, float *acc)
{
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                         23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                         30, 31);
    for (int c = 0; c < D / 32; c++) {
        _mm512_storeu_ps(acc + 32 * c, _mm512_permutex2var_ps(a[2 * c], lo, a[2 * c + 1]));
        _mm512_storeu_ps(acc + 32 * c + 16, _mm512_permutex2var_ps(a[2 * c], hi, a[2 * c + 1]));
    }
}

#undef FLEETLLM_PAIRS

}  // namespace fleetllm::kernels::pairs
#endif
