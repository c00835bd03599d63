// The kernels' own thread pool (pool.cpp): workers that spin briefly between calls, then sleep.
// Self-contained (pthreads, no torch), so that tests/kernels/test_kernel_pool.py can build it alone
// with preemption points and a fork stress test.
#pragma once

namespace fleetllm {

// fn(ctx, begin, end, tid) over sub-ranges of [0, n).
using PoolFn = void (*)(void *ctx, long begin, long end, int tid);

// Runs fn over [0, n) in chunks of `chunk` items claimed dynamically by nthreads participants
// (tid 0 is the caller; every tid is < nthreads). Runs inline on the caller for one thread, for
// n <= chunk, while another thread's job is running, or when no worker could be started.
// spin: the workers stay awake for FLEETLLM_SPIN_US (default 100) after it, because another
// call is coming (a small decode batch calls ~60 kernels a few microseconds apart).
void pool_run(int nthreads, PoolFn fn, void *ctx, long n, long chunk, bool spin);

}  // namespace fleetllm
