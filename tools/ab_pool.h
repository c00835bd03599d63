// What the A/B tools share (gemm_pairs_ab.cpp, decode_ab.cpp, gemv_ab.cpp: two builds of a
// kernel source in one process, the old one's namespace renamed fleetllm -> fold): the kernels'
// parallel loop for both builds on one pool (parallel.cpp is not linked: both call pool_run),
// a clock, the huge-page mapping their data lives in, and the passes taken in turn.
#pragma once

#include <sys/mman.h>

#include <cstdlib>
#include <ctime>

#include "pool.h"

namespace fleetllm {
void parallel_run(int nthreads, PoolFn fn, void *ctx, long n, long chunk, bool spin)
{
    pool_run(nthreads, fn, ctx, n, chunk, spin);
}
}  // namespace fleetllm

namespace fold {
void parallel_run(int nthreads, fleetllm::PoolFn fn, void *ctx, long n, long chunk, bool spin)
{
    fleetllm::pool_run(nthreads, fn, ctx, n, chunk, spin);  // one pool for both builds
}
}  // namespace fold

// Wall time, or with AB_CLOCK=thread the calling thread's CPU time: on a machine others share,
// a one-thread pass (the pool runs it inline) is then not charged for the time it waited.
inline double now()
{
    static const bool thread_clock = std::getenv("AB_CLOCK") && std::getenv("AB_CLOCK")[0] == 't';
    timespec t;
    clock_gettime(thread_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// bytes of fresh memory advised MADV_HUGEPAGE before it is touched, as the loader places a
// model's weights (model/huge_pages.py); nullptr where the kernel refuses the mapping.
inline void *huge_mapping(long bytes)
{
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return nullptr;
    madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

// best[v]: the least of `reps` timings of pass(v), the builds taking turns pass by pass
// (v 0 the old build, 1 the new one; pass(v) returns its own seconds, so that what it does
// before its clock starts, such as evicting the caches, is not counted).
template <class Pass>
void best_in_turns(int reps, double (&best)[2], Pass &&pass)
{
    best[0] = best[1] = 1e9;
    for (int rep = 0; rep < reps; rep++)
        for (int v = 0; v < 2; v++) {
            const double dt = pass(v);
            best[v] = dt < best[v] ? dt : best[v];
        }
}
