// Two builds of the quantized projections (csrc/quant*.cpp) timed in one process, taking turns
// pass by pass (as tools/gemv_ab.cpp does for the dense GEMV). A pass is a decode step of the
// 125M preset through quant::linear: its 48 layer projections and its LM head, each a separate
// weight of one block type (random blocks with sane fp16 scales, huge pages), M rows of x, on
// the given threads; the best of 5 passes per build per round, and the weight bytes read per
// second. The weights are ~50-110 MB, more than the L2 caches: from memory, or from whatever
// of it a large L3 keeps.
//
//     git worktree add /tmp/old <commit>
//     F="-O3 -fopenmp-simd -fno-math-errno -fno-trapping-math -pthread -mtune=native"
//     F="$F -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma"  # fleetllm/kernels/build.py's flags
//     Q="quant.cpp quant_vnni.cpp quant_dequant.cpp"
//     for f in $Q; do c++ $F -I/tmp/old/csrc -Dfleetllm=fold -c /tmp/old/csrc/$f -o /tmp/old_$f.o; done
//     c++ $F -Icsrc tools/quant_gemv_ab.cpp $(for f in $Q; do echo csrc/$f; done) csrc/pool.cpp \
//         /tmp/old_*.cpp.o -o /tmp/quant_ab
//     /tmp/quant_ab Q8_0 1 2 4     # type (Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K Q4_ZP Q8_ZP), rows of x,
//                                  # threads, rounds
//
// "old" is the build whose namespace -Dfleetllm=fold renamed; "new" is this tree's.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "ab_pool.h"
#include "quant.h"

namespace fold::kernels::quant {
using fleetllm::kernels::quant::Layout;
struct Part {
    int64_t type, rows, row_bytes;
    const uint8_t *data;
};
struct Weight {
    int K = 0;
    long N = 0;
    int parts = 0;
    Part part[4];
    const int64_t *perm = nullptr;
};
void linear(const float *x, int M, const Weight &w, float *y, int nthreads);
}  // namespace fold::kernels::quant

namespace q = fleetllm::kernels::quant;

int main(int argc, char **argv)
{
    const char *names[] = {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_ZP", "Q8_ZP"};
    const int64_t ids[] = {q::Q4_0, q::Q4_1, q::Q8_0, q::Q4_K, q::Q5_K, q::Q6_K, q::Q4_ZP,
                           q::Q8_ZP};
    int64_t type = -1;
    for (int i = 0; i < 8; i++)
        if (argc > 1 && std::strcmp(argv[1], names[i]) == 0)
            type = ids[i];
    const int M = argc > 2 ? std::atoi(argv[2]) : 1, threads = argc > 3 ? std::atoi(argv[3]) : 2;
    const int rounds = argc > 4 ? std::atoi(argv[4]) : 4;
    if (type < 0 || M < 1 || M > 8 || threads < 1 || rounds < 1)
        return 2;
    const q::Layout l = q::layout(type);
    // qkv, o, gate_up, down of each of 12 layers, then the LM head: N x K
    const long shapes[5][2] = {{2304, 768}, {768, 768}, {4096, 768}, {768, 2048}, {32000, 768}};
    constexpr int G = 4 * 12 + 1;
    q::Weight w[G];
    fold::kernels::quant::Weight wf[G];
    long bytes = 0;
    std::mt19937 rng(1);
    for (int g = 0; g < G; g++) {
        const int s = g == G - 1 ? 4 : g % 4;
        const long N = shapes[s][0], K = shapes[s][1], row = K / l.elems * l.bytes;
        auto *data = static_cast<uint8_t *>(huge_mapping(N * row));
        if (data == nullptr)
            return 1;
        for (long i = 0; i < N * row; i++) data[i] = static_cast<uint8_t>(rng());
        const uint16_t h = 0x1c00;  // every fp16 scale (and K-quant minimum) ~0.004
        for (long b = 0; b < N * row; b += l.bytes) {
            std::memcpy(data + b + (type == q::Q6_K ? 208 : 0), &h, 2);
            if (type == q::Q4_K || type == q::Q5_K || type == q::Q4_1)
                std::memcpy(data + b + 2, &h, 2);
            if (type == q::Q4_ZP)
                data[b + 2] &= 15;
        }
        w[g].K = wf[g].K = static_cast<int>(K);
        w[g].N = wf[g].N = N;
        w[g].parts = wf[g].parts = 1;
        w[g].part[0] = {type, N, row, data};
        wf[g].part[0] = {type, N, row, data};
        bytes += N * row;
    }
    auto *x = static_cast<float *>(std::aligned_alloc(64, 8 * 2048 * 4));
    auto *y = static_cast<float *>(std::aligned_alloc(64, 8 * 32000 * 4));
    if (x == nullptr || y == nullptr)
        return 1;
    for (int i = 0; i < 8 * 2048; i++) x[i] = std::uniform_real_distribution<float>(-1, 1)(rng);
    double total[2] = {0, 0};
    for (int r = 0; r < rounds; r++) {
        double best[2];
        best_in_turns(5, best, [&](int v) {
            const double t0 = now();
            for (int g = 0; g < G; g++) {
                if (v == 0)
                    fold::kernels::quant::linear(x, M, wf[g], y, threads);
                else
                    q::linear(x, M, w[g], y, threads);
            }
            return now() - t0;
        });
        std::printf("%s M=%d T=%d old %.2f ms new %.2f ms (new/old %.3f; old %.1f, new %.1f GB/s)\n",
                    argv[1], M, threads, best[0] * 1e3, best[1] * 1e3, best[1] / best[0],
                    bytes / best[0] / 1e9, bytes / best[1] / 1e9);
        total[0] += best[0];
        total[1] += best[1];
    }
    std::printf("%s M=%d T=%d mean old %.2f ms new %.2f ms new/old %.3f (%.0f MiB)\n", argv[1], M,
                threads, total[0] / rounds * 1e3, total[1] / rounds * 1e3, total[1] / total[0],
                bytes / 1048576.0);
    return 0;
}
