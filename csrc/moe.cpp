// The fused mixture-of-experts layer: each selected expert's gate/up -> SiLU(gate) * up ->
// down on the rows routed to it, then the routing-weighted sum back into [T, H].
//
// How: the (token, slot) pairs are grouped by expert with a counting sort (stable: token
// order within an expert); each active expert's rows are gathered into one block and run
// through silu_mul (fused_ops.cpp) between two matrix products: up to GEMM_ROWS rows the GEMV
// kernel (gemv.cpp: the weight read once per call, 4 rows at a time per tile of weight rows),
// from there ATen's matmul (oneDNN: AMX or AVX-512 tiles, 1.5-4x faster than the GEMV at
// 64-256 rows of a 1536 x 2048 bf16 expert), one expert after another. The GEMV's experts: few
// (a decode step: k of them), one after another, each kernel parallel over the weight's rows;
// many (a prompt), the experts themselves shared among the threads, each run on one thread. The weighted sum adds each token's experts in ascending expert
// order, rounding to T after each product and add, as transformers' index_add_ loop does, so
// a bfloat16 model gives transformers' values. Experts nobody picked are never read.
// What fails: a bad argument is a RuntimeError (TORCH_CHECK); allocation through at::empty.
#include "moe.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm {
namespace {

using at::Tensor;
using kernels::bf16;

template <class T>
struct MoeCtx {
    const T *x, *w13, *w2;
    const int64_t *ids;
    const float *weights;
    T *xs, *gu, *act, *ys, *out;
    float *xf;  // the GEMV's widened x (bf16 without AVX-512), max(H, I) floats a row
    const long *row_start;  // by expert: its first row in xs / gu / act / ys
    const int *counts;      // by expert: its rows
    const int *active;      // the experts the GEMV runs, ascending
    const long *pair_row;   // by pair t * k + j: its row in ys
    int H, I, k, E, nthreads;
};

// One expert's rows through gate/up, SiLU * up, down, on `nthreads` threads.
template <class T>
void run_expert(const MoeCtx<T> &c, int e, int nthreads)
{
    const long r0 = c.row_start[e];
    const int rows = c.counts[e], H = c.H, I = c.I;
    float *xf = c.xf + r0 * std::max(H, I);
    kernels::gemv<T>(c.xs + r0 * H, c.w13 + static_cast<long>(e) * 2 * I * H, nullptr,
                     c.gu + r0 * 2 * I, rows, 2 * I, H, xf, nthreads);
    kernels::silu_mul<T>(c.gu + r0 * 2 * I, c.act + r0 * I, rows, I, nthreads);
    kernels::gemv<T>(c.act + r0 * I, c.w2 + static_cast<long>(e) * H * I, nullptr,
                     c.ys + r0 * H, rows, H, I, xf, nthreads);
}

// From this many rows an expert's products go to ATen's matmul (measured on an AMX Xeon: at
// 16 rows of a 1536 x 2048 bf16 weight it took 1.4 ms to the GEMV's 2.4, at 4 rows 2.3 to 0.9).
constexpr int GEMM_ROWS = 16;

// One expert's rows through ATen's matmul (parallel on torch's threads) and silu_mul.
template <class T>
void run_expert_gemm(const MoeCtx<T> &c, int e, const Tensor &xs, Tensor &gu, Tensor &act,
                     Tensor &ys, const Tensor &w13, const Tensor &w2)
{
    const long r0 = c.row_start[e];
    const int rows = c.counts[e];
    Tensor gu_e = gu.narrow(0, r0, rows), ys_e = ys.narrow(0, r0, rows);
    at::mm_out(gu_e, xs.narrow(0, r0, rows), w13.select(0, e).t());
    kernels::silu_mul<T>(c.gu + r0 * 2 * c.I, c.act + r0 * c.I, rows, c.I, c.nthreads);
    at::mm_out(ys_e, act.narrow(0, r0, rows), w2.select(0, e).t());
}

template <class T>
void experts_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const MoeCtx<T> *>(arg);
    for (long a = begin; a < end; a++) run_expert(*c, c->active[a], 1);
}

// out[t] = sum of its pairs' weighted rows, in ascending expert order, rounded as T adds.
template <class T>
void combine_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const MoeCtx<T> *>(arg);
    const int H = c->H, k = c->k;
    std::vector<int> slots(k);
    std::vector<float> acc(H);
    for (long t = begin; t < end; t++) {
        for (int j = 0; j < k; j++) slots[j] = j;
        const int64_t *ids = c->ids + t * k;
        std::stable_sort(slots.begin(), slots.end(),
                         [&](int a, int b) { return ids[a] < ids[b]; });
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int j : slots) {
            const float w = c->weights[t * k + j];
            const T *y = c->ys + c->pair_row[t * k + j] * H;
#pragma omp simd
            for (int h = 0; h < H; h++)
                acc[h] = kernels::round_to<T>(
                    acc[h] + kernels::round_to<T>(w * kernels::to_f32(y[h])));
        }
        T *o = c->out + t * H;
        for (int h = 0; h < H; h++) o[h] = kernels::from_f32<T>(acc[h]);
    }
}

template <class T>
const T *cptr(const Tensor &t) { return reinterpret_cast<const T *>(t.const_data_ptr()); }
template <class T>
T *mptr(const Tensor &t) { return reinterpret_cast<T *>(t.mutable_data_ptr()); }

template <class T>
void fused_moe_typed(const Tensor &x, const Tensor &ids, const Tensor &weights,
                     const Tensor &w13, const Tensor &w2, Tensor &out)
{
    const int T_ = static_cast<int>(x.size(0)), H = static_cast<int>(x.size(1));
    const int k = static_cast<int>(ids.size(1)), E = static_cast<int>(w13.size(0));
    const int I = static_cast<int>(w2.size(2));
    const long pairs = static_cast<long>(T_) * k;
    const int64_t *id = ids.const_data_ptr<int64_t>();
    const ExpertGroups g(id, pairs, E);
    const auto opts = x.options();
    Tensor xs = at::empty({pairs, H}, opts), gu = at::empty({pairs, 2L * I}, opts);
    Tensor act = at::empty({pairs, I}, opts), ys = at::empty({pairs, H}, opts);
    Tensor xf = at::empty({pairs * std::max(H, I)}, opts.dtype(at::kFloat));
    const T *xp = cptr<T>(x);
    T *xsp = mptr<T>(xs);
    for (long p = 0; p < pairs; p++)  // gather each pair's token row into its expert's block
        std::memcpy(xsp + g.pair_row[p] * H, xp + (p / k) * H, sizeof(T) * H);
    const int nthreads = at::get_num_threads();
    MoeCtx<T> c{xp, cptr<T>(w13), cptr<T>(w2), id, weights.const_data_ptr<float>(), xsp,
                mptr<T>(gu), mptr<T>(act), mptr<T>(ys), mptr<T>(out), xf.mutable_data_ptr<float>(),
                g.row_start.data(), g.counts.data(), g.active.data(), g.pair_row.data(), H, I,
                k, E, nthreads};
    std::vector<int> by_gemv;
    for (int e : g.active) {
        if (g.counts[e] >= GEMM_ROWS)
            run_expert_gemm(c, e, xs, gu, act, ys, w13, w2);
        else
            by_gemv.push_back(e);
    }
    c.active = by_gemv.data();
    const long n_gemv = static_cast<long>(by_gemv.size());
    if (n_gemv >= 2L * nthreads && nthreads > 1)  // enough experts to share the threads
        parallel_run(nthreads, experts_body<T>, &c, n_gemv, 1, false);
    else
        for (int e : by_gemv) run_expert(c, e, nthreads);
    const long chunk = std::max(1L, kernels::PAR_MIN / std::max(1L, static_cast<long>(H) * k));
    parallel_run(nthreads, combine_body<T>, &c, T_, chunk, T_ <= kernels::SPIN_ROWS);
}

void check_tensor(const Tensor &t, const char *name, int64_t dim, at::ScalarType type)
{
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
    TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

Tensor fused_moe(const Tensor &x, const Tensor &ids, const Tensor &weights, const Tensor &w13,
                 const Tensor &w2)
{
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "x must be float32 or bfloat16, got ", x.scalar_type());
    const at::ScalarType type = x.scalar_type();
    check_tensor(x, "x", 2, type);
    check_tensor(w13, "w13", 3, type);
    check_tensor(w2, "w2", 3, type);
    check_tensor(ids, "ids", 2, at::kLong);
    check_tensor(weights, "weights", 2, at::kFloat);
    const int64_t t = x.size(0), h = x.size(1), e = w13.size(0), i = w2.size(2);
    TORCH_CHECK(t <= INT_MAX && h > 0 && h <= INT_MAX && e > 0 && e <= INT_MAX && i > 0
                    && i <= INT_MAX / 2, "x ", x.sizes(), " or w2 ", w2.sizes(), " out of range");
    TORCH_CHECK(ids.size(0) == t && ids.size(1) > 0, "ids must be [", t, ", k], got ", ids.sizes());
    TORCH_CHECK(weights.sizes() == ids.sizes(), "weights must have ids' shape ", ids.sizes(),
                ", got ", weights.sizes());
    TORCH_CHECK(w13.size(1) == 2 * i && w13.size(2) == h, "w13 must be [E, 2I, H] = [", e, ", ",
                2 * i, ", ", h, "], got ", w13.sizes());
    TORCH_CHECK(w2.size(0) == e && w2.size(1) == h, "w2 must be [E, H, I] = [", e, ", ", h, ", ",
                i, "], got ", w2.sizes());
    if (ids.numel()) {
        const int64_t *p = ids.const_data_ptr<int64_t>();
        const auto [lo, hi] = std::minmax_element(p, p + ids.numel());
        TORCH_CHECK(*lo >= 0 && *hi < e, "expert ids must be in [0, ", e, "), got ", *lo, "..",
                    *hi);
    }
    Tensor out = at::empty({t, h}, x.options());
    if (t == 0) return out;
    if (type == at::kFloat)
        fused_moe_typed<float>(x, ids, weights, w13, w2, out);
    else
        fused_moe_typed<bf16>(x, ids, weights, w13, w2, out);
    return out;
}

}  // namespace fleetllm
