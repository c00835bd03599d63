// Which threads run the kernels. The own pool is the default: it is faster for small decode
// batches, where an OpenMP wake-up under OMP_WAIT_POLICY=PASSIVE costs more than the work.
// FLEETLLM_KERNEL_THREADS=torch runs the same work items through
// at::parallel_for instead, so the two can be compared on a quiet machine; both give bitwise
// identical results (each item is computed by one thread whatever the split).
#include "parallel.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>

namespace fleetllm {

bool torch_threads()
{
    static const bool yes = [] {
        const char *v = std::getenv("FLEETLLM_KERNEL_THREADS");
        return v != nullptr && std::strcmp(v, "torch") == 0;
    }();
    return yes;
}

void parallel_run(int nthreads, PoolFn fn, void *ctx, long n, long chunk, bool spin)
{
    if (!torch_threads()) {
        pool_run(nthreads, fn, ctx, n, chunk, spin);
        return;
    }
    // Thread ids are at::get_thread_num(): < at::get_num_threads(), which callers pass as
    // nthreads to size per-thread scratch.
    at::parallel_for(0, n, chunk < 1 ? 1 : chunk, [&](int64_t begin, int64_t end) {
        fn(ctx, begin, end, at::get_thread_num());
    });
}

}  // namespace fleetllm
