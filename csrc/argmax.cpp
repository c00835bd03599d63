// Each row's argmax, for the sampler (greedy rows, and the exponential race of random ones).
// torch.argmax's CPU reduction runs about 1 ns an element here (29 us for one 32K-vocabulary
// row, 0.87 ms for 64 rows: ten times torch.amax), and a bfloat16 row had to be widened to
// float32 first. This reads float32 or bfloat16 rows in place, a vector at a time.
//
// The same answer as torch.argmax(x, dim=-1): the first of equal maxima, and the first NaN
// of a row that has one (torch counts NaN above everything).
#include <cmath>
#include <limits>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

template <class T>
int64_t first_nan(const T *x, int n)
{
    for (int i = 0; i < n; i++)
        if (std::isnan(to_f32(x[i])))
            return i;
    return -1;
}

template <class T>
int64_t argmax_row(const T *x, int n)
{
    float best = -std::numeric_limits<float>::infinity();
    int64_t at = 0;
    int i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    // Per lane: its largest value so far and where that was first seen (a strict > keeps the
    // first); lanes see increasing indices, so the smallest index among the lanes holding the
    // row's maximum is its first occurrence. Four chains of vectors, so that the latencies of
    // their compares and blends overlap.
    typedef int32_t veci __attribute__((vector_size(sizeof(vec))));
    constexpr int U = 4, STEP = U * VEC_LANES;
    if (n >= STEP) {
        vec top[U], v[U];
        veci where[U], index, nan = veci{};
        for (int l = 0; l < VEC_LANES; l++)
            index[l] = l;
        for (int u = 0; u < U; u++) {
            top[u] = best - vec{};
            where[u] = veci{};
        }
        for (; i + STEP <= n; i += STEP, index += STEP) {
            for (int u = 0; u < U; u++) {
                loadv(x + i + u * VEC_LANES, v[u]);
                const veci gt = v[u] > top[u];
                top[u] = gt ? v[u] : top[u];
                where[u] = gt ? index + u * VEC_LANES : where[u];
                nan |= v[u] != v[u];
            }
        }
        for (int l = 0; l < VEC_LANES; l++)
            if (nan[l])
                return first_nan(x, i);  // one is in x[0:i]
        for (int u = 0; u < U; u++)
            for (int l = 0; l < VEC_LANES; l++)
                if (top[u][l] > best || (top[u][l] == best && where[u][l] < at)) {
                    best = top[u][l];
                    at = where[u][l];
                }
    }
#endif
    for (; i < n; i++) {  // the tail (or the whole row): after every index above
        const float v = to_f32(x[i]);
        if (std::isnan(v))
            return i;
        if (v > best) {
            best = v;
            at = i;
        }
    }
    return at;
}

template <class T>
struct ArgmaxCtx {
    const T *x;
    long stride;
    int n;
    int64_t *out;
};

template <class T>
void argmax_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const ArgmaxCtx<T> *>(arg);
    for (long r = begin; r < end; r++)
        c->out[r] = argmax_row(c->x + r * c->stride, c->n);
}

}  // namespace

template <class T>
void argmax(const T *x, long stride, int rows, int n, int64_t *out, int nthreads)
{
    ArgmaxCtx<T> c{x, stride, n, out};
    parallel_run(nthreads, argmax_body<T>, &c, rows, 1 + PAR_MIN / n, rows <= SPIN_ROWS);
}

template void argmax<float>(const float *, long, int, int, int64_t *, int);
template void argmax<bf16>(const bf16 *, long, int, int, int64_t *, int);

}  // namespace fleetllm::kernels
