// The bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later): y = x . w^T (+ bias) from a
// weight packed for the tiles (model/linear_kernels.py, Amx): [N/32][K/32][2][16][32], each 32 k by 32
// outputs one 2 KiB block of two B tiles (16 pairs of k by 16 outputs, a pair's two weights
// side by side, as TDPBF16PS reads them). A work item is a panel of 32 outputs: its blocks in
// k order are one sequential stream, which the microkernel prefetches AHEAD bytes ahead; x's
// rows are read in place as A tiles (16 rows by 32 k, K apart), 32 rows a pass, so a decode
// batch of up to 32 rows reads the weight once and computes 4 tiles of sums per block.
//
// Why not oneDNN's matmul, which runs on the same tiles: at decode batches (1-64 rows) it
// streams the weight slower than this kernel, which only streams the panel and multiplies;
// from ~128 rows oneDNN's blocking for the caches wins.
//
// Each output's sum runs over k in order (TDPBF16PS adds a pair's two products to the lane,
// as oneDNN's kernels do), then the bias, then one rounding to bf16 (finish16). The tile
// configuration is loaded at the start of every call of the body (other code on the thread,
// oneDNN's, loads its own) and released at its end.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "amx_tiles.h"
#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

#if defined(__AVX512F__)
constexpr int PANEL = 32;          // outputs a work item: two B tiles of 16
constexpr int BLOCK = 32 * PANEL;  // bf16s of a panel per 32 k: two 1 KiB tiles
constexpr int AHEAD = 8192;        // bytes of the weight stream prefetched ahead (into L1)

struct AmxCtx {
    const bf16 *x, *wp, *bias;
    bf16 *y;
    int M, N, K;
};

// Tiles 0, 1: the sums of x's first r0 rows (the panel's two halves), 2, 3: of the next r1;
// 4, 5: those rows of x; 6, 7: the weights. A tile of no rows stays unconfigured.
void configure(int r0, int r1, amx::TileConfig &cur, bool &set)
{
    if (set && cur.rows[0] == r0 && cur.rows[2] == r1)
        return;
    const auto a = static_cast<uint8_t>(r0), b = static_cast<uint8_t>(r1);
    amx::load_config({a, a, b, b, a, b, 16, 16}, cur);
    set = true;
}

// Up to 32 rows of x (K apart) by one panel (w: its first block) over all of k; the sums go to
// acc ([32][32] float32). prefetch: the first pass over this panel (later passes find it in L2).
template <bool Two>
__attribute__((target("amx-tile,amx-bf16"))) void panel_rows(const bf16 *x, long K,
                                                             const bf16 *w, float *acc,
                                                             bool prefetch)
{
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (Two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const long stride = K * static_cast<long>(sizeof(bf16));
    for (long k = 0; k < K; k += 32, w += BLOCK) {
        if (prefetch)
            for (int l = 0; l < BLOCK * 2; l += 64)
                _mm_prefetch(reinterpret_cast<const char *>(w) + AHEAD + l, _MM_HINT_T0);
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + BLOCK / 2, 64);
        _tile_loadd(4, x + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (Two) {
            _tile_loadd(5, x + 16 * K + k, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, PANEL * sizeof(float));
    _tile_stored(1, acc + 16, PANEL * sizeof(float));
    if constexpr (Two) {
        _tile_stored(2, acc + 16 * PANEL, PANEL * sizeof(float));
        _tile_stored(3, acc + 16 * PANEL + 16, PANEL * sizeof(float));
    }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const AmxCtx *>(arg);
    const long per_panel = static_cast<long>(c->K / 32) * BLOCK;
    alignas(64) float acc[32 * PANEL];
    amx::TileConfig cur;
    bool set = false;
    for (long panel = begin; panel < end; panel++) {
        const bf16 *w = c->wp + panel * per_panel;
        const int n0 = static_cast<int>(panel) * PANEL;
        const bf16 *bias = c->bias ? c->bias + n0 : nullptr;
        for (int m0 = 0; m0 < c->M; m0 += 32) {
            const int rows = std::min(32, c->M - m0), r0 = std::min(16, rows), r1 = rows - r0;
            configure(r0, r1, cur, set);
            const bf16 *x = c->x + static_cast<long>(m0) * c->K;
            if (r1)
                panel_rows<true>(x, c->K, w, acc, m0 == 0);
            else
                panel_rows<false>(x, c->K, w, acc, m0 == 0);
            for (int r = 0; r < rows; r++) {
                bf16 *y = c->y + static_cast<long>(m0 + r) * c->N + n0;
                finish16(_mm512_load_ps(acc + r * PANEL), bias, y, 16);
                finish16(_mm512_load_ps(acc + r * PANEL + 16), bias ? bias + 16 : nullptr,
                         y + 16, 16);
            }
        }
    }
    if (set)
        _tile_release();
}
#endif

}  // namespace

bool amx_available()
{
#if defined(__AVX512F__) && defined(__x86_64__)
    // The CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22), FLEETLLM_CPU_AMX is
    // not 0, and the kernel lets this process use the tile data (ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA: Linux 5.16 and later ask for it; torch asks at start too).
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
            return false;
        const char *v = std::getenv("FLEETLLM_CPU_AMX");
        if (v && std::strcmp(v, "0") == 0)
            return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ok;
#else
    return false;
#endif
}

bool gemm_amx(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int M, int N, int K,
              int nthreads)
{
#if defined(__AVX512F__)
    if (!amx_available() || N % 32 != 0 || K % 32 != 0)
        return false;
    AmxCtx c{x, wp, bias, y, M, N, K};
    const long panels = N / PANEL;
    // runs of panels per thread, each read as one stream
    const long chunk = std::max(1L, panels / (4L * std::max(1, nthreads)));
    parallel_run(nthreads, amx_body, &c, panels, chunk, M <= 64);
    return true;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
    return false;
#endif
}

}  // namespace fleetllm::kernels
