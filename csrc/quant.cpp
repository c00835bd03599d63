// The quantized projections' kernels (quant.h) without VNNI (quant_vnni.cpp takes the common
// types' decode rows where the CPU has it). block_dot widens a block's values to float in
// registers, per 16 elements, scaled, multiplied with up to 8 rows of x and summed in float32
// vectors; minimums are applied once from x's sums per 16 (sum(w x) = sum(s q x) - sum(m *
// sum(x))). unpack gives a block as int8 values q and per 16 elements a scale s and minimum m
// (weight = s * q - m, as ggml's dequantize_row_* computes it): the dequantization a prompt's
// GEMM and an embedding's lookup read where quant_dequant.cpp's AVX-512 one (the same values)
// does not run. Compute-bound here, not memory-bound
// (docs/quantization.md).
#include "quant.h"

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels::quant {

Layout layout(int64_t type)
{
    switch (type) {
    case F32:
        return {1, 4};
    case F16:
    case BF16:
        return {1, 2};
    case Q4_0:
        return {32, 18};
    case Q4_1:
    case Q4_ZP:
        return {32, 20};
    case Q5_0:
        return {32, 22};
    case Q5_1:
        return {32, 24};
    case Q8_0:
        return {32, 34};
    case Q8_ZP:
        return {32, 36};
    case Q4_K:
        return {256, 144};
    case Q5_K:
        return {256, 176};
    case Q6_K:
        return {256, 210};
    default:
        return {0, 0};
    }
}

const char *parse(const uint8_t *buf, int64_t nbytes, Weight &w)
{
    constexpr int HEAD = 4;  // magic, K, parts, perm offset
    const int64_t words = nbytes / 8;
    if (words < HEAD)
        return "shorter than its header";
    int64_t h[HEAD + 4 * MAX_PARTS];
    std::memcpy(h, buf, 8 * std::min<int64_t>(words, HEAD + 4 * MAX_PARTS));
    if (h[0] != QPACK_MAGIC)
        return "not a packed quantized weight (bad magic)";
    w.int8_acts = (h[2] & QPACK_INT8_ACTS) != 0;
    h[2] &= ~QPACK_INT8_ACTS;
    if (h[1] <= 0 || h[1] > (1 << 30) || h[2] <= 0 || h[2] > MAX_PARTS ||
        words < HEAD + 4 * h[2])
        return "a bad header (K or parts)";
    w.K = static_cast<int>(h[1]);
    w.parts = static_cast<int>(h[2]);
    w.N = 0;
    for (int p = 0; p < w.parts; p++) {
        const int64_t *d = h + HEAD + 4 * p;
        const Layout l = layout(d[0]);
        if (l.elems == 0)
            return "a part of a block type the kernels do not read";
        if (w.int8_acts && d[0] != Q8_0)
            return "int8 activations (W8A8) with a part that is not Q8_0";
        if (w.K % l.elems || d[2] != w.K / l.elems * l.bytes)
            return "a part whose row bytes do not match K and its block type";
        if (d[1] <= 0 || d[3] < 0 || d[3] % 8 || d[3] > nbytes || (nbytes - d[3]) / d[2] < d[1])
            return "a part that lies outside the buffer";
        w.part[p] = {d[0], d[1], d[2], buf + d[3]};
        w.N += d[1];
    }
    // the permutation: K words past the header, inside the buffer, every entry a column
    w.perm = nullptr;
    if (h[3] != 0) {
        if (h[3] < 8 * (HEAD + 4 * h[2]) || h[3] % 8 || h[3] > nbytes ||
            (nbytes - h[3]) / 8 < w.K)
            return "a column permutation that lies outside the buffer";
        for (int k = 0; k < w.K; k++) {
            int64_t v;
            std::memcpy(&v, buf + h[3] + 8L * k, 8);
            if (v < 0 || v >= w.K)
                return "a column permutation with an entry outside [0, K)";
        }
        w.perm = reinterpret_cast<const int64_t *>(buf + h[3]);  // 8-aligned (quant_ops.cpp)
    }
    return nullptr;
}

namespace {

inline float half(uint16_t h)
{
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (exp == 0x1f)
        return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
    if (exp)
        return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
    const float f = static_cast<float>(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    return sign ? -f : f;
}
inline float half_at(const uint8_t *p)
{
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half(h);
}

// One block of `type` into q (elems int8), s and m (elems / 16 each). Returns whether any
// minimum is nonzero (the types with minimums). The zero-point types stay exact: Q4_ZP's q - z
// fits int8; Q8_ZP's does not, so q - 128 with m = d (z - 128): d has 11 significant bits, both
// products and their difference d (q - z) (9 bits) are exact in float32.
bool unpack(int64_t type, const uint8_t *b, int8_t *q, float *s, float *m)
{
    switch (type) {
    case Q8_0:
        s[0] = s[1] = half_at(b);
        std::memcpy(q, b + 2, 32);
        return false;
    case Q8_ZP:
        s[0] = s[1] = half_at(b);
        for (int j = 0; j < 32; j++) q[j] = static_cast<int8_t>(b[4 + j] - 128);
        m[0] = m[1] = s[0] * static_cast<float>(b[2] - 128);
        return true;
    case Q4_0:
    case Q4_1:
    case Q4_ZP: {
        const bool one = type == Q4_1, zp = type == Q4_ZP;
        const uint8_t *qs = b + (one || zp ? 4 : 2);
        const int off = one ? 0 : zp ? b[2] : 8;
        for (int j = 0; j < 16; j++) {
            q[j] = static_cast<int8_t>((qs[j] & 0xF) - off);
            q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - off);
        }
        s[0] = s[1] = half_at(b);
        m[0] = m[1] = one ? -half_at(b + 2) : 0.0f;
        return one;
    }
    case Q5_0:
    case Q5_1: {
        const bool one = type == Q5_1;
        uint32_t qh;
        std::memcpy(&qh, b + (one ? 4 : 2), 4);
        const uint8_t *qs = b + (one ? 8 : 6);
        const int off = one ? 0 : 16;
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            q[j] = static_cast<int8_t>(((qs[j] & 0xF) | h0) - off);
            q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | h1) - off);
        }
        s[0] = s[1] = half_at(b);
        m[0] = m[1] = one ? -half_at(b + 2) : 0.0f;
        return one;
    }
    case Q4_K:
    case Q5_K: {
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + (type == Q5_K ? 48 : 16);
        for (int j = 0; j < 4; j++) {  // 64 elements: low nibbles, then high nibbles
            for (int half_ = 0; half_ < 2; half_++) {
                int scale, min;
                scale_min_k4(2 * j + half_, sc, scale, min);
                const int g = 4 * j + 2 * half_;
                s[g] = s[g + 1] = d * static_cast<float>(scale);
                m[g] = m[g + 1] = dmin * static_cast<float>(min);
            }
            int8_t *o = q + 64 * j;
            const uint8_t *l = ql + 32 * j;
            for (int i = 0; i < 32; i++) {
                o[i] = static_cast<int8_t>(l[i] & 0xF);
                o[i + 32] = static_cast<int8_t>(l[i] >> 4);
            }
            if (type == Q5_K)
                for (int i = 0; i < 32; i++) {
                    o[i] = static_cast<int8_t>(o[i] | (((qh[i] >> (2 * j)) & 1) << 4));
                    o[i + 32] =
                        static_cast<int8_t>(o[i + 32] | (((qh[i] >> (2 * j + 1)) & 1) << 4));
                }
        }
        return true;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = half_at(b + 208);
        for (int g = 0; g < 16; g++) s[g] = d * static_cast<float>(sc[g]);
        for (int n = 0; n < 2; n++) {
            const uint8_t *l = ql + 64 * n, *h = qh + 32 * n;
            int8_t *o = q + 128 * n;
            for (int i = 0; i < 32; i++) {
                o[i] = static_cast<int8_t>(((l[i] & 0xF) | ((h[i] & 3) << 4)) - 32);
                o[i + 32] =
                    static_cast<int8_t>(((l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4)) - 32);
                o[i + 64] = static_cast<int8_t>(((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32);
                o[i + 96] = static_cast<int8_t>(((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32);
            }
        }
        return false;
    }
    default:
        return false;
    }
}

// Element k of a plain (float) row.
inline float plain(int64_t type, const uint8_t *row, long k)
{
    if (type == F32) {
        float f;
        std::memcpy(&f, row + 4 * k, 4);
        return f;
    }
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    return type == F16 ? half(h) : __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16);
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16u __attribute__((vector_size(16), aligned(1), may_alias));

inline u8x16 bytes16(const uint8_t *p)
{
    return *reinterpret_cast<const u8x16u *>(p);
}

// 16 unsigned (or, floats_i8, signed) bytes as floats (out-parameters: a 64-byte vector
// returned by value would change the portable and avx2 builds' ABI, which -Wpsabi rejects).
// Intrinsics: GCC lowers a generic __builtin_convertvector from 16 bytes to 16 floats
// element by element.
inline void floats(u8x16 q, v16 &out)
{
#if defined(__AVX512F__)
    out = __builtin_bit_cast(
        v16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(__builtin_bit_cast(__m128i, q))));
#elif defined(__AVX2__)
    const __m128i v = __builtin_bit_cast(__m128i, q);
    const v8 lo = __builtin_bit_cast(v8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    const v8 hi =
        __builtin_bit_cast(v8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v))));
    out = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    for (int i = 0; i < 16; i++) out[i] = static_cast<float>(q[i]);
#endif
}
inline void floats_i8(const uint8_t *p, v16 &out)
{
#if defined(__AVX512F__)
    out = __builtin_bit_cast(v16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)))));
#else
    floats(bytes16(p) ^ 0x80, out);
    out -= 128.0f;
#endif
}

struct LinearCtx {
    const float *x, *xsum;  // x [M, K]; its sums per 16 elements [M, K / 16]
    const Weight *w;
    float *y;
    int M;
    const int8_t *xq;  // x quantized for the VNNI path (vnni_quantize), or nullptr
    const float *dxl, *xqsum;
    const int32_t *xls;
};

// Per row r of MT rows of x: acc[r] += sum over 16 lanes of v * x_r[off..off+16).
template <int MT>
inline void fma16(v16 (&acc)[MT], const v16 &v, const float *const (&x)[MT], long off)
{
    for (int r = 0; r < MT; r++) {
        v16 xv;
        load16(x[r] + off, xv);
        acc[r] += v * xv;
    }
}

// sum over 32 elements of q * x (q from 2 x 16 unsigned or signed values), scaled: acc += d * .
template <int MT> inline void scaled(v16 (&acc)[MT], const v16 (&t)[MT], float d)
{
    for (int r = 0; r < MT; r++) acc[r] += t[r] * d;
}

// One block of `type` against MT rows of x (x[r] at the block's first element): acc[r] gets
// sum(s * q * x) in 16 lanes, mins[r] sum(m * x) (xs[r]: x's sums per 16 at the block).
template <int MT>
void block_dot(int64_t type, const uint8_t *b, const float *const (&x)[MT],
               const float *const (&xs)[MT], v16 (&acc)[MT], float (&mins)[MT])
{
    v16 t[MT];
    auto zero = [&] {
        for (int r = 0; r < MT; r++) t[r] = v16{};
    };
    switch (type) {
    case Q8_0:
    case Q8_ZP: {  // Q8_ZP: q unsigned, less the block's z
        zero();
        for (int g = 0; g < 2; g++) {
            v16 v;
            if (type == Q8_ZP) {
                floats(bytes16(b + 4 + 16 * g), v);
                v -= static_cast<float>(b[2]);
            } else {
                floats_i8(b + 2 + 16 * g, v);
            }
            fma16(t, v, x, 16 * g);
        }
        scaled(acc, t, half_at(b));
        return;
    }
    case Q4_0:
    case Q4_1:
    case Q4_ZP:
    case Q5_0:
    case Q5_1: {
        const bool one = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
        const bool zp = type == Q4_ZP;  // Q4_1's layout, offset by the block's z
        const uint8_t *qs = b + (one || zp ? 4 : 2) + (five ? 4 : 0);
        const u8x16 raw = bytes16(qs);
        u8x16 lo = raw & 0xF, hi = raw >> 4;
        if (five) {
            uint32_t qh;
            std::memcpy(&qh, b + (one ? 4 : 2), 4);
            const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
            const u8x16 h0 = {
                (uint8_t)qh,        (uint8_t)qh,        (uint8_t)qh,        (uint8_t)qh,
                (uint8_t)qh,        (uint8_t)qh,        (uint8_t)qh,        (uint8_t)qh,
                (uint8_t)(qh >> 8), (uint8_t)(qh >> 8), (uint8_t)(qh >> 8), (uint8_t)(qh >> 8),
                (uint8_t)(qh >> 8), (uint8_t)(qh >> 8), (uint8_t)(qh >> 8), (uint8_t)(qh >> 8)};
            const u8x16 h1 = {
                (uint8_t)(qh >> 16), (uint8_t)(qh >> 16), (uint8_t)(qh >> 16), (uint8_t)(qh >> 16),
                (uint8_t)(qh >> 16), (uint8_t)(qh >> 16), (uint8_t)(qh >> 16), (uint8_t)(qh >> 16),
                (uint8_t)(qh >> 24), (uint8_t)(qh >> 24), (uint8_t)(qh >> 24), (uint8_t)(qh >> 24),
                (uint8_t)(qh >> 24), (uint8_t)(qh >> 24), (uint8_t)(qh >> 24), (uint8_t)(qh >> 24)};
            lo |= ((h0 & bit) != 0) & 0x10;
            hi |= ((h1 & bit) != 0) & 0x10;
        }
        zero();
        const float off = zp ? static_cast<float>(b[2]) : one ? 0.0f : (five ? 16.0f : 8.0f);
        v16 v;
        floats(lo, v);
        fma16(t, v - off, x, 0);
        floats(hi, v);
        fma16(t, v - off, x, 16);
        scaled(acc, t, half_at(b));
        if (one) {
            const float m = half_at(b + 2);
            for (int r = 0; r < MT; r++) mins[r] -= m * (xs[r][0] + xs[r][1]);
        }
        return;
    }
    case Q4_K:
    case Q5_K: {
        const bool five = type == Q5_K;
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + (five ? 48 : 16);
        for (int j = 0; j < 4; j++) {  // 64 elements: 32 low nibbles, then 32 high ones
            int s0, m0, s1, m1;
            scale_min_k4(2 * j, sc, s0, m0);
            scale_min_k4(2 * j + 1, sc, s1, m1);
            const u8x16 a = bytes16(ql + 32 * j), c = bytes16(ql + 32 * j + 16);
            u8x16 q0 = a & 0xF, q1 = c & 0xF, q2 = a >> 4, q3 = c >> 4;
            if (five) {
                const u8x16 h0 = bytes16(qh), h1 = bytes16(qh + 16);
                q0 |= ((h0 >> (2 * j)) & 1) << 4;
                q1 |= ((h1 >> (2 * j)) & 1) << 4;
                q2 |= ((h0 >> (2 * j + 1)) & 1) << 4;
                q3 |= ((h1 >> (2 * j + 1)) & 1) << 4;
            }
            v16 v;
            zero();
            floats(q0, v);
            fma16(t, v, x, 64 * j);
            floats(q1, v);
            fma16(t, v, x, 64 * j + 16);
            scaled(acc, t, d * static_cast<float>(s0));
            zero();
            floats(q2, v);
            fma16(t, v, x, 64 * j + 32);
            floats(q3, v);
            fma16(t, v, x, 64 * j + 48);
            scaled(acc, t, d * static_cast<float>(s1));
            for (int r = 0; r < MT; r++) {
                const float *s16 = xs[r] + 4 * j;
                mins[r] += dmin * (static_cast<float>(m0) * (s16[0] + s16[1]) +
                                   static_cast<float>(m1) * (s16[2] + s16[3]));
            }
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = half_at(b + 208);
        for (int n = 0; n < 2; n++) {
            for (int h = 0; h < 2; h++) {  // l in [16h, 16h + 16)
                const u8x16 l0 = bytes16(ql + 64 * n + 16 * h),
                            l1 = bytes16(ql + 64 * n + 32 + 16 * h);
                const u8x16 hb = bytes16(qh + 32 * n + 16 * h);
                const u8x16 q[4] = {
                    (l0 & 0xF) | ((hb & 3) << 4), (l1 & 0xF) | (((hb >> 2) & 3) << 4),
                    (l0 >> 4) | (((hb >> 4) & 3) << 4), (l1 >> 4) | (((hb >> 6) & 3) << 4)};
                for (int k = 0; k < 4; k++) {  // elements 128n + 32k + 16h: granule 8n + 2k + h
                    zero();
                    v16 v;
                    floats(q[k], v);
                    fma16(t, v - 32.0f, x, 128 * n + 32 * k + 16 * h);
                    scaled(acc, t, d * static_cast<float>(sc[8 * n + 2 * k + h]));
                }
            }
        }
        return;
    }
    default:
        return;
    }
}

// Rows of x [m0, m0 + MT) against weight rows [n0, n1) of one part (`first`: its first
// output).
template <int MT>
void rows_dot(const LinearCtx &c, const Part &p, long first, long n0, long n1, int m0)
{
    const int K = c.w->K;
    const Layout l = layout(p.type);
    const int blocks = K / l.elems, KG = K / 16;
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = p.data + n * p.row_bytes;
        float out[MT];
        if (l.elems == 1) {  // plain rows
            for (int r = 0; r < MT; r++) {
                const float *xr = c.x + static_cast<long>(m0 + r) * K;
                float acc = 0;
                for (int k = 0; k < K; k++) acc += plain(p.type, row, k) * xr[k];
                out[r] = acc;
            }
        } else {
            v16 acc[MT];
            float mins[MT] = {};
            for (int r = 0; r < MT; r++) acc[r] = v16{};
            for (int b = 0; b < blocks; b++) {
                const long base = static_cast<long>(b) * l.elems;
                const float *x[MT], *xs[MT];
                for (int r = 0; r < MT; r++) {
                    x[r] = c.x + static_cast<long>(m0 + r) * K + base;
                    xs[r] = c.xsum + static_cast<long>(m0 + r) * KG + base / 16;
                }
                const uint8_t *blk = row + static_cast<long>(b) * l.bytes;
                for (int o = 0; o < l.bytes; o += 64)  // the stream 4 KiB on (one row at a time)
                    __builtin_prefetch(blk + 4096 + o);
                block_dot<MT>(p.type, blk, x, xs, acc, mins);
            }
            for (int r = 0; r < MT; r++) {
                float t = 0;
                for (int i = 0; i < 16; i++) t += acc[r][i];
                out[r] = t - mins[r];
            }
        }
        for (int r = 0; r < MT; r++) c.y[static_cast<long>(m0 + r) * c.w->N + first + n] = out[r];
    }
}

// Outputs [begin, end) (across parts) for every row of x.
void linear_body(void *arg, long begin, long end, int)
{
    const LinearCtx &c = *static_cast<const LinearCtx *>(arg);
    long first = 0;
    for (int pi = 0; pi < c.w->parts; pi++) {
        const Part &p = c.w->part[pi];
        const long lo = std::max(begin, first), hi = std::min(end, first + p.rows);
        if (lo < hi && c.xq != nullptr && vnni_reads(p.type, c.w->K)) {
            vnni_rows(p, c.xq, c.dxl, c.xls, c.xqsum, c.w->K, c.M, lo - first, hi - first, c.y,
                      c.w->N, first);
        } else if (lo < hi) {
            int m0 = 0;
            for (; m0 + 8 <= c.M; m0 += 8) rows_dot<8>(c, p, first, lo - first, hi - first, m0);
            for (; m0 + 4 <= c.M; m0 += 4) rows_dot<4>(c, p, first, lo - first, hi - first, m0);
            for (; m0 + 2 <= c.M; m0 += 2) rows_dot<2>(c, p, first, lo - first, hi - first, m0);
            for (; m0 < c.M; m0++) rows_dot<1>(c, p, first, lo - first, hi - first, m0);
        }
        first += p.rows;
    }
}

struct DequantCtx {
    const Weight *w;
    long r0;
    float *out;
    uint16_t *bf16;  // instead of out: every part fast_dequant_reads
    bool fast;       // fast_dequant_available()
};

void dequant_body(void *arg, long begin, long end, int)
{
    const DequantCtx &c = *static_cast<const DequantCtx *>(arg);
    const int K = c.w->K;
    alignas(64) int8_t q[256];
    float s[16], m[16];
    for (long i = begin; i < end; i++) {
        long n = c.r0 + i;
        int pi = 0;
        while (n >= c.w->part[pi].rows) n -= c.w->part[pi++].rows;
        const Part &p = c.w->part[pi];
        const Layout l = layout(p.type);
        const uint8_t *row = p.data + n * p.row_bytes;
        if (c.bf16) {
            fast_dequant_row(p.type, row, K, c.bf16 + i * K);
            continue;
        }
        float *o = c.out + i * K;
        if (c.fast && fast_dequant_reads(p.type)) {  // quant_dequant.cpp: the same values
            fast_dequant_row(p.type, row, K, o);
            continue;
        }
        if (l.elems == 1) {
            for (int k = 0; k < K; k++) o[k] = plain(p.type, row, k);
            continue;
        }
        for (int b = 0; b < K / l.elems; b++) {
            const bool has_min = unpack(p.type, row + static_cast<long>(b) * l.bytes, q, s, m);
            float *ob = o + static_cast<long>(b) * l.elems;
            for (int e = 0; e < l.elems; e++)
                ob[e] = s[e / 16] * static_cast<float>(q[e]) - (has_min ? m[e / 16] : 0.0f);
        }
    }
}

}  // namespace

void linear(const float *x, int M, const Weight &w, float *y, int nthreads)
{
    const int K = w.K, KG = K / 16;
    std::vector<float> xsum(static_cast<size_t>(M) * std::max(KG, 1));
    if (K % 16 == 0)
        for (int r = 0; r < M; r++)
            for (int g = 0; g < KG; g++) {
                float t = 0;
                for (int i = 0; i < 16; i++) t += x[static_cast<long>(r) * K + 16 * g + i];
                xsum[static_cast<size_t>(r) * KG + g] = t;
            }
    // The VNNI path: x quantized once for the parts it reads (a decode step's few rows).
    bool vnni = M <= 8 && vnni_available();
    bool reads = false;
    for (int p = 0; p < w.parts; p++) reads = reads || vnni_reads(w.part[p].type, K);
    vnni = vnni && reads;
    const size_t n = vnni ? static_cast<size_t>(M) * K : 0;
    std::vector<int8_t> xq(2 * n);  // two planes (quant_vnni.cpp)
    std::vector<float> dxl(n / 4);
    std::vector<int32_t> xls(n / 4);
    std::vector<float> xqsum(n / 16);
    if (vnni)
        vnni_quantize(x, M, K, xq.data(), dxl.data(), xls.data(), xqsum.data(), w.int8_acts);
    LinearCtx c{x,          xsum.data(),  &w,        y, M, vnni ? xq.data() : nullptr,
                dxl.data(), xqsum.data(), xls.data()};
    // Chunks of outputs claimed by the threads: ~16 a thread, at least 4 rows.
    const long chunk = std::max(4L, w.N / (16L * std::max(nthreads, 1)));
    const bool small = static_cast<long>(K) * w.N < 4 * PAR_MIN;
    parallel_run(small ? 1 : nthreads, linear_body, &c, w.N, chunk, M <= SPIN_ROWS);
}

void dequantize(const Weight &w, long r0, long rows, float *out, int nthreads)
{
    DequantCtx c{&w, r0, out, nullptr, fast_dequant_available()};
    const bool small = rows * w.K < 4 * PAR_MIN;
    parallel_run(small ? 1 : nthreads, dequant_body, &c, rows, 8, false);
}

void dequantize_bf16(const Weight &w, long r0, long rows, uint16_t *out, int nthreads)
{
    DequantCtx c{&w, r0, nullptr, out, true};
    const bool small = rows * w.K < 4 * PAR_MIN;
    parallel_run(small ? 1 : nthreads, dequant_body, &c, rows, 8, false);
}

}  // namespace fleetllm::kernels::quant
