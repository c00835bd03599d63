// gemm.cpp's microkernels for CPUs with AVX2 and no AVX-512 (Zen 2/3, Haswell to Comet Lake):
// the same weight packed by pairs ([ceil(N/48)][K/2][48][2]) and the same sums, by FMAs on
// 8-float vectors. A 32-byte vector of a pair holds 8 outputs' weights for k and k + 1; the
// upper halves widen by a mask, the lower by a shift, as micro_fma's do on AVX-512, and each
// product goes into its output's one float32 lane over k's pairs in order, the upper product
// first: the bits of every other CPU's gemm_pairs (vdpbf16ps's order; bf16_pairs.h).
// Without it a bf16 model here runs a float32 copy of every projection through oneDNN (PyTorch's
// bf16 matmul has no AVX2 kernel) beside the dense bf16 weight for the GEMV: 6 bytes a
// parameter where this takes 2.
// 16 ymm registers hold R x B sums of 8 outputs, B widened weight vectors and a broadcast row:
// a pair's upper products for every row, then its lower ones (the weights re-read from L1), so
// that 5 rows x 16 outputs (10 sums) fit with the registers GCC keeps besides (6 rows spilled a
// sum: upper_half). Fewer rows take more blocks: a decode step of one row reads the whole
// 48-output panel in one pass.
#pragma once

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace fleetllm::kernels::pairs_avx2 {

constexpr int MR = 5;          // rows of x per microkernel pass
constexpr int KC = 512;        // pairs of k per block: a panel's block is 96 KiB (L2)
constexpr int AHEAD = 8192;    // bytes of the weight stream prefetched ahead (gemm.cpp)
constexpr int BLOCKS = PAIR_PANEL / 8;  // 8-output blocks per panel: 6
constexpr int PAIR = PAIR_PANEL * 2;    // bf16s per pair of k in a panel

// Loops over rows and blocks unrolled early: GCC otherwise keeps the sums' array in memory and
// stores every sum to the stack on every pair (unrolled late, the array is not scalarized).
#define UNROLL _Pragma("GCC unroll 16")

// 8 sums + bias rounded once to bf16 and stored (the first n of them).
inline void finish8(__m256 s, const bf16 *bias, bf16 *y, int n)
{
    alignas(32) uint16_t out[8];
    if (bias) {
        alignas(16) uint16_t b[8] = {};
        std::memcpy(b, bias, sizeof(bf16) * std::min(n, 8));
        const __m256i w = _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<__m128i *>(b)));
        s = _mm256_add_ps(s, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    const v8 r = round_lanes<bf16, v8, u8x32>(__builtin_bit_cast(v8, s));
    const __m256i u = _mm256_srli_epi32(__builtin_bit_cast(__m256i, r), 16);
    // the 8 lanes' low halves: packus per 128-bit lane, then the two lanes' quads together
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_store_si128(reinterpret_cast<__m128i *>(out), _mm256_castsi256_si128(p));
    std::memcpy(y, out, sizeof(bf16) * std::min(n, 8));
}

// The upper bf16 of each of 8 pairs at p, as floats. The mask is a memory operand of the AND:
// held in a register it took the 16th, and 6 rows x 2 blocks then kept a sum on the stack (a
// store and a load in its chain of FMAs on every pair: 2.4x the time).
alignas(32) inline const uint32_t UPPER[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                              0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
inline __m256 upper_half(const bf16 *p)
{
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    asm("vpand %1, %0, %0" : "+x"(v) : "m"(*reinterpret_cast<const __m256i *>(UPPER)));
    return _mm256_castsi256_ps(v);
}

// R rows of x widened (xf: rows xs floats apart, from pair p0) by B blocks of 8 outputs of a
// panel from block b0 (w: the panel's first pair), pairs [p0, p1). acc: [R][BLOCKS][8] float32,
// read unless first; last: the outputs (y: row 0's first output of the panel, rows N apart; n:
// outputs of this panel that exist). Each pair, lines [L0, L1) of the panel's 3 lines of a pair
// are prefetched AHEAD bytes on (pass, below). (Which lines, tested inside the loop, had GCC
// store all the sums to the stack on every pair.)
template <int R, int B, int L0, int L1>
void micro(const float *xf, long xs, const bf16 *w, int b0, int p0, int p1, float *acc,
           bool first, bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    // One array, set whole by one branch: a conditional per sum (first ? 0 : acc) kept some sums
    // on the stack through the loop, as did loops unrolled only late.
    __m256 a[R * B];
    if (first) {
        UNROLL for (int i = 0; i < R * B; i++) a[i] = _mm256_setzero_ps();
    } else {
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int b = 0; b < B; b++)
                a[r * B + b] = _mm256_load_ps(acc + (r * BLOCKS + b0 + b) * 8);
    }
    const bf16 *wp = w + static_cast<long>(p0) * PAIR + 16 * b0;
    for (int p = 0; p < p1 - p0; p++, wp += PAIR) {
        UNROLL for (int l = L0; l < L1; l++)
            _mm_prefetch(reinterpret_cast<const char *>(wp - 16 * b0) + 64 * l + AHEAD,
                         _MM_HINT_T0);
        __m256 h[B];
        UNROLL for (int b = 0; b < B; b++) h[b] = upper_half(wp + 16 * b);
        UNROLL for (int r = 0; r < R; r++) {
            const __m256 xh = _mm256_broadcast_ss(xf + r * xs + 2 * p + 1);
            UNROLL for (int b = 0; b < B; b++)
                a[r * B + b] = _mm256_fmadd_ps(h[b], xh, a[r * B + b]);
        }
        UNROLL for (int b = 0; b < B; b++)
            h[b] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wp + 16 * b)), 16));
        UNROLL for (int r = 0; r < R; r++) {
            const __m256 xl = _mm256_broadcast_ss(xf + r * xs + 2 * p);
            UNROLL for (int b = 0; b < B; b++)
                a[r * B + b] = _mm256_fmadd_ps(h[b], xl, a[r * B + b]);
        }
    }
    if (!last) {
        UNROLL for (int r = 0; r < R; r++)
            UNROLL for (int b = 0; b < B; b++)
                _mm256_store_ps(acc + (r * BLOCKS + b0 + b) * 8, a[r * B + b]);
        return;
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int b = 0; b < B; b++) {
            const int o = 8 * (b0 + b), nb = n - o;
            if (nb > 0)
                finish8(a[r * B + b], bias ? bias + o : nullptr, y + r * N + o, nb);
        }
}

// Blocks per pass for R rows: the most whose R x B sums, B weights, a broadcast and the mask
// fit in 16 registers, rounded so that the passes split the panel evenly.
constexpr int pass_blocks(int R) { return R <= 1 ? 6 : R <= 3 ? 3 : 2; }

// Pass j of a panel's passes over a chunk prefetches its share of the stream's 3 lines a pair
// (all 3 for one pass): a stream prefetched by the first pass alone stood still while the
// others ran (2 rows took well over the time of 1).
template <int R, int B>
void pass(const float *xf, long xs, const bf16 *w, int b0, int p0, int p1, float *acc,
          bool first, bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    constexpr int P = (BLOCKS + pass_blocks(R) - 1) / pass_blocks(R);  // passes of a panel
    const int j = b0 / pass_blocks(R);
    if (P == 1 || j == 0)
        micro<R, B, 0, 3 / P>(xf, xs, w, b0, p0, p1, acc, first, last, bias, y, N, n);
    else if (P == 2 || j == 1)
        micro<R, B, 3 / P, P == 2 ? 3 : 2>(xf, xs, w, b0, p0, p1, acc, first, last, bias, y, N,
                                            n);
    else
        micro<R, B, 2, 3>(xf, xs, w, b0, p0, p1, acc, first, last, bias, y, N, n);
}

// A panel's passes take its block of k in chunks of CHUNK pairs (12 KiB of weights), every
// pass over one chunk before the next: the passes after the first then read the chunk from L1.
// (Whole blocks a pass, the later passes read L2: 2 rows took 1.6x the time of 1.)
constexpr int CHUNK = 64;

template <int R>
void panel(const float *xf, long xs, const bf16 *w, int p0, int p1, float *acc, bool first,
           bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    constexpr int B = pass_blocks(R);
    const int blocks = (n + 7) / 8;
    for (int c0 = p0; c0 < p1; c0 += CHUNK) {
        const int c1 = std::min(p1, c0 + CHUNK);
        const bool f = first && c0 == p0, l = last && c1 == p1;
        const float *xc = xf + 2 * (c0 - p0);
        for (int b0 = 0; b0 < blocks; b0 += B) {
            switch (std::min(B, blocks - b0)) {  // a partial panel's last pass takes fewer blocks
            case 1: pass<R, 1>(xc, xs, w, b0, c0, c1, acc, f, l, bias, y, N, n); break;
            case 2: pass<R, std::min(B, 2)>(xc, xs, w, b0, c0, c1, acc, f, l, bias, y, N, n);
                break;
            case 3: pass<R, std::min(B, 3)>(xc, xs, w, b0, c0, c1, acc, f, l, bias, y, N, n);
                break;
            case 4: pass<R, std::min(B, 4)>(xc, xs, w, b0, c0, c1, acc, f, l, bias, y, N, n);
                break;
            case 5: pass<R, std::min(B, 5)>(xc, xs, w, b0, c0, c1, acc, f, l, bias, y, N, n);
                break;
            default: pass<R, B>(xc, xs, w, b0, c0, c1, acc, f, l, bias, y, N, n);
            }
        }
    }
}

// rows rows of x (K apart), elements [e0, e1), widened to float32 into xf (e1 - e0 apart).
inline void widen_rows(const bf16 *x, long K, int rows, int e0, int e1, float *xf)
{
    const int m = e1 - e0;
    for (int r = 0; r < rows; r++) {
        const bf16 *src = x + r * K + e0;
        float *dst = xf + static_cast<long>(r) * m;
        int e = 0;
        for (; e + 8 <= m; e += 8) {
            v8 v;
            load8(src + e, v);
            std::memcpy(dst + e, &v, sizeof v);
        }
        for (; e < m; e++) dst[e] = to_f32(src[e]);
    }
}

// One group of rows (at most MR) by one panel over pairs [p0, p1): x's rows widened into xf,
// then the microkernel. acc: the group's sums, rows PAIR_PANEL floats apart.
inline void group(int rows, const bf16 *x, long K, const bf16 *w, int p0, int p1, float *acc,
                  bool first, bool last, const bf16 *bias, bf16 *y, long N, int n, float *xf)
{
    widen_rows(x, K, rows, 2 * p0, 2 * p1, xf);
    const long xs = 2L * (p1 - p0);
    switch (rows) {
    case 1: panel<1>(xf, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 2: panel<2>(xf, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 3: panel<3>(xf, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 4: panel<4>(xf, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    default: panel<MR>(xf, xs, w, p0, p1, acc, first, last, bias, y, N, n);
    }
}

}  // namespace fleetllm::kernels::pairs_avx2
