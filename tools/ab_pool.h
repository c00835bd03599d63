// What the A/B tools share (gemm_pairs_ab.cpp, decode_ab.cpp: two builds of a kernel source in
// one process, the old one's namespace renamed fleetllm -> fold): the kernels' parallel loop
// for both builds on one pool (parallel.cpp is not linked: both call pool_run), and a clock.
#pragma once

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

inline double now()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
