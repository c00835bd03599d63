// The bf16 GEMM of decode batches and prompts on CPUs with AVX-512 (and, by the microkernels
// of gemm_avx2.h, AVX2): y = x . w^T (+ bias) from
// a weight packed by pairs (fleetllm/model/linear_kernels.py, Pairs):
// [ceil(N/48)][K/2][48][2], so that one 64-byte vector holds 16
// outputs' weights for one pair of k, and a row of x's pair broadcast to the 16 lanes feeds one
// vdpbf16ps for 16 outputs. A microkernel of up to 8 rows of x by 48 outputs (a panel) keeps 24
// sums in registers and reads 3 weight vectors and 8 broadcast pairs per 24 dot products, where
// a dot-product form (the GEMV's) loads an x vector for every 2 and adds its lanes up at the end.
// A panel's 3 vectors for a pair lie side by side and its pairs in order, so a thread reads its
// run of panels as one sequential stream (docs/performance.md says what that is worth). The
// hardware prefetcher alone keeps too few lines in flight for it: the microkernel prefetches
// the stream 8 KiB ahead into L1 (past a panel's end that is the next panel, a thread's next
// item); measured with tools/gemm_pairs_ab.cpp, it beats 2 KiB ahead, no prefetch, and
// prefetching the whole next panel into L2.
// Each output is one lane summed over k's pairs in order (blocks of k go through a float32
// scratch, the same sums), then the bias, then one rounding: its bits do not depend on how many
// rows share the call or which group a row falls in.
// Where the CPU's vdpbf16ps multiplies at under two thirds of its FMAs' rate (measured once a
// process, pairs_by_fma below: an Intel Xeon with AVX-512 BF16 and no AMX ran it at half),
// micro_fma makes the same sums with FMAs:
// a prompt's GEMM faster there, the same bits (prompt attention then takes its float32 loops:
// prefill_attention.cpp). CPUs without AVX-512 BF16 (Ice Lake, Cascade Lake) run micro_fma
// always: there oneDNN's bf16 matmul, with no bf16 instruction either, is several times slower.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "parallel.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#include "gemm_avx2.h"
#endif

namespace fleetllm::kernels {
namespace {

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int PAIR = PAIR_PANEL * 2;  // bf16s per pair of k in a panel: 3 vectors side by side
constexpr int MC = 128;   // rows of x per work item: their block of k stays in L2

struct GemmCtx {
    const bf16 *x, *wp, *bias;
    bf16 *y;
    int M, N, K;
    long panels, mblocks;
};
#endif

#if defined(__AVX512F__)
constexpr int NB = PAIR_PANEL / 16;  // 16-output blocks per panel: 3
constexpr int MR = 8;     // rows of x per microkernel pass (8 x 3 sums + 3 weights + 1 x)
constexpr int KC = 512;   // pairs of k per block: a panel's block is 96 KiB (L2), x's 8 rows 16
constexpr int AHEAD = 8192;  // bytes of the weight stream prefetched ahead of the microkernel

// A microkernel's sums: into acc for the next block of k, or (last) the outputs.
template <int R, int B>
inline void store_sums(const __m512 (&a)[R][B], float *acc, bool last, const bf16 *bias,
                       bf16 *y, long N, int n)
{
    if (!last) {
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++) _mm512_store_ps(acc + (r * B + b) * 16, a[r][b]);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) {
            const int nb = n - 16 * b;
            if (nb > 0)
                finish16(a[r][b], bias ? bias + 16 * b : nullptr, y + r * N + 16 * b, nb);
        }
}

// R rows of x (K apart) by the first B blocks of 16 outputs of a panel (w: its first pair),
// pairs [p0, p1) of k. acc: [R][B][16] float32, read unless first; last: the outputs (y: row
// 0's first output, rows N apart; n: outputs of this panel that exist).
template <int R, int B>
__attribute__((target("avx512bf16"))) void micro(const bf16 *x, long K, const bf16 *w, int p0,
                                                  int p1, float *acc, bool first, bool last,
                                                  const bf16 *bias, bf16 *y, long N, int n)
{
    __m512 a[R][B];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            a[r][b] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (r * B + b) * 16);
    const bf16 *wp = w + static_cast<long>(p0) * PAIR;
    const bf16 *xp = x + 2L * p0;
    for (int p = p0; p < p1; p++, wp += PAIR, xp += 2) {
        for (int b = 0; b < B; b++)
            _mm_prefetch(reinterpret_cast<const char *>(wp + 32 * b) + AHEAD, _MM_HINT_T0);
        __m512bh wv[B];
        for (int b = 0; b < B; b++)
            wv[b] = (__m512bh)_mm512_loadu_si512(wp + 32 * b);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            std::memcpy(&pair, xp + r * K, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < B; b++) a[r][b] = _mm512_dpbf16_ps(a[r][b], xv, wv[b]);
        }
    }
    store_sums<R, B>(a, acc, last, bias, y, N, n);
}

// micro's sums by FMAs: vdpbf16ps adds a pair's upper product, then its lower one, each
// rounded (bf16_pairs.h), and a product of two bf16s is exact in float32, so two FMAs in that
// order give its bits (but for denormals, which vdpbf16ps reads and writes as zeros). A weight
// vector's pairs widen in registers, the upper by a mask, the lower by a shift: 2 operations
// per 16 FMAs of 8 rows; x comes widened (xf: R rows, xs floats apart, from pair p0), a row's
// pair broadcast once for the B blocks. (The blocks' loop outside the rows' let GCC hoist all
// 16 broadcasts and spill the sums: 0.75-0.79x the time of vdpbf16ps at 1,024 rows, not 0.70.)
template <int R, int B>
void micro_fma(const float *xf, long xs, const bf16 *w, int p0, int p1, float *acc, bool first,
               bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    __m512 a[R][B];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++)
            a[r][b] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (r * B + b) * 16);
    const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const bf16 *wp = w + static_cast<long>(p0) * PAIR;
    for (int p = 0; p < p1 - p0; p++, wp += PAIR) {
        for (int b = 0; b < B; b++)
            _mm_prefetch(reinterpret_cast<const char *>(wp + 32 * b) + AHEAD, _MM_HINT_T0);
        __m512 hi[B], lo[B];
        for (int b = 0; b < B; b++) {
            const __m512i v = _mm512_loadu_si512(wp + 32 * b);
            hi[b] = _mm512_castsi512_ps(_mm512_and_si512(v, upper));
            lo[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        }
        for (int r = 0; r < R; r++) {
            const __m512 xh = _mm512_set1_ps(xf[r * xs + 2 * p + 1]);
            const __m512 xl = _mm512_set1_ps(xf[r * xs + 2 * p]);
            for (int b = 0; b < B; b++)
                a[r][b] = _mm512_fmadd_ps(lo[b], xl, _mm512_fmadd_ps(hi[b], xh, a[r][b]));
        }
    }
    store_sums<R, B>(a, acc, last, bias, y, N, n);
}

// rows rows of x (K apart), elements [e0, e1), widened to float32 into xf (e1 - e0 apart).
void widen_rows(const bf16 *x, long K, int rows, int e0, int e1, float *xf)
{
    const int m = e1 - e0;
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < m; e += 16) {
            const __mmask16 k =
                m - e >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (m - e)) - 1);
            const __m256i h = _mm256_maskz_loadu_epi16(k, x + r * K + e0 + e);
            _mm512_mask_storeu_ps(xf + static_cast<long>(r) * m + e, k, _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
}

// One group's microkernel: micro on x's bf16 rows (xs = K), micro_fma on their widened block.
template <int R, int B, class X>
void micro_any(const X *x, long xs, const bf16 *w, int p0, int p1, float *acc, bool first,
               bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    if constexpr (std::is_same_v<X, float>)
        micro_fma<R, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n);
    else
        micro<R, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n);
}

template <int B, class X>
void micro_rows(int rows, const X *x, long xs, const bf16 *w, int p0, int p1, float *acc,
                bool first, bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    switch (rows) {
    case 1: micro_any<1, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 2: micro_any<2, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 3: micro_any<3, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 4: micro_any<4, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 5: micro_any<5, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 6: micro_any<6, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 7: micro_any<7, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    default: micro_any<8, B>(x, xs, w, p0, p1, acc, first, last, bias, y, N, n);
    }
}

template <class X>
void micro_blocks(int blocks, int rows, const X *x, long xs, const bf16 *w, int p0, int p1,
                  float *acc, bool first, bool last, const bf16 *bias, bf16 *y, long N, int n)
{
    switch (blocks) {
    case 1: micro_rows<1>(rows, x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    case 2: micro_rows<2>(rows, x, xs, w, p0, p1, acc, first, last, bias, y, N, n); break;
    default: micro_rows<3>(rows, x, xs, w, p0, p1, acc, first, last, bias, y, N, n);
    }
}

// One group of rows (at most MR) by one panel over pairs [p0, p1): micro on x's bf16 rows, or
// micro_fma on their block widened into xf. acc: the group's sums, rows PAIR_PANEL floats apart.
void group(bool by_fma, int rows, const bf16 *x, long K, const bf16 *w, int p0, int p1,
           float *acc, bool first, bool last, const bf16 *bias, bf16 *y, long N, int n, float *xf)
{
    const int blocks = (n + 15) / 16;
    if (by_fma) {
        widen_rows(x, K, rows, 2 * p0, 2 * p1, xf);
        micro_blocks(blocks, rows, xf, 2L * (p1 - p0), w, p0, p1, acc, first, last, bias, y, N,
                     n);
    } else {
        micro_blocks(blocks, rows, x, K, w, p0, p1, acc, first, last, bias, y, N, n);
    }
}

// Seconds for `iters` rounds of 12 independent sums, 32 multiply-adds each: by vdpbf16ps (one
// instruction a sum) or by FMAs (two). The sums go to a volatile so that the loops stay.
volatile float rate_sink;

void keep(const __m512 (&a)[12])
{
    __m512 s = a[0];
    for (int j = 1; j < 12; j++) s = _mm512_add_ps(s, a[j]);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, s);
    rate_sink = lanes[0];
}

__attribute__((target("avx512bf16"))) double dot_seconds(int iters)
{
    __m512 a[12];
    for (auto &v : a) v = _mm512_setzero_ps();
    const __m512bh w = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // (1, 1)
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; i++)
        for (auto &v : a) v = _mm512_dpbf16_ps(v, w, w);
    keep(a);  // before the clock: the sums' volatile store keeps the loop in front of it
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double>(t1 - t0).count();
}

double fma_seconds(int iters)
{
    __m512 a[12];
    for (auto &v : a) v = _mm512_setzero_ps();
    const __m512 w = _mm512_set1_ps(1.0f);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; i++)
        for (auto &v : a) v = _mm512_fmadd_ps(w, w, _mm512_fmadd_ps(w, w, v));
    keep(a);  // before the clock: the sums' volatile store keeps the loop in front of it
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double>(t1 - t0).count();
}

#elif defined(__AVX2__)
using pairs_avx2::MR, pairs_avx2::KC;

// AVX2 sums by FMAs always (gemm_avx2.h).
inline void group(bool, int rows, const bf16 *x, long K, const bf16 *w, int p0, int p1,
                  float *acc, bool first, bool last, const bf16 *bias, bf16 *y, long N, int n,
                  float *xf)
{
    pairs_avx2::group(rows, x, K, w, p0, p1, acc, first, last, bias, y, N, n, xf);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// Work item i: row block i / panels, panel i % panels (a thread's run of items shares the
// rows' block, which stays in L2 while the panels stream by). BY_FMA is a template argument:
// tested per group from the context instead, GCC's code for the vdpbf16ps path was slower
// at 8-32 rows (tools/gemm_pairs_ab.cpp).
template <bool BY_FMA>
void gemm_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const GemmCtx *>(arg);
    const int K = c->K, pairs = K / 2;
    const long pstride = static_cast<long>(pairs) * PAIR;  // bf16s per panel
    alignas(64) float acc[MC * PAIR_PANEL];
    alignas(64) float xf[MR * 2 * KC];  // a group's rows of x widened, one block of k (FMAs)
    for (long item = begin; item < end; item++) {
        const int m0 = static_cast<int>(item / c->panels) * MC;
        const long panel = item % c->panels;
        const int n0 = static_cast<int>(panel) * PAIR_PANEL;
        const int mb = std::min(MC, c->M - m0), n = std::min(PAIR_PANEL, c->N - n0);
        const bf16 *w = c->wp + panel * pstride;
        const int groups = (mb + MR - 1) / MR;
        for (int p0 = 0; p0 < pairs; p0 += KC) {
            const int p1 = std::min(pairs, p0 + KC);
            const bool first = p0 == 0, last = p1 == pairs;
            for (int g = 0, r0 = 0; g < groups; g++) {
                // rows split evenly: 9 as 5 + 4, not 8 + 1
                const int rows = mb / groups + (g < mb % groups ? 1 : 0);
                const bf16 *x = c->x + static_cast<long>(m0 + r0) * K;
                bf16 *y = c->y + static_cast<long>(m0 + r0) * c->N + n0;
                const bf16 *bias = c->bias ? c->bias + n0 : nullptr;
                group(BY_FMA, rows, x, K, w, p0, p1, acc + r0 * PAIR_PANEL, first, last,
                      bias, y, c->N, n, xf);
                r0 += rows;
            }
        }
    }
}

#endif

}  // namespace

// Whether gemm_pairs sums by FMAs: FLEETLLM_CPU_BF16_PAIRS=fma or =dot, else measured (~2 ms,
// once a process): FMAs where vdpbf16ps takes over 1.5x their time for the same products
// (an Intel Xeon with AVX-512 BF16 and no AMX; not Zen 4 or Zen 5). Either gives the same bits, so
// a noisy measurement costs speed only, never reproducibility.
bool pairs_by_fma()
{
#if defined(__AVX512F__)
    static const bool by_fma = [] {
        if (!bf16_dot)  // no vdpbf16ps (Ice Lake, Cascade Lake, FLEETLLM_CPU_BF16_DOT=0)
            return true;
        const char *v = std::getenv("FLEETLLM_CPU_BF16_PAIRS");
        if (v && std::strcmp(v, "dot") == 0)
            return false;
        if (v && std::strcmp(v, "fma") == 0)
            return true;
        double dot = 1e9, fma = 1e9;
        for (int round = 0; round < 4; round++) {  // the first warms the vector units up
            dot = std::min(dot, dot_seconds(20000));
            fma = std::min(fma, fma_seconds(20000));
        }
        return dot > 1.5 * fma;
    }();
    return by_fma;
#elif defined(__AVX2__)
    return true;  // no bf16 instruction: gemm_avx2.h
#else
    return false;
#endif
}

bool gemm_pairs(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int M, int N, int K,
                int nthreads)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    if (K % 2 != 0)
        return false;
    GemmCtx c{x, wp, bias, y, M, N, K, (N + PAIR_PANEL - 1) / PAIR_PANEL, (M + MC - 1) / MC};
    const long items = c.panels * c.mblocks;
    // Runs of items per thread: each thread reads one run of panels after another in order.
    // A decode batch's GEMM streams its weights: one run a thread (the weight in as many
    // contiguous parts as threads) beat 4 runs a thread (tools/gemm_pairs_ab.cpp). A prompt's
    // is compute bound, and 4 runs a thread left one thread a whole run more than the other
    // whenever the runs did not split evenly (a prompt of 1,042 rows: 9 row blocks), so it
    // takes 16 runs a thread.
    const long threads = std::max(1, nthreads);
    const long chunk = M <= 64 ? (items + threads - 1) / threads
                               : std::max(1L, items / (16L * threads));
    // micro_fma or micro (pairs_by_fma)
    parallel_run(nthreads, pairs_by_fma() ? gemm_body<true> : gemm_body<false>, &c, items,
                 chunk, M <= 64);
    return true;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
    return false;
#endif
}

}  // namespace fleetllm::kernels
