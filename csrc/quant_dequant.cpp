// The dequantization on AVX-512 (quant.h's fast_dequant_*; avx512f/bw/dq/vl and f16c, no VNNI):
// the rows a prompt's GEMM (quant_ops.cpp) and an embedding read, for Q8_0, Q8_ZP, Q4_0, Q4_1,
// Q4_ZP, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K. Per 16 weights: their bytes widened to int32 lanes,
// nibbles and high bits masked and shifted there, converted to float, times the scale, less the
// minimum, stored as float32 or rounded to bf16. quant.cpp's unpack() goes through int8 and a
// scalar loop per type (~1.5 G weights/s on 2 threads). Built into every x86 variant with the
// target attribute and run only where the CPU has the features (fast_dequant_available); the
// others keep the generic path.
// The same values as the generic unpacking, s * q - m per element with s and m computed as
// unpack() does: every product s * q is exact in float32 (an fp16 d has 11 significant bits;
// d times a 6-bit scale times a 5-bit q is at most 22; Q8_ZP's d (q - 128) 19), except Q6_K's
// (d times an 8-bit scale times a 6-bit q), which has no minimum: one rounding either way. So
// a fused multiply-subtract (which GCC may contract either loop to) gives the same bits.
#include "quant.h"

#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>

namespace fleetllm::kernels::quant {
namespace {

#define DEQ __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,avx2,fma")))

// 16 bytes at p, zero- or sign-extended to int32 lanes
DEQ inline __m512i u8(const uint8_t *p)
{
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
DEQ inline __m512i i8(const uint8_t *p)
{
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

DEQ inline __m512i low4(__m512i v)
{
    return _mm512_and_si512(v, _mm512_set1_epi32(0xF));
}

// bit `bit` of each lane, moved to bit 4 (Q5's and Q5_K's fifth bit)
DEQ inline __m512i bit4(__m512i v, __m512i bit)
{
    return _mm512_and_si512(_mm512_slli_epi32(_mm512_srlv_epi32(v, bit), 4),
                            _mm512_set1_epi32(0x10));
}

DEQ inline void put(float *o, __m512 v)
{
    _mm512_storeu_ps(o, v);
}

// bf16 rounded to nearest even, NaN as 0x7fc0: c10::BFloat16's conversion (the bits that
// .to(torch.bfloat16) of the float32 row gives)
DEQ inline void put(uint16_t *o, __m512 v)
{
    const __m512i b = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(o), _mm512_cvtepi32_epi16(r));
}

// s * q (types without minimums) and s * q - m, for 16 int32 q
template <typename T> DEQ inline void put(T *o, __m512i q, __m512 s)
{
    put(o, _mm512_mul_ps(s, _mm512_cvtepi32_ps(q)));
}
template <typename T> DEQ inline void put(T *o, __m512i q, __m512 s, __m512 m)
{
    put(o, _mm512_sub_ps(_mm512_mul_ps(s, _mm512_cvtepi32_ps(q)), m));
}

// One block of `type` at b into o (its elements); inlined into a loop per type (row_of).
template <typename T>
DEQ __attribute__((always_inline)) inline void block(int64_t type, const uint8_t *b, T *o)
{
    switch (type) {
    case Q8_0: {
        const __m512 d = _mm512_set1_ps(f16c_half_at(b));
        put(o, i8(b + 2), d);
        put(o + 16, i8(b + 18), d);
        return;
    }
    case Q8_ZP: {  // as unpack(): (q - 128) d - (z - 128) d
        const float dz = f16c_half_at(b);
        const __m512 d = _mm512_set1_ps(dz);
        const __m512 m = _mm512_set1_ps(dz * static_cast<float>(b[2] - 128));
        const __m512i off = _mm512_set1_epi32(128);
        put(o, _mm512_sub_epi32(u8(b + 4), off), d, m);
        put(o + 16, _mm512_sub_epi32(u8(b + 20), off), d, m);
        return;
    }
    case Q4_0:
    case Q4_1:
    case Q4_ZP:
    case Q5_0:
    case Q5_1: {
        const bool one = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
        const bool zp = type == Q4_ZP;
        const __m512 d = _mm512_set1_ps(f16c_half_at(b));
        const __m512i v = u8(b + (one || zp ? 4 : 2) + (five ? 4 : 0));
        __m512i lo = low4(v), hi = _mm512_srli_epi32(v, 4);
        if (five) {  // element j's fifth bit: qh bit j (low nibbles), j + 16 (high)
            uint32_t qh;
            std::memcpy(&qh, b + (one ? 4 : 2), 4);
            const __m512i h = _mm512_set1_epi32(static_cast<int>(qh));
            const __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                15);
            lo = _mm512_or_si512(lo, bit4(h, j));
            hi = _mm512_or_si512(hi, bit4(h, _mm512_add_epi32(j, _mm512_set1_epi32(16))));
        }
        if (one) {  // w = d q + m: less unpack()'s m = -(fp16 m)
            const __m512 m = _mm512_set1_ps(-f16c_half_at(b + 2));
            put(o, lo, d, m);
            put(o + 16, hi, d, m);
            return;
        }
        const __m512i off = _mm512_set1_epi32(zp ? b[2] : five ? 16 : 8);
        put(o, _mm512_sub_epi32(lo, off), d);
        put(o + 16, _mm512_sub_epi32(hi, off), d);
        return;
    }
    case Q4_K:
    case Q5_K: {
        const bool five = type == Q5_K;
        const float d = f16c_half_at(b), dmin = f16c_half_at(b + 2);
        const uint8_t *sc = b + 4, *ql = b + (five ? 48 : 16);
        __m512i qh[2] = {};
        if (five)
            qh[0] = u8(b + 16), qh[1] = u8(b + 32);
        for (int j = 0; j < 4; j++) {  // 64 elements: 32 low nibbles, then 32 high ones
            int s0, m0, s1, m1;
            scale_min_k4(2 * j, sc, s0, m0);
            scale_min_k4(2 * j + 1, sc, s1, m1);
            const __m512 vs0 = _mm512_set1_ps(d * static_cast<float>(s0)),
                         vm0 = _mm512_set1_ps(dmin * static_cast<float>(m0)),
                         vs1 = _mm512_set1_ps(d * static_cast<float>(s1)),
                         vm1 = _mm512_set1_ps(dmin * static_cast<float>(m1));
            for (int h = 0; h < 2; h++) {
                const __m512i v = u8(ql + 32 * j + 16 * h);
                __m512i lo = low4(v), hi = _mm512_srli_epi32(v, 4);
                if (five) {
                    lo = _mm512_or_si512(lo, bit4(qh[h], _mm512_set1_epi32(2 * j)));
                    hi = _mm512_or_si512(hi, bit4(qh[h], _mm512_set1_epi32(2 * j + 1)));
                }
                put(o + 64 * j + 16 * h, lo, vs0, vm0);
                put(o + 64 * j + 32 + 16 * h, hi, vs1, vm1);
            }
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = f16c_half_at(b + 208);
        const __m512i three = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
        for (int n = 0; n < 2; n++) {
            for (int h = 0; h < 2; h++) {  // l in [16h, 16h + 16)
                const __m512i l0 = u8(ql + 64 * n + 16 * h), l1 = u8(ql + 64 * n + 32 + 16 * h);
                const __m512i hb = u8(qh + 32 * n + 16 * h);
                const __m512i q[4] = {low4(l0), low4(l1), _mm512_srli_epi32(l0, 4),
                                      _mm512_srli_epi32(l1, 4)};
                for (int k = 0; k < 4; k++) {  // elements 128n + 32k + 16h: granule 8n + 2k + h
                    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(hb, 2 * k), three);
                    const __m512i v = _mm512_sub_epi32(
                        _mm512_or_si512(q[k], _mm512_slli_epi32(top, 4)), off);
                    put(o + 128 * n + 32 * k + 16 * h, v,
                        _mm512_set1_ps(d * static_cast<float>(sc[8 * n + 2 * k + h])));
                }
            }
        }
        return;
    }
    default:
        return;
    }
}

template <int64_t TYPE, typename T> DEQ void blocks(const uint8_t *row, int K, T *out)
{
    const Layout l = layout(TYPE);
    for (int b = 0; b < K / l.elems; b++)
        block(TYPE, row + static_cast<long>(b) * l.bytes, out + static_cast<long>(b) * l.elems);
}

template <typename T> DEQ void row_of(int64_t type, const uint8_t *row, int K, T *out)
{
    switch (type) {
    case Q8_0:
        return blocks<Q8_0>(row, K, out);
    case Q8_ZP:
        return blocks<Q8_ZP>(row, K, out);
    case Q4_0:
        return blocks<Q4_0>(row, K, out);
    case Q4_1:
        return blocks<Q4_1>(row, K, out);
    case Q4_ZP:
        return blocks<Q4_ZP>(row, K, out);
    case Q5_0:
        return blocks<Q5_0>(row, K, out);
    case Q5_1:
        return blocks<Q5_1>(row, K, out);
    case Q4_K:
        return blocks<Q4_K>(row, K, out);
    case Q5_K:
        return blocks<Q5_K>(row, K, out);
    case Q6_K:
        return blocks<Q6_K>(row, K, out);
    default:
        return;
    }
}

}  // namespace

bool fast_dequant_available()
{
    static const bool ok =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("f16c") &&
        !(std::getenv("FLEETLLM_QUANT_FAST_DEQUANT") &&
          std::getenv("FLEETLLM_QUANT_FAST_DEQUANT")[0] == '0');
    return ok;
}

bool fast_dequant_reads(int64_t type)
{
    return type == Q8_0 || type == Q8_ZP || type == Q4_0 || type == Q4_1 || type == Q4_ZP ||
           type == Q5_0 || type == Q5_1 || type == Q4_K || type == Q5_K || type == Q6_K;
}

DEQ void fast_dequant_row(int64_t type, const uint8_t *row, int K, float *out)
{
    row_of(type, row, K, out);
}

DEQ void fast_dequant_row(int64_t type, const uint8_t *row, int K, uint16_t *out)
{
    row_of(type, row, K, out);
}

}  // namespace fleetllm::kernels::quant

#else  // not x86-64: the generic path only

namespace fleetllm::kernels::quant {
bool fast_dequant_available()
{
    return false;
}
bool fast_dequant_reads(int64_t)
{
    return false;
}
void fast_dequant_row(int64_t, const uint8_t *, int, float *) {}
void fast_dequant_row(int64_t, const uint8_t *, int, uint16_t *) {}
}  // namespace fleetllm::kernels::quant

#endif
