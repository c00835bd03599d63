// Two builds of csrc/gemm.cpp timed in one process, taking turns pass by pass: the only A/B of
// the bf16 GEMM this machine allows, whose memory bandwidth moves between ~33 and ~65 GB/s
// from one minute to the next (two processes run minutes apart compare two machines). A pass
// is the 125M preset's decode step: its 48 layer projections and its LM head (220 MB of
// weights packed by pairs, in huge pages), one gemm_pairs call each, M rows of x; the best of
// 7 passes per build per round. With a third argument `1b`, the Llama-1B preset's shapes
// (16 layers, 128K-row LM head: 2.5 GB); a fourth, L, runs only the first L layers and no LM
// head (prompt-sized M, where a pass of every layer would take seconds). The weights are not
// packed for either layout (timing only: tests/kernels/test_kernels.py checks the results).
//
//     git worktree add /tmp/old <commit>
//     F="-O3 -fopenmp-simd -fno-math-errno -fno-trapping-math -pthread -mtune=native"
//     F="$F -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma"  # fleetllm/kernels/build.py's flags
//     # (on a CPU without AVX-512: F="$F -mavx2 -mfma", the avx2 variant's)
//     c++ $F -I/tmp/old/csrc -Dfleetllm=fold -c /tmp/old/csrc/gemm.cpp -o /tmp/old.o
//     c++ $F -Icsrc tools/gemm_pairs_ab.cpp csrc/gemm.cpp csrc/pool.cpp /tmp/old.o -o /tmp/ab
//     /tmp/ab 1 20      # rows of x, rounds
//     /tmp/ab 1024 5 1b 2   # prompt rows on two of Llama-1B's layers
//
// "old" is the build whose namespace -Dfleetllm=fold renamed; "new" is this tree's.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "ab_pool.h"

namespace fleetllm::kernels {
extern const bool bf16_dot;  // gemv.cpp's, which this tool does not link
const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
struct bf16;
bool gemm_pairs(const bf16 *, const bf16 *, const bf16 *, bf16 *, int, int, int, int);
}  // namespace fleetllm::kernels
namespace fold::kernels {
extern const bool bf16_dot;
const bool bf16_dot = fleetllm::kernels::bf16_dot;  // one reading for both builds
struct bf16;
bool gemm_pairs(const bf16 *, const bf16 *, const bf16 *, bf16 *, int, int, int, int);
}  // namespace fold::kernels

int main(int argc, char **argv)
{
    const int M = argc > 1 ? std::atoi(argv[1]) : 1, rounds = argc > 2 ? std::atoi(argv[2]) : 8;
    const bool big = argc > 3 && argv[3][0] == '1';
    const int layers = big ? 16 : 12, only = argc > 4 ? std::atoi(argv[4]) : 0;
    if (M < 1 || M > 2048 || rounds < 1 || only < 0 || only > layers)
        return 2;
    // qkv, o, gate_up, down of each layer, then the LM head: N x K
    const long small_shapes[5][2] = {{2304, 768}, {768, 768}, {4096, 768}, {768, 2048},
                                     {32000, 768}};
    const long big_shapes[5][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192},
                                   {128256, 2048}};
    const long (*shapes)[2] = big ? big_shapes : small_shapes;
    const int G = only ? 4 * only : 4 * layers + 1;  // GEMMs a pass
    long N[65], K[65], size[65], bytes = 0;
    for (int l = 0; l < G; l++) {
        const int s = l == 4 * layers ? 4 : l % 4;
        N[l] = shapes[s][0];
        K[l] = shapes[s][1];
        size[l] = (N[l] + 47) / 48 * 48 * K[l] * 2;  // room for either build's padding
        bytes += size[l];
    }
    uint16_t *w[2];
    for (auto &v : w) {
        v = static_cast<uint16_t *>(huge_mapping(bytes));
        if (v == nullptr)
            return 1;
        for (long i = 0; i < bytes / 2; i++) v[i] = static_cast<uint16_t>(0x3c00 + i % 64);
    }
    // x's widest rows are down's K; y's, gate_up's N (the LM head's if it runs)
    const long maxK = shapes[3][1], maxN = only ? shapes[2][0] : shapes[4][0];
    auto *x = static_cast<uint16_t *>(std::aligned_alloc(64, M * maxK * 2));
    auto *y = static_cast<uint16_t *>(std::aligned_alloc(64, M * maxN * 2));
    if (x == nullptr || y == nullptr)
        return 1;
    for (long i = 0; i < M * maxK; i++) x[i] = 0x3f80;
    double total[2] = {0, 0};
    for (int r = 0; r < rounds; r++) {
        double best[2];
        best_in_turns(7, best, [&](int v) {
            const double t0 = now();
            const uint16_t *wl = w[v];
            for (int l = 0; l < G; l++) {
                if (v == 0)
                    fold::kernels::gemm_pairs(
                        reinterpret_cast<const fold::kernels::bf16 *>(x),
                        reinterpret_cast<const fold::kernels::bf16 *>(wl), nullptr,
                        reinterpret_cast<fold::kernels::bf16 *>(y), M, N[l], K[l], 2);
                else
                    fleetllm::kernels::gemm_pairs(
                        reinterpret_cast<const fleetllm::kernels::bf16 *>(x),
                        reinterpret_cast<const fleetllm::kernels::bf16 *>(wl), nullptr,
                        reinterpret_cast<fleetllm::kernels::bf16 *>(y), M, N[l], K[l], 2);
                wl += size[l] / 2;
            }
            return now() - t0;
        });
        double flops = 0;
        for (int l = 0; l < G; l++) flops += 2.0 * M * N[l] * K[l];
        std::printf("M=%d old %.2f ms new %.2f ms (new/old %.3f; new %.1f GB/s, %.0f GFLOP/s)\n",
                    M, best[0] * 1e3, best[1] * 1e3, best[1] / best[0], bytes / best[1] / 1e9,
                    flops / best[1] / 1e9);
        total[0] += best[0];
        total[1] += best[1];
    }
    std::printf("M=%d mean old %.2f ms new %.2f ms new/old %.3f\n", M, total[0] / rounds * 1e3,
                total[1] / rounds * 1e3, total[1] / total[0]);
    return 0;
}
