// Two builds of csrc/paged_decode.cpp timed in one process, taking turns pass by pass (as
// tools/gemm_pairs_ab.cpp does for the GEMM: on a machine whose memory bandwidth moves from
// minute to minute, two processes run apart compare two machines). A pass is one decode step's
// attention on the 125M preset's heads (12 query heads over 4 KV heads of 64, or others: below;
// bf16 queries and cache): B sequences of 100-260 positions (fixed seed), 12 layers each with
// its own cache of shuffled 16-token blocks, in huge pages, so that a large batch's K/V comes
// from memory as in the engine; the best of 7 passes per build per round.
//
//     git worktree add /tmp/old <commit>
//     F="-O3 -fopenmp-simd -fno-math-errno -fno-trapping-math -pthread -mtune=native"
//     F="$F -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma"  # fleetllm/kernels/build.py's flags
//     # (on a CPU without AVX-512: F="$F -mavx2 -mfma", the avx2 variant's)
//     c++ $F -I/tmp/old/csrc -Dfleetllm=fold -c /tmp/old/csrc/paged_decode.cpp -o /tmp/old.o
//     c++ $F -Icsrc tools/decode_ab.cpp csrc/paged_decode.cpp csrc/pool.cpp /tmp/old.o -o /tmp/ab
//     /tmp/ab 64 10      # sequences, rounds
//     /tmp/ab 1 10 200   # ... and MiB read before each pass (a step's weights stream), so that
//                        # a small batch's K/V is cold as in the engine, not in L2/L3
//     /tmp/ab 4 10 200 32 8   # ... and other heads: query heads, KV heads (Llama-3.2-1B's)
//
// "old" is the build whose namespace -Dfleetllm=fold renamed; "new" is this tree's.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "ab_pool.h"
#include "kernels.h"

namespace fleetllm::kernels {
const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
}  // namespace fleetllm::kernels
namespace fold::kernels {
struct DecodeBatch {
    const int32_t *tables, *table_start, *ctx_lens;
    int maxlen;
};
extern const bool bf16_dot;
const bool bf16_dot = fleetllm::kernels::bf16_dot;
enum class bf16 : uint16_t {};
template <class T, class C>
void paged_decode(const T *, long, const C *, const C *, const DecodeBatch &, T *, int, int, int,
                  int, int, int, float, float *, int);
}  // namespace fold::kernels

int main(int argc, char **argv)
{
    using fleetllm::kernels::bf16;
    const int B = argc > 1 ? std::atoi(argv[1]) : 64, rounds = argc > 2 ? std::atoi(argv[2]) : 8;
    const long cold = argc > 3 ? std::atol(argv[3]) << 20 : 0;
    const int H = argc > 4 ? std::atoi(argv[4]) : 12, KVH = argc > 5 ? std::atoi(argv[5]) : 4;
    if (B < 1 || B > 1024 || rounds < 1 || cold < 0 || KVH < 1 || H < KVH || H % KVH != 0)
        return 2;
    std::vector<uint64_t> stream(static_cast<size_t>(cold) / 8, 1);
    uint64_t sink = 0;
    if (cold > 0)
        std::printf("each pass after reading %ld MiB\n", cold >> 20);
    constexpr int D = 64, BS = 16, LAYERS = 12;
    std::mt19937 rng(0);
    std::vector<int32_t> lens(B), starts(B), tables;
    for (int b = 0; b < B; b++) {
        lens[b] = 100 + static_cast<int>(rng() % 161);
        starts[b] = static_cast<int32_t>(tables.size());
        tables.resize(tables.size() + (lens[b] + BS - 1) / BS);
    }
    const long blocks = static_cast<long>(tables.size());
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);
    const int maxlen = *std::max_element(lens.begin(), lens.end());
    const long half = blocks * BS * KVH * D, bytes = 2 * half * 2 * LAYERS;  // K and V, bf16
    auto *cache = static_cast<uint16_t *>(huge_mapping(bytes));
    if (cache == nullptr)
        return 1;
    for (long i = 0; i < bytes / 2; i++) cache[i] = static_cast<uint16_t>(0x3c00 + (rng() & 255));
    std::vector<uint16_t> q(static_cast<size_t>(B) * H * D, 0x3f80), out(q.size());
    std::vector<float> scratch(fleetllm::kernels::paged_decode_scratch(H, D, BS, maxlen, 2));
    const fleetllm::kernels::DecodeBatch nb{tables.data(), starts.data(), lens.data(), maxlen};
    const fold::kernels::DecodeBatch ob{tables.data(), starts.data(), lens.data(), maxlen};
    const auto *qp = reinterpret_cast<const bf16 *>(q.data());
    auto *op = reinterpret_cast<bf16 *>(out.data());
    double total[2] = {0, 0};
    for (int r = 0; r < rounds; r++) {
        double best[2];
        best_in_turns(7, best, [&](int v) {
            for (const uint64_t w : stream) sink += w;  // evicts K/V, as a step's weights do
            const double t0 = now();
            for (int l = 0; l < LAYERS; l++) {
                const auto *k = reinterpret_cast<const bf16 *>(cache) + 2 * half * l;
                using fb = fold::kernels::bf16;
                if (v == 0)
                    fold::kernels::paged_decode<fb, fb>(
                        reinterpret_cast<const fb *>(qp), H * D,
                        reinterpret_cast<const fb *>(k), reinterpret_cast<const fb *>(k + half),
                        ob, reinterpret_cast<fb *>(op), B, H, KVH, D, BS, 0, 0.125f,
                        scratch.data(), 2);
                else
                    fleetllm::kernels::paged_decode<bf16, bf16>(qp, H * D, k, k + half, nb, op,
                                                                B, H, KVH, D, BS, 0, 0.125f,
                                                                scratch.data(), 2);
            }
            return now() - t0;
        });
        std::printf("B=%d old %.2f ms new %.2f ms (new/old %.3f)\n", B, best[0] * 1e3,
                    best[1] * 1e3, best[1] / best[0]);
        total[0] += best[0];
        total[1] += best[1];
    }
    std::printf("B=%d mean old %.2f ms new %.2f ms new/old %.3f\n", B, total[0] / rounds * 1e3,
                total[1] / rounds * 1e3, total[1] / total[0]);
    return sink == 1 ? 3 : 0;  // (keeps the reads)
}
