// Two builds of csrc/gemv.cpp timed in one process, taking turns pass by pass (as
// tools/gemm_pairs_ab.cpp does for the bf16 GEMM: this machine's memory bandwidth moves between
// ~33 and ~65 GB/s from one minute to the next, so two processes compare two machines). A pass
// is the 125M preset's decode step on the GEMV kernel: its 48 layer projections and its LM head
// as dense float32 weights (440 MB, huge pages), one gemv call each, M rows of x; the best of 5
// passes per build per round. The GEMV serves float32 decode steps and, on CPUs without
// AVX-512, bf16 ones within FLEETLLM_GEMV_MAX_BYTES.
//
//     git worktree add /tmp/old <commit>
//     F="-O3 -fopenmp-simd -fno-math-errno -fno-trapping-math -pthread -mtune=native"
//     F="$F -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma"  # fleetllm/kernels/build.py's flags
//     c++ $F -I/tmp/old/csrc -Dfleetllm=fold -c /tmp/old/csrc/gemv.cpp -o /tmp/old.o
//     c++ $F -Icsrc tools/gemv_ab.cpp csrc/gemv.cpp csrc/pool.cpp /tmp/old.o -o /tmp/gemv_ab
//     /tmp/gemv_ab 1 100      # rows of x, rounds
//
// "old" is the build whose namespace -Dfleetllm=fold renamed; "new" is this tree's.
#include <cstdio>
#include <cstdlib>

#include "ab_pool.h"

namespace fleetllm::kernels {
template <class T>
void gemv(const T *, const T *, const T *, T *, int, int, int, float *, int);
}  // namespace fleetllm::kernels
namespace fold::kernels {
template <class T>
void gemv(const T *, const T *, const T *, T *, int, int, int, float *, int);
}  // namespace fold::kernels

int main(int argc, char **argv)
{
    const int M = argc > 1 ? std::atoi(argv[1]) : 1, rounds = argc > 2 ? std::atoi(argv[2]) : 8;
    if (M < 1 || M > 8 || rounds < 1)
        return 2;
    // qkv, o, gate_up, down of each of 12 layers, then the LM head: N x K
    const long shapes[5][2] = {{2304, 768}, {768, 768}, {4096, 768}, {768, 2048}, {32000, 768}};
    constexpr int G = 4 * 12 + 1;
    long N[G], K[G], bytes = 0;
    for (int l = 0; l < G; l++) {
        const int s = l == G - 1 ? 4 : l % 4;
        N[l] = shapes[s][0];
        K[l] = shapes[s][1];
        bytes += N[l] * K[l] * 4;
    }
    float *w[2];
    for (auto &v : w) {
        v = static_cast<float *>(huge_mapping(bytes));
        if (v == nullptr)
            return 1;
        for (long i = 0; i < bytes / 4; i++) v[i] = 0.001f * static_cast<float>(i % 64);
    }
    auto *x = static_cast<float *>(std::aligned_alloc(64, 8 * 2048 * 4));
    auto *y = static_cast<float *>(std::aligned_alloc(64, 8 * 32000 * 4));
    auto *xf = static_cast<float *>(std::aligned_alloc(64, 8 * 2048 * 4 * 4));  // bf16's scratch
    if (x == nullptr || y == nullptr || xf == nullptr)
        return 1;
    for (int i = 0; i < 8 * 2048; i++) x[i] = 1.0f;
    double total[2] = {0, 0};
    for (int r = 0; r < rounds; r++) {
        double best[2];
        best_in_turns(5, best, [&](int v) {
            const double t0 = now();
            const float *wl = w[v];
            for (int l = 0; l < G; l++) {
                if (v == 0)
                    fold::kernels::gemv<float>(x, wl, nullptr, y, M, N[l], K[l], xf, 2);
                else
                    fleetllm::kernels::gemv<float>(x, wl, nullptr, y, M, N[l], K[l], xf, 2);
                wl += N[l] * K[l];
            }
            return now() - t0;
        });
        std::printf("M=%d old %.2f ms new %.2f ms (new/old %.3f; new %.1f GB/s)\n", M,
                    best[0] * 1e3, best[1] * 1e3, best[1] / best[0], bytes / best[1] / 1e9);
        total[0] += best[0];
        total[1] += best[1];
    }
    std::printf("M=%d mean old %.2f ms new %.2f ms new/old %.3f\n", M, total[0] / rounds * 1e3,
                total[1] / rounds * 1e3, total[1] / total[0]);
    return 0;
}
