// The quantized GEMV on AVX-512 VNNI (quant.h's linear, for Q4_0, Q4_1, Q4_ZP, Q8_0, Q8_ZP,
// Q4_K, Q5_K and Q6_K rows when K is a multiple of 64): as llama.cpp does, the rows of x are
// quantized once per call to int8 per 32 elements (dx = max |x| / 127), and each 64 weights are
// a vpdpbusd of their unsigned values u against x's bytes: 16 int32 lanes of 4 products. Unlike
// llama.cpp, x is two int8 planes, q1 and the rounding left, q2 = round((x - dx q1) * 128 / dx)
// (|q2| <= 64): lanes (u . q1) * 128 + u . q2 (two vpdpbusd and a shift) times dx / 128 give
// x's products to ~1/32000 instead of ~1/250: llama.cpp's one plane changed a greedy token in
// 28% of the demo model's Q4_K_M requests against float32, two planes as often as float32 sums.
// A type whose values are signed stores u = q + o (o = 8, 32 or 128): its lanes subtract o
// times x's lane sums; a zero-point type (w = d (u - z)) subtracts its block's own z times
// them. Each lane is then scaled by its weight scale times its dx, in float32; minimums (Q4_1,
// Q4_K, Q5_K) from the quantized x's sums per 16. For 1 or 2 (4) rows of x, 4 (2) weight rows
// share each load of x; the weight stream is prefetched 8 KiB ahead; the block type is a
// template argument. Built into every x86 variant with the target attribute and run only where
// the CPU has VNNI (vnni_available).
#include "quant.h"

#include <algorithm>
#include <cfloat>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>

namespace fleetllm::kernels::quant {
namespace {

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,avx2,fma")))

// The weight stream AHEAD bytes on, into L1, one request a line of the `bytes` about to be
// read: the hardware prefetcher alone kept one core at 6 GB/s from memory on Q8_0 rows (a
// 125M model's projections, tools/quant_gemv_ab.cpp), 12.5 with 4 KiB; 1-2 KiB ahead gave
// 9-10; with 4 weight rows a pass, 8 KiB beat 4 on 2 threads (Q8_0 31-32 -> 38 GB/s, the
// others the same).
constexpr int AHEAD = 8192;
VNNI inline void ahead(const uint8_t *p, int bytes)
{
    for (int o = 0; o < bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char *>(p) + AHEAD + o, _MM_HINT_T0);
}

VNNI inline __m512i join(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 16 bytes at p in both 128-bit halves of a 256-bit vector
VNNI inline __m256i both_halves(const uint8_t *p)
{
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

// Nibbles as bytes: each 64-bit lane shifted right by its count in `shift` (0: the low
// nibbles, 4: the high ones), then masked; from loads that put each byte where both of its
// nibbles go (one shift and a mask, where 128-bit halves cost 3 shuffles more: Q4_0, Q4_K
// 1.1-1.15x a core in cache).
VNNI inline __m512i nibbles(__m512i bytes, __m512i shift)
{
    return _mm512_and_si512(_mm512_srlv_epi64(bytes, shift), _mm512_set1_epi8(0x0F));
}

VNNI inline __m512 two_scales(float a, float b)
{
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// Q4_ZP / Q8_ZP: blocks a's and c's zero points (byte 2) in lanes 0-7 and 8-15
VNNI inline __m512i two_zeros(const uint8_t *a, const uint8_t *c)
{
    return _mm512_inserti32x8(_mm512_set1_epi32(a[2]), _mm256_set1_epi32(c[2]), 1);
}

// Rows of x: their two planes of bytes (q1 at xq, q2 M * K bytes on), dx / 128 per 4
// elements, (q1 << 7) + q2 summed per 4 bytes, and the quantized rows' float sums per 16 (the
// minimums' terms must see the same x as the products, or a weight's mean, which the minimum
// removes, meets x's rounding).
struct Rows {
    const int8_t *xq;
    long plane;
    const float *dxl, *xqsum;
    const int32_t *xls;
    int K;
};

// acc[i][r] += lanes(u_i . x_r - o * xls_r) * ws_i * dxl_r for the 64 weights at element e of
// NR weight rows i: o = 2^SHIFT, none (SHIFT 0), or per lane z_i (SHIFT < 0: zero points). The
// weight rows share each load of x's planes and sums.
template <int MT, int NR, int SHIFT>
VNNI inline void chunk(__m512 (&acc)[NR][MT], const __m512i (&u)[NR], const __m512 (&ws)[NR],
                       const Rows &x, int m0, long e, const __m512i (&z)[NR])
{
    for (int r = 0; r < MT; r++) {
        const long row = static_cast<long>(m0 + r) * x.K;
        const __m512i q1 = _mm512_loadu_si512(x.xq + row + e);
        const __m512i q2 = _mm512_loadu_si512(x.xq + x.plane + row + e);
        const __m512i xl = _mm512_loadu_si512(x.xls + row / 4 + e / 4);
        const __m512 dl = _mm512_loadu_ps(x.dxl + row / 4 + e / 4);
        for (int i = 0; i < NR; i++) {
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], q1);
            s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 7), u[i], q2);
            if constexpr (SHIFT > 0)
                s = _mm512_sub_epi32(s, _mm512_slli_epi32(xl, SHIFT));
            if constexpr (SHIFT < 0)
                s = _mm512_sub_epi32(s, _mm512_mullo_epi32(xl, z[i]));
            acc[i][r] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws[i], dl), acc[i][r]);
        }
    }
}

// Outputs [n0, n1) of part p (of type T) for rows [m0, m0 + MT) of x, NR weight rows a pass
// (each block's unpacking serves MT rows of x, each load of x NR weight rows). The type is a
// template argument: a switch on it inside the loop made one row 1.3x slower.
template <int MT, int NR, int64_t T>
VNNI void rows(const Part &p, const Rows &x, int m0, long n0, long n1, float *y, long N, long first)
{
    const int K = x.K, KG = K / 16;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m512i none[NR] = {};
    for (long n = n0; n + NR <= n1; n += NR) {
        const uint8_t *rowp[NR];
        __m512 acc[NR][MT];
        float mins[NR][MT] = {};
        for (int i = 0; i < NR; i++) {
            rowp[i] = p.data + (n + i) * p.row_bytes;
            for (int r = 0; r < MT; r++) acc[i][r] = _mm512_setzero_ps();
        }
        __m512i u[NR], z[NR];
        __m512 ws[NR];
        if constexpr (T == Q8_0 || T == Q8_ZP || T == Q4_0 || T == Q4_1 || T == Q4_ZP) {
            // Q4_1's minimums: per two blocks, (m_a, m_a, m_c, m_c) times x's sums per 16
            __m128 minv[NR][MT];
            for (int i = 0; i < NR; i++)
                for (int r = 0; r < MT; r++) minv[i][r] = _mm_setzero_ps();
            constexpr int bytes = T == Q8_0 ? 34 : T == Q8_ZP ? 36 : T == Q4_0 ? 18 : 20;
            constexpr bool zp = T == Q8_ZP || T == Q4_ZP;  // d, z, pad, then q
            constexpr bool eight = T == Q8_0 || T == Q8_ZP;
            for (int b = 0; b < K / 32; b += 2) {  // two blocks: 64 weights
                for (int i = 0; i < NR; i++) {
                    const uint8_t *a = rowp[i] + static_cast<long>(b) * bytes, *c = a + bytes;
                    ahead(a, 2 * bytes);
                    ws[i] = two_scales(f16c_half_at(a), f16c_half_at(c));
                    if constexpr (zp)
                        z[i] = two_zeros(a, c);
                    if constexpr (eight) {
                        constexpr int qoff = zp ? 4 : 2;
                        u[i] = join(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(a + qoff)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c + qoff)));
                        if constexpr (!zp)  // Q8_0's signed q: u = q + 128, the sign bit flipped
                            u[i] = _mm512_xor_si512(u[i], _mm512_set1_epi8(-128));
                        continue;
                    }
                    constexpr int qoff = T == Q4_0 ? 2 : 4;  // Q4_1: d, m; Q4_ZP: d, z, pad
                    u[i] = nibbles(join(both_halves(a + qoff), both_halves(c + qoff)),
                                   _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
                    if constexpr (T == Q4_1) {
                        const float ma = f16c_half_at(a + 2), mc = f16c_half_at(c + 2);
                        const __m128 mv = _mm_set_ps(mc, mc, ma, ma);
                        for (int r = 0; r < MT; r++)
                            minv[i][r] = _mm_fmadd_ps(
                                mv,
                                _mm_loadu_ps(x.xqsum + static_cast<long>(m0 + r) * KG + 2L * b),
                                minv[i][r]);
                    }
                }
                const long e = 32L * b;
                if constexpr (zp)  // q - z
                    chunk<MT, NR, -1>(acc, u, ws, x, m0, e, z);
                else if constexpr (T == Q8_0)  // q + 128 - 128
                    chunk<MT, NR, 7>(acc, u, ws, x, m0, e, none);
                else if constexpr (T == Q4_0)  // q - 8: u's lanes less 8 times x's lane sums
                    chunk<MT, NR, 3>(acc, u, ws, x, m0, e, none);
                else  // Q4_1: w = d q + m, q unsigned
                    chunk<MT, NR, 0>(acc, u, ws, x, m0, e, none);
            }
            if constexpr (T == Q4_1)  // + m sum(x): mins holds what is subtracted
                for (int i = 0; i < NR; i++)
                    for (int r = 0; r < MT; r++)
                        mins[i][r] = -_mm512_reduce_add_ps(_mm512_zextps128_ps512(minv[i][r]));
        } else if constexpr (T == Q4_K || T == Q5_K) {
            constexpr bool five = T == Q5_K;
            constexpr int bytes = five ? 176 : 144;
            __m512 minv[NR][MT];
            for (int i = 0; i < NR; i++)
                for (int r = 0; r < MT; r++) minv[i][r] = _mm512_setzero_ps();
            for (int b = 0; b < K / 256; b++) {
                __m512 scale8[NR], mv[NR];
                const uint8_t *qs[NR];
                __m256i qh[NR];
                for (int i = 0; i < NR; i++) {
                    const uint8_t *blk = rowp[i] + static_cast<long>(b) * bytes;
                    ahead(blk, bytes);
                    // the 8 scales and 8 mins (6 bits each in 12 bytes, words u0 u1 u2) as
                    // bytes, by ggml's masks: u0 & 63.., (u2 & 15..) | (u0 >> 6 & 3..) << 4,
                    // u1 & 63.., (u2 >> 4 & 15..) | (u1 >> 6 & 3..) << 4. In registers: the
                    // masked words stored and reloaded as a vector stalled on store forwarding
                    // (Q4_K in cache 11 -> 14 GB/s a core without it).
                    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 4));
                    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // u0 u2 u1 u2
                    const __m128i c = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // u0 u0 u1 u1
                    const __m128i bits = _mm_and_si128(
                        _mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                        _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
                    const __m128i top = _mm_and_si128(
                        _mm_slli_epi32(
                            _mm_and_si128(_mm_srli_epi32(c, 6), _mm_set1_epi32(0x03030303)), 4),
                        _mm_setr_epi32(0, -1, 0, -1));
                    const __m512 f =
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(bits, top)));
                    // lanes 0-7 scales times d, 8-15 mins times dmin
                    const __m512 dd = two_scales(f16c_half_at(blk), f16c_half_at(blk + 2));
                    scale8[i] = _mm512_mul_ps(f, dd);
                    mv[i] = _mm512_permutexvar_ps(  // each min for its two granules of 16
                        _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8,
                                         8),
                        scale8[i]);
                    qs[i] = blk + (five ? 48 : 16);
                    qh[i] = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16))
                                 : _mm256_setzero_si256();
                }
                for (int j = 0; j < 4; j++) {
                    for (int i = 0; i < NR; i++) {
                        if constexpr (!five) {  // the 32 bytes' low nibbles, then high ones
                            u[i] = nibbles(_mm512_broadcast_i64x4(_mm256_loadu_si256(
                                               reinterpret_cast<const __m256i *>(qs[i] + 32 * j))),
                                           _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
                            ws[i] = _mm512_permutexvar_ps(  // scales 2j and 2j + 1
                                _mm512_inserti32x8(_mm512_set1_epi32(2 * j),
                                                   _mm256_set1_epi32(2 * j + 1), 1),
                                scale8[i]);
                            continue;
                        }
                        const __m256i q =
                            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs[i] + 32 * j));
                        __m256i lo = _mm256_and_si256(q, low);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                        if constexpr (five) {
                            const __m256i one = _mm256_set1_epi8(1);
                            const __m256i h = qh[i];
                            lo = _mm256_or_si256(
                                lo, _mm256_slli_epi16(
                                        _mm256_and_si256(
                                            _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j)), one),
                                        4));
                            hi = _mm256_or_si256(
                                hi, _mm256_slli_epi16(
                                        _mm256_and_si256(
                                            _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j + 1)),
                                            one),
                                        4));
                        }
                        u[i] = join(lo, hi);
                        ws[i] = _mm512_permutexvar_ps(  // scales 2j and 2j + 1
                            _mm512_inserti32x8(_mm512_set1_epi32(2 * j),
                                               _mm256_set1_epi32(2 * j + 1), 1),
                            scale8[i]);
                    }
                    chunk<MT, NR, 0>(acc, u, ws, x, m0, 256L * b + 64 * j, none);
                }
                // the minimums: sum over the block's 16 granules of min * x's sum there
                for (int i = 0; i < NR; i++) {
                    for (int r = 0; r < MT; r++)
                        minv[i][r] = _mm512_fmadd_ps(
                            mv[i],
                            _mm512_loadu_ps(x.xqsum + static_cast<long>(m0 + r) * KG + 16L * b),
                            minv[i][r]);
                }
            }
            for (int i = 0; i < NR; i++)
                for (int r = 0; r < MT; r++) mins[i][r] = _mm512_reduce_add_ps(minv[i][r]);
        } else {  // Q6_K
            for (int b = 0; b < K / 256; b++) {
                __m512 scales[NR];
                const uint8_t *blk[NR];
                for (int i = 0; i < NR; i++) {
                    blk[i] = rowp[i] + static_cast<long>(b) * 210;
                    ahead(blk[i], 210);
                    // the 16 scales as floats times d, one per 16 elements
                    scales[i] = _mm512_mul_ps(
                        _mm512_set1_ps(f16c_half_at(blk[i] + 208)),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                            _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk[i] + 192)))));
                }
                const __m256i three = _mm256_set1_epi8(3);
                for (int h = 0; h < 2; h++) {
                    __m512i q01[NR], q23[NR];
                    for (int i = 0; i < NR; i++) {
                        const uint8_t *base = blk[i];
                        const __m256i l0 =
                            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(base + 64 * h));
                        const __m256i l1 = _mm256_loadu_si256(
                            reinterpret_cast<const __m256i *>(base + 64 * h + 32));
                        const __m256i hb = _mm256_loadu_si256(
                            reinterpret_cast<const __m256i *>(base + 128 + 32 * h));
                        const __m256i q0 =
                            _mm256_or_si256(_mm256_and_si256(l0, low),
                                            _mm256_slli_epi16(_mm256_and_si256(hb, three), 4));
                        const __m256i q1 = _mm256_or_si256(
                            _mm256_and_si256(l1, low),
                            _mm256_slli_epi16(
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4));
                        const __m256i q2 = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                            _mm256_slli_epi16(
                                _mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4));
                        const __m256i q3 = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                            _mm256_slli_epi16(
                                _mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4));
                        q01[i] = join(q0, q1);
                        q23[i] = join(q2, q3);
                    }
                    for (int c = 0; c < 2; c++) {  // elements 128h + 64c: granules 8h + 4c ..
                        const __m512i idx =
                            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                        for (int i = 0; i < NR; i++) {
                            ws[i] = _mm512_permutexvar_ps(
                                _mm512_add_epi32(idx, _mm512_set1_epi32(8 * h + 4 * c)),
                                scales[i]);
                            u[i] = c == 0 ? q01[i] : q23[i];
                        }
                        chunk<MT, NR, 5>(acc, u, ws, x, m0, 256L * b + 128 * h + 64 * c, none);
                    }
                }
            }
        }
        for (int i = 0; i < NR; i++)
            for (int r = 0; r < MT; r++)
                y[static_cast<long>(m0 + r) * N + first + n + i] =
                    _mm512_reduce_add_ps(acc[i][r]) - mins[i][r];
    }
}

// Rows [m0, m0 + MT) of x over outputs [n0, n1): 4 weight rows a pass for 1 or 2 rows of x, 2
// for 4 (loads of x are then a pass's larger cost; 4 rows: Q4_K in cache 9.1 -> 10.9 GB/s a
// core; on a Zen 5 core, one thread, a 125M step: 2 rows of x 0.79-0.97x the time of 2 weight
// rows, 4 and 8 rows 0.77-0.97x that of 1, Q8_0 and Q4_0/ZP gaining most, Q4_K least; 8 a
// pass lost), the rows left over one at a time.
template <int MT>
VNNI void rows_all(const Part &p, const Rows &x, int m0, long n0, long n1, float *y, long N,
                   long first)
{
    constexpr int NR = MT == 4 ? 2 : 4;
    const long paired = n0 + (n1 - n0) / NR * NR;
    switch (p.type) {
#define FLEETLLM_ROWS(T)                                                                           \
    case T:                                                                                        \
        rows<MT, NR, T>(p, x, m0, n0, paired, y, N, first);                                        \
        if (paired < n1)                                                                           \
            rows<MT, 1, T>(p, x, m0, paired, n1, y, N, first);                                     \
        break;
        FLEETLLM_ROWS(Q8_0)
        FLEETLLM_ROWS(Q8_ZP)
        FLEETLLM_ROWS(Q4_0)
        FLEETLLM_ROWS(Q4_1)
        FLEETLLM_ROWS(Q4_ZP)
        FLEETLLM_ROWS(Q4_K)
        FLEETLLM_ROWS(Q5_K)
        FLEETLLM_ROWS(Q6_K)
#undef FLEETLLM_ROWS
    default:
        break;
    }
}

}  // namespace

bool vnni_available()
{
    static const bool ok =
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("f16c") &&
        !(std::getenv("FLEETLLM_QUANT_VNNI") && std::getenv("FLEETLLM_QUANT_VNNI")[0] == '0');
    return ok;
}

bool vnni_reads(int64_t type, int K)
{
    return K % 64 == 0 &&
           (type == Q8_0 || type == Q8_ZP || type == Q4_0 || type == Q4_1 || type == Q4_ZP ||
            type == Q4_K || type == Q5_K || type == Q6_K);
}

// per_row (W8A8, quant.h): each row's one int8 plane with the scale max |x| / 127 and x / scale
// rounded to nearest even, the arithmetic of quant_ops.cpp's int8_levels bit for bit, and no
// second plane: the GEMV's sums are then the format's exactly, as its GEMM's are.
VNNI void vnni_quantize(const float *x, int M, int K, int8_t *xq, float *dxl, int32_t *xls,
                        float *xqsum, bool per_row)
{
    const long n = static_cast<long>(M) * K;
    float row_scale = 0.0f;
    for (long i = 0; i < n; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        if (per_row && i % K == 0) {
            __m512 m = _mm512_setzero_ps();
            for (long k = i; k < i + K; k += 16)
                m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
            row_scale = std::max(_mm512_reduce_max_ps(m) / 127.0f, FLT_MIN);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float dx = per_row ? row_scale : amax / 127.0f;
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        const __m512 s = _mm512_set1_ps(inv), s2 = _mm512_set1_ps(128.0f);
        __m512i q[2], r[2];
        const __m512 v[2] = {a, b};
        for (int h = 0; h < 2; h++) {
            const __m512 scaled = per_row ? _mm512_div_ps(v[h], _mm512_set1_ps(row_scale))
                                          : _mm512_mul_ps(v[h], s);  // in units of dx
            q[h] = _mm512_cvtps_epi32(scaled);
            r[h] = per_row ? _mm512_setzero_si512()
                           : _mm512_cvtps_epi32(_mm512_mul_ps(
                                 _mm512_sub_ps(scaled, _mm512_cvtepi32_ps(q[h])), s2));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(xq + i + 16 * h),
                             _mm512_cvtsepi32_epi8(q[h]));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(xq + n + i + 16 * h),
                             _mm512_cvtsepi32_epi8(r[h]));
        }
        // per 4 elements: (sum q1) * 128 + sum q2
        alignas(64) int32_t tot[32];
        _mm512_store_si512(tot, _mm512_add_epi32(_mm512_slli_epi32(q[0], 7), r[0]));
        _mm512_store_si512(tot + 16, _mm512_add_epi32(_mm512_slli_epi32(q[1], 7), r[1]));
        int32_t g16[2] = {0, 0};
        for (int l = 0; l < 8; l++) {
            xls[i / 4 + l] = tot[4 * l] + tot[4 * l + 1] + tot[4 * l + 2] + tot[4 * l + 3];
            g16[l / 4] += xls[i / 4 + l];
            dxl[i / 4 + l] = dx / 128.0f;
        }
        xqsum[i / 16] = dx / 128.0f * static_cast<float>(g16[0]);
        xqsum[i / 16 + 1] = dx / 128.0f * static_cast<float>(g16[1]);
    }
}

VNNI void vnni_rows(const Part &p, const int8_t *xq, const float *dxl, const int32_t *xls,
                    const float *xqsum, int K, int M, long n0, long n1, float *y, long N,
                    long first)
{
    const Rows x{xq, static_cast<long>(M) * K, dxl, xqsum, xls, K};
    int m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) rows_all<4>(p, x, m0, n0, n1, y, N, first);
    for (; m0 + 2 <= M; m0 += 2) rows_all<2>(p, x, m0, n0, n1, y, N, first);
    for (; m0 < M; m0++) rows_all<1>(p, x, m0, n0, n1, y, N, first);
}

}  // namespace fleetllm::kernels::quant

#else  // not x86-64: no VNNI path

namespace fleetllm::kernels::quant {
bool vnni_available()
{
    return false;
}
bool vnni_reads(int64_t, int)
{
    return false;
}
void vnni_quantize(const float *, int, int, int8_t *, float *, int32_t *, float *, bool) {}
void vnni_rows(const Part &, const int8_t *, const float *, const int32_t *, const float *, int,
               int, long, long, float *, long, long)
{
}
}  // namespace fleetllm::kernels::quant

#endif
