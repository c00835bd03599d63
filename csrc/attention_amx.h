// Prompt attention's two products on AMX tiles (prefill_attention.cpp, a bf16 model with a bf16
// cache where amx_available()): q . K for 16 queries x 16 keys per tile and P . V for 16
// queries x 16 elements of D, where the AVX-512 BF16 pairs (bf16_pairs.h) take one instruction
// per 16 products. The softmax between them is prefill_attention.cpp's, unchanged.
//
// Why: the pairs kernel ran the 125M preset's prompts at ~50-130 GFLOP/s on an AMX Xeon, where
// PyTorch's flash attention, on the tiles through oneDNN's brgemm, ran a 700-token prompt 2.4x
// faster (tools/cpu_prefill_bench.py); with the products on the tiles what is left is the
// softmax.
//
// Bits: TDPBF16PS sums a tile's 32 products per output in an order and precision of its own
// (measured: neither the pairs' two rounded FMAs, in either order, nor one rounding per pair
// or per instruction), so scores and outputs differ from the pairs kernel's in the last bits of
// float32; PyTorch's flash attention on the same tiles shares their order (>= 99.99% of the
// bf16 outputs bit-equal to its SDPA, where the pairs' order gives 99.9%: tests/kernels/test_attention.py).
// Denormals read and written as zeros, as vdpbf16ps does.
//
// Layouts (all read in place as tiles, 64 bytes a row):
// - q2: the queries' pairs, D / 2 words a query (element 2p in a pair's upper half);
// - kt2: the keys' pairs transposed, [D / 2][kstride] words (the same pair order), so a B tile
//   is 16 pairs of d x 16 keys;
// - vt2: the values by pairs of positions, [keys / 2][D] words (position 2t lower), so a B tile
//   is 16 pairs of positions x 16 elements of D;
// - pb: P in bf16, a row per query (PB bf16s apart), positions from a multiple of 32.
// Tiles: 0-3 sums, 4 queries or P, 5-6 keys or values; all 16 rows (rows past the last query
// are computed and not stored: the buffers they are read from have room for them).
#pragma once

#include "amx_tiles.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__x86_64__)
namespace fleetllm::kernels::amx {

#define FLEETLLM_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

__attribute__((target("amx-tile"))) inline void configure_attention(TileConfig &cfg)
{
    load_config({16, 16, 16, 16, 16, 16, 16, 0}, cfg);
}

// s[i][j] = scale * q_i . k_{lo + j} for queries [0, nq) (their sums stored; up to 15 rows past
// nq of q2 are read) and keys [lo, lo + npad), npad a multiple of 16, lo of 16.
FLEETLLM_AMX inline void scores(const uint32_t *q2, const uint32_t *kt2, long kstride, float *s,
                                long sstride, int D, int nq, int lo, int npad, float scale)
{
    alignas(64) float tmp[16][32];
    const long qrow = static_cast<long>(D) * 2, krow = kstride * 4;
    for (int i0 = 0; i0 < nq; i0 += 16) {
        const int rows = nq - i0 < 16 ? nq - i0 : 16;
        for (int j = 0; j < npad; j += 32) {
            const bool two = j + 16 < npad;
            _tile_zero(0);
            _tile_zero(1);
            for (int p = 0; p < D / 2; p += 16) {
                _tile_loadd(4, q2 + static_cast<long>(i0) * D / 2 + p, qrow);
                _tile_loadd(5, kt2 + p * kstride + lo + j, krow);
                _tile_dpbf16ps(0, 4, 5);
                if (two) {
                    _tile_loadd(6, kt2 + p * kstride + lo + j + 16, krow);
                    _tile_dpbf16ps(1, 4, 6);
                }
            }
            _tile_stored(0, tmp, 128);
            _tile_stored(1, &tmp[0][16], 128);
            const __m512 sc = _mm512_set1_ps(scale);
            for (int r = 0; r < rows; r++) {
                float *sr = s + (i0 + r) * sstride + j;
                _mm512_storeu_ps(sr, _mm512_mul_ps(_mm512_load_ps(tmp[r]), sc));
                if (two)
                    _mm512_storeu_ps(sr + 16, _mm512_mul_ps(_mm512_load_ps(tmp[r] + 16), sc));
            }
        }
    }
}

// vt2's pairs of positions for keys [t0, t0 + 32) from their rows (null: a key of zeros).
FLEETLLM_AMX inline void value_pairs(const bf16 *const *rows, int D, uint32_t *vt2)
{
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int t = 0; t < 32; t += 2, vt2 += D)
        for (int d = 0; d < D; d += 32) {
            const __m512i x0 = rows[t] ? _mm512_loadu_si512(rows[t] + d) : _mm512_setzero_si512();
            const __m512i x1 =
                rows[t + 1] ? _mm512_loadu_si512(rows[t + 1] + d) : _mm512_setzero_si512();
            // unpack{lo,hi}_epi16 pair elements 0-3 | 8-11 | ... and 4-7 | 12-15 | ...;
            // the 128-bit lanes back in order of d
            const __m512i a = _mm512_unpacklo_epi16(x0, x1), b = _mm512_unpackhi_epi16(x0, x1);
            _mm512_storeu_si512(vt2 + d, _mm512_permutex2var_epi64(a, lo, b));
            _mm512_storeu_si512(vt2 + d + 16, _mm512_permutex2var_epi64(a, hi, b));
        }
}

// acc[i] += sum over positions t in [ta, tb) of P[i][t] v_t for the queries [0, nq) (whole
// tiles of 16: acc and pb have rows for them), ta and tb multiples of 32; P[i][t] at
// pb[i * PB + t - ta].
FLEETLLM_AMX inline void pv(const uint16_t *pb, int PB, const uint32_t *vt2, int ta, int tb,
                            float *acc, int D, int nq)
{
    const long arow = static_cast<long>(D) * 4;
    for (int i0 = 0; i0 < nq; i0 += 16)
        for (int d0 = 0; d0 < D; d0 += 64) {
            float *a = acc + static_cast<long>(i0) * D + d0;
            _tile_loadd(0, a, arow);
            _tile_loadd(1, a + 16, arow);
            _tile_loadd(2, a + 32, arow);
            _tile_loadd(3, a + 48, arow);
            for (int t = ta; t < tb; t += 32) {
                const uint32_t *v = vt2 + static_cast<long>(t / 2) * D + d0;
                _tile_loadd(4, pb + static_cast<long>(i0) * PB + t - ta, PB * 2);
                _tile_loadd(5, v, arow);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, v + 16, arow);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, v + 32, arow);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, v + 48, arow);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, a, arow);
            _tile_stored(1, a + 16, arow);
            _tile_stored(2, a + 32, arow);
            _tile_stored(3, a + 48, arow);
        }
}

#undef FLEETLLM_AMX

}  // namespace fleetllm::kernels::amx
#endif
