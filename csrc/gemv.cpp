// The GEMV of decode steps: y = x . w^T (+ bias) for a few rows of x (a decode batch, a
// speculative step's k + 1, the LM head) streaming a dense [out, in] weight at the memory's
// bandwidth, where oneDNN and MKL stream it at half that for 1-4 rows (they pack or re-pack
// the weight for GEMM shapes). Tiles of 4 weight rows, split across the pool's threads in
// long runs; every row of x gets the same bits whatever rows share the call (a prompt alone
// or in a shared step, a sequence in any decode batch). Per dtype and CPU: bf16 by
// AVX-512 BF16's dot products of pairs (dp_block), else widened to float32 (gemv_tile,
// gemv_tile_split without AVX-512); float32 with AVX-512 by gemv_tile_f32.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for up to 4 rows m (gemv_body runs more as groups
// of 4 over the same tile, from L1): the tile's weight rows one after the other (one
// sequential stream per thread; two FMA chains per row of x), float32 sums (a bfloat16 weight
// is widened in registers: a shift, no memory traffic). Memory-bound: it runs at the machine's
// read bandwidth where a GEMM library re-packs or underuses it. (float32 with AVX-512 takes
// gemv_tile_f32 below instead.)
template <int MT, class T>
void gemv_tile(const T *x, const T *w, const T *bias, T *y, long n0, int N, int K)
{
    const int rows = N - n0 < 4 ? static_cast<int>(N - n0) : 4, kv = K & ~31;
    for (int r = 0; r < rows; r++) {  // one row at a time: one sequential stream
        const T *wr = w + (n0 + r) * K;
#if defined(__AVX512F__)
        v16 acc[2][MT];
        std::memset(acc, 0, sizeof(acc));
        for (int k = 0; k < kv; k += 32) {
            v16 w0, w1, x0, x1;
            load16(wr + k, w0);
            load16(wr + k + 16, w1);
            for (int m = 0; m < MT; m++) {
                const T *xm = x + static_cast<long>(m) * K + k;
                load16(xm, x0);
                load16(xm + 16, x1);
                acc[0][m] += x0 * w0;
                acc[1][m] += x1 * w1;
            }
        }
#else
        // The same 32 float32 sums per row of x (lane j of acc[q] adds elements k + 8q + j),
        // so the same bits as the AVX-512 build, in 8-lane registers the compiler keeps.
        v8 acc[4][MT];
        for (int q = 0; q < 4; q++)
            for (int m = 0; m < MT; m++) acc[q][m] = v8{};
        for (int k = 0; k < kv; k += 32) {
            for (int q = 0; q < 4; q++) {  // one weight vector at a time: fewer spills
                v8 wq;
                load8(wr + k + 8 * q, wq);
                for (int m = 0; m < MT; m++) {
                    v8 xq;
                    load8(x + static_cast<long>(m) * K + k + 8 * q, xq);
                    acc[q][m] += xq * wq;
                }
            }
        }
#endif
        for (int m = 0; m < MT; m++) {
            float s = bias ? to_f32(bias[n0 + r]) : 0.f;
#if defined(__AVX512F__)
            const v16 a = acc[0][m] + acc[1][m];
            for (int i = 0; i < 16; i++) s += a[i];
#else
            const v8 lo = acc[0][m] + acc[2][m], hi = acc[1][m] + acc[3][m];
            for (int i = 0; i < 8; i++) s += lo[i];
            for (int i = 0; i < 8; i++) s += hi[i];
#endif
            for (int k = kv; k < K; k++)
                s += to_f32(x[static_cast<long>(m) * K + k]) * to_f32(wr[k]);
            y[static_cast<long>(m) * N + n0 + r] = from_f32<T>(s);
        }
    }
}

#if !defined(__AVX512F__)
// The tile above for a bfloat16 weight without AVX-512, from x already widened to float32 by
// spread_x: one 32-byte load holds 16 weights, the even ones in the low halves of its 32-bit
// lanes and the odd ones in the high halves, so a shift (even) and a mask (odd) widen 8 each
// (load8's zero-extension costs two instructions per 8); spread_x put x's elements in the
// same even/odd order. Two accumulators per row of x (even and odd elements), each widened
// vector fed to every row of x before the next: 4 rows' 8 accumulators fit AVX2's 16
// registers (gemv_tile's 4 per row, kept only to match the AVX-512 build's bits, spill at 4
// rows, and their 16-step sums cost a quarter of the tile), and the sums end in a short
// tree. Each output's sums depend on its own row of x only, not on how many rows share the
// call: a prompt gets the same bits alone or in a shared step.
typedef uint32_t u8x32u __attribute__((vector_size(32), aligned(2), may_alias));
typedef float v4 __attribute__((vector_size(16)));

inline void split16(const bf16 *p, v8 &even, v8 &odd)
{
    const u8x32 u = *reinterpret_cast<const u8x32u *>(p);
    even = __builtin_bit_cast(v8, u << 16);
    odd = __builtin_bit_cast(v8, u & 0xFFFF0000u);
}

template <int MT>
void gemv_tile_split(const float *xf, const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y,
                     long n0, int N, int K)
{
    const int rows = N - n0 < 4 ? static_cast<int>(N - n0) : 4, kv = K & ~15;
    for (int r = 0; r < rows; r++) {  // one row at a time: one sequential stream
        const bf16 *wr = w + (n0 + r) * K;
        v8 acc[2][MT];
        for (int q = 0; q < 2; q++)
            for (int m = 0; m < MT; m++) acc[q][m] = v8{};
        for (int k = 0; k < kv; k += 16) {
            v8 wv[2];
            split16(wr + k, wv[0], wv[1]);
            for (int q = 0; q < 2; q++)
                for (int m = 0; m < MT; m++)
                    acc[q][m] += *reinterpret_cast<const v8u *>(xf + m * K + k + 8 * q) * wv[q];
        }
        for (int m = 0; m < MT; m++) {
            const v8 a = acc[0][m] + acc[1][m];
            v4 h = __builtin_shufflevector(a, a, 0, 1, 2, 3);
            h += __builtin_shufflevector(a, a, 4, 5, 6, 7);
            h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
            float s = (bias ? to_f32(bias[n0 + r]) : 0.f) + (h[0] + h[1]);
            for (int k = kv; k < K; k++)
                s += to_f32(x[static_cast<long>(m) * K + k]) * to_f32(wr[k]);
            y[static_cast<long>(m) * N + n0 + r] = from_f32<bf16>(s);
        }
    }
}

// x's first K & ~15 elements of each row in float32, each 16 as the even ones then the odd
// ones (gemv_tile_split's order). Exact: a bfloat16 widens to float32 without rounding.
void spread_x(const bf16 *x, float *xf, int M, int K)
{
    const int kv = K & ~15;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < kv; k += 16) {
            v8 even, odd;
            split16(x + static_cast<long>(m) * K + k, even, odd);
            *reinterpret_cast<v8u *>(xf + static_cast<long>(m) * K + k) = even;
            *reinterpret_cast<v8u *>(xf + static_cast<long>(m) * K + k + 8) = odd;
        }
}
#endif

template <class T>
struct GemvCtx {
    const T *x, *w, *bias;
    T *y;
    const float *xf;  // x spread to float32 (bfloat16 without AVX-512), else null
    int M, N, K;
};

#if defined(__AVX512F__)
// The sums of 4 accumulators' 16 lanes each, in one shuffle tree (the same order for every
// accumulator).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    // 16 -> 8 lanes each, two accumulators per register: lanes i and i + 8 of each added
    const __m512 lo01 = _mm512_shuffle_f32x4(a0, a1, 0x44), hi01 = _mm512_shuffle_f32x4(a0, a1, 0xEE);
    const __m512 lo23 = _mm512_shuffle_f32x4(a2, a3, 0x44), hi23 = _mm512_shuffle_f32x4(a2, a3, 0xEE);
    const __m512 s01 = _mm512_add_ps(lo01, hi01), s23 = _mm512_add_ps(lo23, hi23);
    // 8 -> 4 lanes each: quarters 0 and 1 of every accumulator's 8 added
    const __m512 even = _mm512_shuffle_f32x4(s01, s23, 0x88), odd = _mm512_shuffle_f32x4(s01, s23, 0xDD);
    const __m512 q = _mm512_add_ps(even, odd);  // quarter r: accumulator r's 4 partial sums
    const __m128 h01 = _mm_hadd_ps(_mm512_castps512_ps128(q), _mm512_extractf32x4_ps(q, 1));
    const __m128 h23 = _mm_hadd_ps(_mm512_extractf32x4_ps(q, 2), _mm512_extractf32x4_ps(q, 3));
    return _mm_hadd_ps(h01, h23);
}

// bf16 with AVX-512 BF16's dot product of bf16 pairs (vdpbf16ps: 32 weights per instruction),
// on CPUs that have it (checked at run time: the avx512 variant also runs on CPUs without it).
// Each output sums in two 16-lane accumulators (the first and second 32 elements of every 64
// of k, in order: two chains, as a single stream of one row of x needs to keep the memory
// busy), added at the end, then sum4 for a tile's 4 outputs of a row of x, the bias and the
// scalar tail: the same arithmetic whatever the loop order or the rows beside it, so a row of
// x gets the same bits alone or in a batch. From 3 rows of x a tile's weight rows are read
// two at a time, each x vector feeding both (tools/cpu_gemv_bench.py, weights from memory,
// 2-core Zen 4: 6-16 rows 1.3-1.7x the one-row-at-a-time tile before it, which oneDNN beat
// from 4 rows on large layers). k goes in blocks of DP_BLOCK where more than DP_ROWS rows of
// x take turns on a tile, so that each finds the block in L1.

// Where a group's sums end: its outputs, the tile's bias and the scalar tail of k.
struct DpEnd {
    bf16 *y;  // the group's first output row at this tile's column n0
    const bf16 *bias;  // at n0, or null
    long N;
    int rows, kv, K;
};

typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));

// y[m][r] = sum4 over r of acc's two accumulators added + bias[r] (+ the tail), rounded once
// to bf16.
inline void dp_finish(int MT, const float *acc, const bf16 *x, const bf16 *const *wr,
                      const DpEnd &e)
{
    for (int m = 0; m < MT; m++) {
        __m512 a[4];
        for (int r = 0; r < 4; r++)
            a[r] = _mm512_add_ps(_mm512_load_ps(acc + ((m * 4 + r) * 2) * 16),
                                 _mm512_load_ps(acc + ((m * 4 + r) * 2 + 1) * 16));
        const v4f s = (v4f)sum4(a[0], a[1], a[2], a[3]);
        bf16 *ym = e.y + m * e.N;
        if (e.rows == 4 && e.kv == e.K) {  // the usual tile: 4 outputs at once
            v4f b = {};
            if (e.bias)
                for (int r = 0; r < 4; r++) b[r] = to_f32(e.bias[r]);
            store_lanes<bf16, v4f, v4u, v4h>(ym, s + b);
            continue;
        }
        const bf16 *xm = x + m * static_cast<long>(e.K);
        for (int r = 0; r < e.rows; r++) {
            float v = s[r] + (e.bias ? to_f32(e.bias[r]) : 0.f);
            for (int k = e.kv; k < e.K; k++) v += to_f32(xm[k]) * to_f32(wr[r][k]);
            ym[r] = from_f32<bf16>(v);
        }
    }
}

// Adds k in [k0, k1) for MT rows of x to their accumulators in acc ([m][r][2][16]: two per
// output, the first 32 and the next 32 of every 64 elements of k; zeros at k0 = 0); at the
// end of the row (end), the outputs. At 1 and 2 rows of x, a weight row at a time (one
// sequential stream, which the hardware prefetcher follows); from 3, two weight rows at once,
// each x vector feeding 2 dot products, and the first group of rows asks for the same rows of
// the tile four ahead into L2 (4 lines per step: as fast as this one is read).
template <int MT>
__attribute__((target("avx512bf16"), always_inline)) inline void dp_block(
                                                    const bf16 *x, long K, const bf16 *const *wr,
                                                    int k0, int k1, float *acc,
                                                    const bf16 *ahead, const DpEnd *end)
{
    constexpr int R = MT <= 2 ? 1 : 2;  // weight rows per pass
    for (int r0 = 0; r0 < 4; r0 += R) {
        __m512 a[MT][R][2];
        for (int m = 0; m < MT; m++)
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++)
                    a[m][r][h] = k0 == 0 ? _mm512_setzero_ps()
                                         : _mm512_load_ps(acc + ((m * 4 + r0 + r) * 2 + h) * 16);
        for (int k = k0; k < k1; k += 64) {
            if constexpr (R == 1) {  // the stream 1 KiB ahead, into L1
                _mm_prefetch(reinterpret_cast<const char *>(wr[r0] + k) + 1024, _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char *>(wr[r0] + k) + 1088, _MM_HINT_T0);
            } else if (ahead) {
                for (int r = 0; r < R; r++) {
                    const char *p = reinterpret_cast<const char *>(ahead + (r0 + r) * K + k);
                    _mm_prefetch(p, _MM_HINT_T1);
                    _mm_prefetch(p + 64, _MM_HINT_T1);
                }
            }
            __m512bh w[R][2];
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++)
                    w[r][h] = (__m512bh)_mm512_loadu_si512(wr[r0 + r] + k + 32 * h);
            for (int m = 0; m < MT; m++)
                for (int h = 0; h < 2; h++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * h);
                    for (int r = 0; r < R; r++)
                        a[m][r][h] = _mm512_dpbf16_ps(a[m][r][h], xv, w[r][h]);
                }
        }
        for (int m = 0; m < MT; m++)
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++)
                    _mm512_store_ps(acc + ((m * 4 + r0 + r) * 2 + h) * 16, a[m][r][h]);
    }
    if (end) dp_finish(MT, acc, x, wr, *end);
}

// Rows of x per pass over a weight tile (6 x 2 x 2 accumulators fit the 32 registers with
// the 4 weight vectors and an x vector), and the k elements summed per block: every group of
// rows meets a block of the tile while it is in L1 (6 rows of x and 4 weight rows of 1024
// bf16s: 20 KiB), as Llama-1B's 8192-long rows would not.
constexpr int DP_ROWS = 6, DP_BLOCK = 1024;

// A tile's 4 weight rows (a short last tile repeats its last one; rows: how many are real)
// and the same rows of the tile four ahead, for dp_block to prefetch (null near the end).
struct DpTile {
    const bf16 *wr[4];
    const bf16 *ahead;
    int rows;
};

inline DpTile dp_tile(const GemvCtx<bf16> *c, long n0)
{
    const int N = c->N, K = c->K;
    DpTile t{};
    t.rows = N - n0 < 4 ? static_cast<int>(N - n0) : 4;
    for (int r = 0; r < 4; r++) t.wr[r] = c->w + (n0 + std::min(r, t.rows - 1)) * K;
    const long ahead_at = (n0 + 16) * K;
    t.ahead = ahead_at + (K & ~63) * 4L <= static_cast<long>(N) * K ? c->w + ahead_at : nullptr;
    return t;
}

// The tiles [begin, end) for M <= DP_ROWS rows of x: one group, k at once, the call's setup
// paid once (a tile of the 125M preset is ~100 cycles of dot products at 1 row).
template <int MT>
__attribute__((target("avx512bf16"))) void dp_tiles(const GemvCtx<bf16> *c, long begin, long end)
{
    const int N = c->N, K = c->K, kv = K & ~63;
    alignas(64) float acc[MT * 4 * 2 * 16];
    for (long tile = begin; tile < end; tile++) {
        const long n0 = tile * 4;
        const DpTile t = dp_tile(c, n0);
        const DpEnd e{c->y + n0, c->bias ? c->bias + n0 : nullptr, N, t.rows, kv, K};
        dp_block<MT>(c->x, K, t.wr, 0, kv, acc, t.ahead, &e);
    }
}

// One tile for more than DP_ROWS rows of x: groups of them in turn over blocks of k.
__attribute__((target("avx512bf16"))) void gemv_tile_dp(const GemvCtx<bf16> *c, long n0)
{
    const int N = c->N, K = c->K, M = c->M, kv = K & ~63;
    const DpTile t = dp_tile(c, n0);
    const bf16 *const *wr = t.wr;
    for (int m0 = 0; m0 < M; m0 += 16) {  // 16 rows of x at a time: acc holds theirs
        const int mb = std::min(16, M - m0);
        alignas(64) float acc[16 * 4 * 2 * 16];
        // a last few rows (one group: past 16, up to DP_ROWS) take the whole row at once
        const int block = mb > DP_ROWS ? DP_BLOCK : kv;
        int k0 = 0;
        do {
            const int k1 = std::min(kv, k0 + block);
            for (int g = 0; g < mb;) {
                // groups of 4 rows, 5 or 6 in one pass: 8 rows as 4 + 4, not 6 + 2
                const int left = mb - g, n = left == 5 || left == 6 ? left : std::min(left, 4);
                const bf16 *xg = c->x + static_cast<long>(m0 + g) * K;
                const bf16 *pf = g == 0 ? t.ahead : nullptr;
                float *ag = acc + g * 128;
                const DpEnd e{c->y + static_cast<long>(m0 + g) * N + n0,
                              c->bias ? c->bias + n0 : nullptr, N, t.rows, kv, K};
                const DpEnd *end = k1 == kv ? &e : nullptr;
                switch (n) {
                case 1: dp_block<1>(xg, K, wr, k0, k1, ag, pf, end); break;
                case 2: dp_block<2>(xg, K, wr, k0, k1, ag, pf, end); break;
                case 3: dp_block<3>(xg, K, wr, k0, k1, ag, pf, end); break;
                case 4: dp_block<4>(xg, K, wr, k0, k1, ag, pf, end); break;
                case 5: dp_block<5>(xg, K, wr, k0, k1, ag, pf, end); break;
                default: dp_block<6>(xg, K, wr, k0, k1, ag, pf, end);
                }
                g += n;
            }
            k0 = k1;
        } while (k0 < kv);
    }
}

// float32 with AVX-512. Each output sums in one 16-lane accumulator, 16 elements of k at a
// time in order, then one shuffle tree for the tile's 4 outputs of a row of x (sum4), the bias
// and the scalar tail: the same arithmetic whatever the loop order, so a row of x gets the
// same bits alone or in a batch (a short last tile repeats its last weight row and drops the
// copies). The loop order follows MT. At 1 and 2 rows of x, a weight row at a time: one
// sequential stream, as gemv_tile, which the hardware prefetcher follows at the memory's full
// speed when a large model's weights stream from memory (the batch-1 decode step). From 3 rows
// (more arithmetic per byte: a decode batch, a speculative step's k + 1 rows), the 4 weight
// rows at once, each x vector feeding 4 FMAs, 5 and 6 rows in one pass instead of 4 + 1 or
// 4 + 2, with the weight rows two tiles ahead prefetched into L2 (below). On a 2-core Zen 4,
// `tools/cpu_gemv_bench.py --setting model` (the 125M preset's weights from memory), GB/s of
// weights: 3 rows 21-22 -> 26-28, 4 rows 15-24 -> 26-27 (a row at a time before), 5 rows
// 18-20 -> 24-27, 6 rows 16-19 -> 24; at 1 and 2 rows the interleaved form read 27-28 where
// one stream reads 23-38 as the machine's bandwidth goes. (gemv_tile, a weight row at a time
// with two accumulators and a 16-step scalar sum per output, ran a 5-row speculative step on
// the demo model at a third of the FMA rate.)

template <int MT>
void gemv_tile_f32(const float *x, const float *w, const float *bias, float *y, long n0,
                   int N, int K)
{
    const int rows = N - n0 < 4 ? static_cast<int>(N - n0) : 4, kv = K & ~15;
    const float *wr[4];
    for (int r = 0; r < 4; r++) wr[r] = w + (n0 + std::min(r, rows - 1)) * K;
    __m512 acc[MT][4];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm512_setzero_ps();
    if constexpr (MT <= 2) {
        for (int r = 0; r < 4; r++)
            for (int k = 0; k < kv; k += 16) {
                const __m512 wv = _mm512_loadu_ps(wr[r] + k);
                for (int m = 0; m < MT; m++)
                    acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + static_cast<long>(m) * K + k),
                                                wv, acc[m][r]);
            }
    } else {
        // The weight rows two tiles ahead (contiguous) are asked for into L2 while this tile
        // is summed, 4 cache lines per step of k: 4 rows read at once are 4 short streams that
        // the hardware prefetcher does not run ahead of, so without it a weight that is not in
        // L2 (the demo model's 16 MB between its steps) is read one miss after another at the
        // FMAs' pace. `tools/cpu_gemv_bench.py --setting demo` (2-core Zen 4), 5 rows: 18-26
        // -> 30-38 GB/s. By hand, one core cycling through 4 copies of the demo model's
        // weights (63 MB, from memory): 8.6-10.1 -> 3.0-3.6 ms a pass, where the next tile
        // into L1 gave 6.1-6.4 ms.
        const long ahead = (n0 + 8) * K, size = static_cast<long>(N) * K;  // in floats
        for (int k = 0; k < kv; k += 16) {
            if (ahead + 4L * k < size) {
                const char *p = reinterpret_cast<const char *>(w + ahead + 4L * k);
                for (int r = 0; r < 4; r++) _mm_prefetch(p + 64 * r, _MM_HINT_T1);
            }
            __m512 wv[4];
            for (int r = 0; r < 4; r++) wv[r] = _mm512_loadu_ps(wr[r] + k);
            for (int m = 0; m < MT; m++) {
                const __m512 xv = _mm512_loadu_ps(x + static_cast<long>(m) * K + k);
                for (int r = 0; r < 4; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
            }
        }
    }
    if (rows == 4 && kv == K) {  // the usual tile: its 4 outputs of a row of x in one store
        // (the same adds as below: the bias, or +0.f, lane by lane). A 5-row tile of K = 256
        // spent a third of its time in the scalar loop below (demo model's shapes, one core,
        // weights in cache: 32-34 -> 39 GFMA/s).
        const __m128 b = bias ? _mm_loadu_ps(bias + n0) : _mm_setzero_ps();
        for (int m = 0; m < MT; m++)
            _mm_storeu_ps(y + static_cast<long>(m) * N + n0,
                          _mm_add_ps(sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), b));
        return;
    }
    for (int m = 0; m < MT; m++) {
        alignas(16) float s[4];
        _mm_store_ps(s, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        const float *xm = x + static_cast<long>(m) * K;
        for (int r = 0; r < rows; r++) {
            float v = s[r] + (bias ? bias[n0 + r] : 0.f);
            for (int k = kv; k < K; k++) v += xm[k] * wr[r][k];
            y[static_cast<long>(m) * N + n0 + r] = v;
        }
    }
}
#endif

// One tile of 4 weight rows against MT rows of x where the dot-product tiles above do not run:
// bf16 without AVX-512 BF16 widens (gemv_tile_split without AVX-512, gemv_tile with it);
// float32 with AVX-512, gemv_tile_f32.
template <int MT, class T>
void gemv_rows(const GemvCtx<T> *c, const T *x, const float *xf, T *y, long n0)
{
    if constexpr (std::is_same_v<T, bf16>) {
#if !defined(__AVX512F__)
        gemv_tile_split<MT>(xf, x, c->w, c->bias, y, n0, c->N, c->K);
        return;
#endif
    }
    (void)xf;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>)
        gemv_tile_f32<MT>(x, c->w, c->bias, y, n0, c->N, c->K);
    else  // gemv_tile's float32 form: the builds without AVX-512 only
#endif
        gemv_tile<MT>(x, c->w, c->bias, y, n0, c->N, c->K);
}

// Each tile of 4 weight rows meets every group of 4 rows of x while it is in L1: the weight
// is read from memory once per call, whatever M.
template <class T>
void gemv_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const GemvCtx<T> *>(arg);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
        if (bf16_dot) {
            switch (c->M) {
            case 1: dp_tiles<1>(c, begin, end); return;
            case 2: dp_tiles<2>(c, begin, end); return;
            case 3: dp_tiles<3>(c, begin, end); return;
            case 4: dp_tiles<4>(c, begin, end); return;
            case 5: dp_tiles<5>(c, begin, end); return;
            case 6: dp_tiles<6>(c, begin, end); return;
            }
            for (long tile = begin; tile < end; tile++) gemv_tile_dp(c, tile * 4);
            return;
        }
    }
#endif
    for (long tile = begin; tile < end; tile++) {
        const long n0 = tile * 4;
        for (int m0 = 0; m0 < c->M;) {
            const T *x = c->x + static_cast<long>(m0) * c->K;
            const float *xf = c->xf ? c->xf + static_cast<long>(m0) * c->K : nullptr;
            T *y = c->y + static_cast<long>(m0) * c->N;
            const int left = c->M - m0;
#if defined(__AVX512F__)
            // gemv_tile_f32 keeps 4 accumulators per row of x: 6 rows' 24 fit the 32
            // registers, so 5 or 6 rows (a speculative step's k + 1) take one pass, not 4 + 1.
            if constexpr (std::is_same_v<T, float>) {
                if (left == 5 || left == 6) {
                    if (left == 5) gemv_rows<5>(c, x, xf, y, n0);
                    else gemv_rows<6>(c, x, xf, y, n0);
                    m0 += left;
                    continue;
                }
            }
#endif
            switch (left) {
            case 1: gemv_rows<1>(c, x, xf, y, n0); break;
            case 2: gemv_rows<2>(c, x, xf, y, n0); break;
            case 3: gemv_rows<3>(c, x, xf, y, n0); break;
            default: gemv_rows<4>(c, x, xf, y, n0);
            }
            m0 += 4;
        }
    }
}

}  // namespace

const bool bf16_dot = []
{
#if defined(__AVX512F__)
    __builtin_cpu_init();  // among the library's constructors, perhaps before libgcc's own
    const char *v = std::getenv("FLEETLLM_CPU_BF16_DOT");
    return __builtin_cpu_supports("avx512bf16") && !(v && std::strcmp(v, "0") == 0);
#else
    return false;
#endif
}();

template <class T>
void gemv(const T *x, const T *w, const T *bias, T *y, int M, int N, int K, float *xf,
          int nthreads)
{
    const long tiles = (N + 3) / 4;
    // One chunk a thread (the weight in as many contiguous parts), inline if small: a little
    // faster than ~4 a thread where the memory is fast (tools/gemv_ab.cpp).
    const long threads = nthreads > 0 ? nthreads : 1;
    const long chunk = static_cast<long>(N) * K < 4 * PAR_MIN
                           ? tiles : (tiles + threads - 1) / threads;
    // A bfloat16 x is widened once per call, not once per tile of 4 weight rows (as many
    // conversions as the weight's, at 1 row). With gemv_tile_split: tools/cpu_gemv_bench.py,
    // weight in cache, 1.1-2x at 1-8 rows on an AVX2 EPYC (docs/performance.md).
#if !defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>)
        spread_x(x, xf, M, K);
    else
        xf = nullptr;
#else
    xf = nullptr;
#endif
    GemvCtx<T> c{x, w, bias, y, xf, M, N, K};
    parallel_run(nthreads, gemv_body<T>, &c, tiles, chunk, true);
}

template void gemv<float>(const float *, const float *, const float *, float *, int, int, int,
                          float *, int);
template void gemv<bf16>(const bf16 *, const bf16 *, const bf16 *, bf16 *, int, int, int,
                         float *, int);

}  // namespace fleetllm::kernels
