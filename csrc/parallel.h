// The kernels' parallel loop (parallel.cpp): the own pool (pool.h) or at::parallel_for.
#pragma once

#include "pool.h"

namespace fleetllm {

// Same contract as pool_run. FLEETLLM_KERNEL_THREADS=pool (default) runs it on the own pool,
// =torch on at::parallel_for (torch's OpenMP threads; `chunk` becomes the grain size and
// `spin` is ignored). Read once per process.
void parallel_run(int nthreads, PoolFn fn, void *ctx, long n, long chunk, bool spin);

// true when FLEETLLM_KERNEL_THREADS=torch.
bool torch_threads();

}  // namespace fleetllm
