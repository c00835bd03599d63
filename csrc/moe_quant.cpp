// torch.ops.fleetllm.gguf_fused_moe: the fused mixture-of-experts layer over quantized experts
// (a GGUF file's ffn_{gate,up,down}_exps kept as the file stores them; moe.cpp is the bf16 /
// float32 op, model/moe_quant.py the Python side).
//
// The experts: one uint8 buffer of 2E packed copies (quant.h's format; quant/packed.py), copy
// 2e expert e's gate rows then up rows [2I, H], copy 2e + 1 its down [H, I]; bounds int64
// [2E + 1] gives copy j's bytes [bounds[j], bounds[j + 1]). Each copy may mix block types as
// the file does (Q4_K_M: Q4_K gate/up, Q6_K down on some layers).
// How: the (token, slot) pairs are grouped by expert with a stable counting sort (token order
// within an expert), each pair's x row gathered as float32; each active expert's rows run
// through q::linear (quant.cpp: the GEMV for every block type, VNNI where the CPU has it; one
// call for up to 8 rows, a decode step's) or, for more rows (a prompt's), gguf_linear (passes
// of 8, or chunks of the weight dequantized for a GEMM in x's dtype: bf16's rounds gate/up and
// the activation to bf16, as moe.cpp does) for gate/up, SiLU(gate) * up in float32, the same
// for down. The larger experts run one after another, each product
// parallel over the weight's rows; the small ones too where they are few (a decode step's k),
// or shared among the threads, an expert a thread, where there are at least two a thread (a
// batch of decodes): either way each output is one thread's sum, so the bits are the same. The
// weighted sum adds each token's experts in ascending expert order, each expert's output
// rounded to x's dtype first, then rounding as x's dtype adds (moe.cpp's order, and
// transformers' index_add_ loop). Only the active experts' copies are parsed or read.
// What fails: a bad argument or a copy whose header does not parse or whose shapes do not fit
// x (checked for every expert a call reads, before any product) is a RuntimeError.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "moe.h"
#include "parallel.h"
#include "quant.h"
#include "quant_ops.h"

namespace fleetllm {
namespace {

namespace q = kernels::quant;
using at::Tensor;
using kernels::bf16;

constexpr int PASS_ROWS = 8;  // q::linear's VNNI path takes up to 8 rows a call

q::Weight parse_copy(const uint8_t *base, const int64_t *bounds, int64_t j, int64_t total,
                     int64_t expert)
{
    const int64_t begin = bounds[j], end = bounds[j + 1];
    const char *what = j % 2 ? "down" : "gate/up";
    TORCH_CHECK(0 <= begin && begin <= end && end <= total && begin % 8 == 0, "expert ", expert,
                "'s ", what, " copy spans bytes [", begin, ", ", end, ") of ", total);
    q::Weight w;
    const char *err = q::parse(base + begin, end - begin, w);
    TORCH_CHECK(err == nullptr, "expert ", expert, "'s ", what, " copy: ", err ? err : "");
    TORCH_CHECK(w.perm == nullptr, "expert ", expert, "'s ", what, " copy permutes its columns");
    return w;
}

// SiLU(gate) * up of rows [r0, r0 + rows) of gu [., 2I] into act [., I], float32.
void silu_mul_rows(const float *gu, float *act, long r0, long rows, int I)
{
    for (long r = r0; r < r0 + rows; r++) {
        const float *g = gu + r * 2 * I;
        float *o = act + r * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    }
}

// The experts of up to PASS_ROWS rows (a decode step's): one q::linear call a product.
struct SmallCtx {
    const float *xs;
    float *gu, *act, *ys;
    const long *row_start;  // by expert
    const int *counts;      // by expert
    const int *experts;     // by index a: the expert
    const int *list;        // the indices a to run
    const q::Weight *w13, *w2;  // by index a
    int H, I;
};

void small_expert(const SmallCtx &c, int a, int nthreads)
{
    const int e = c.experts[a];
    const long r0 = c.row_start[e];
    const int rows = c.counts[e];
    q::linear(c.xs + r0 * c.H, rows, c.w13[a], c.gu + r0 * 2 * c.I, nthreads);
    silu_mul_rows(c.gu, c.act, r0, rows, c.I);
    q::linear(c.act + r0 * c.I, rows, c.w2[a], c.ys + r0 * c.H, nthreads);
}

void small_body(void *arg, long begin, long end, int)
{
    const auto *c = static_cast<const SmallCtx *>(arg);
    for (long i = begin; i < end; i++) small_expert(*c, c->list[i], 1);
}

// An expert of more rows (a prompt's): gguf_linear on its copies, which runs passes of 8 rows
// or dequantizes chunks of the weight for a GEMM, as for a dense projection. In a bf16 model
// the rows go in as bf16 (exactly: x was bf16), so that the GEMM is bf16's (AMX where the CPU
// has it), and gate/up and the activation are rounded to bf16 as moe.cpp's bf16 op rounds them.
void large_expert(const Tensor &xs, const Tensor &gu, const Tensor &act, const Tensor &ys,
                  const Tensor &packed, const int64_t *bounds, int e, long r0, long rows, int I,
                  bool bf16_rows)
{
    const auto copy = [&](int64_t j) {
        return packed.narrow(0, bounds[j], bounds[j + 1] - bounds[j]);
    };
    const auto rows_of = [&](const Tensor &t) {
        const Tensor r = t.narrow(0, r0, rows);
        return bf16_rows ? r.to(at::kBFloat16) : r;
    };
    gu.narrow(0, r0, rows).copy_(gguf_linear(rows_of(xs), copy(2L * e), std::nullopt));
    silu_mul_rows(gu.const_data_ptr<float>(), act.mutable_data_ptr<float>(), r0, rows, I);
    ys.narrow(0, r0, rows).copy_(gguf_linear(rows_of(act), copy(2L * e + 1), std::nullopt));
}

template <class T>
void run(const Tensor &x, const Tensor &ids, const Tensor &weights, const Tensor &packed,
         const int64_t *bounds, int E, Tensor &out)
{
    const uint8_t *base = packed.const_data_ptr<uint8_t>();
    const int64_t total = packed.numel();
    const long T_ = x.size(0), pairs = T_ * ids.size(1);
    const int H = static_cast<int>(x.size(1)), k = static_cast<int>(ids.size(1));
    const int64_t *id = ids.const_data_ptr<int64_t>();
    const ExpertGroups g(id, pairs, E);
    const std::vector<int> &counts = g.counts, &active = g.active;
    const std::vector<long> &row_start = g.row_start, &pair_row = g.pair_row;
    // Every copy this call reads, parsed and checked before any product.
    std::vector<q::Weight> w13(active.size()), w2(active.size());
    int I = 0;
    for (size_t a = 0; a < active.size(); a++) {
        const int e = active[a];
        w13[a] = parse_copy(base, bounds, 2L * e, total, e);
        w2[a] = parse_copy(base, bounds, 2L * e + 1, total, e);
        const long i = w13[a].N / 2;
        TORCH_CHECK(w13[a].K == H && w13[a].N % 2 == 0 && i > 0 && w2[a].K == i &&
                        w2[a].N == H,
                    "expert ", e, ": gate/up is [", w13[a].N, ", ", w13[a].K, "], down [",
                    w2[a].N, ", ", w2[a].K, "]; x has ", H, " features");
        TORCH_CHECK(a == 0 || i == I, "expert ", e, " has ", i, " intermediate features, "
                    "expert ", active[0], " ", I);
        I = static_cast<int>(i);
    }
    const auto fopts = x.options().dtype(at::kFloat);
    Tensor xs = at::empty({pairs, H}, fopts), gu = at::empty({pairs, 2L * I}, fopts);
    Tensor act = at::empty({pairs, static_cast<long>(I)}, fopts), ys = at::empty({pairs, H}, fopts);
    const T *xp = reinterpret_cast<const T *>(x.const_data_ptr());
    float *xsp = xs.mutable_data_ptr<float>(), *gup = gu.mutable_data_ptr<float>();
    float *actp = act.mutable_data_ptr<float>(), *ysp = ys.mutable_data_ptr<float>();
    for (long p = 0; p < pairs; p++) {  // each pair's token row into its expert's block
        const long r = pair_row[p];
        const T *src = xp + (p / k) * H;
        for (int h = 0; h < H; h++) xsp[r * H + h] = kernels::to_f32(src[h]);
    }
    const int nthreads = at::get_num_threads();
    std::vector<int> small;
    for (int a = 0; a < static_cast<int>(active.size()); a++) {
        const int e = active[a];
        if (counts[e] > PASS_ROWS)
            large_expert(xs, gu, act, ys, packed, bounds, e, row_start[e], counts[e], I,
                         std::is_same_v<T, bf16>);
        else
            small.push_back(a);
    }
    SmallCtx c{xsp, gup, actp, ysp, row_start.data(), counts.data(), active.data(),
               small.data(), w13.data(), w2.data(), H, I};
    const long n_small = static_cast<long>(small.size());
    if (n_small >= 2L * nthreads && nthreads > 1)  // enough experts to share the threads
        parallel_run(nthreads, small_body, &c, n_small, 1, false);
    else
        for (int a : small) small_expert(c, a, nthreads);
    const float *wp = weights.const_data_ptr<float>();
    T *outp = reinterpret_cast<T *>(out.mutable_data_ptr());
    at::parallel_for(0, T_, std::max(1L, kernels::PAR_MIN / (static_cast<long>(H) * k)),
                     [&](int64_t t0, int64_t t1) {
        std::vector<int> slots(k);
        std::vector<float> acc(H);
        for (int64_t t = t0; t < t1; t++) {
            for (int j = 0; j < k; j++) slots[j] = j;
            const int64_t *tid = id + t * k;
            std::stable_sort(slots.begin(), slots.end(),
                             [&](int a, int b) { return tid[a] < tid[b]; });
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int j : slots) {
                const float w = wp[t * k + j];
                const float *y = ysp + pair_row[t * k + j] * H;
                for (int h = 0; h < H; h++)
                    acc[h] = kernels::round_to<T>(
                        acc[h] + kernels::round_to<T>(w * kernels::round_to<T>(y[h])));
            }
            for (int h = 0; h < H; h++) outp[t * H + h] = kernels::from_f32<T>(acc[h]);
        }
    });
}

void check_tensor(const Tensor &t, const char *name, int64_t dim, at::ScalarType type)
{
    TORCH_CHECK(t.device().is_cpu(), "gguf_fused_moe: ", name, " must be on the CPU");
    TORCH_CHECK(t.dim() == dim, "gguf_fused_moe: ", name, " must have ", dim,
                " dimensions, got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == type, "gguf_fused_moe: ", name, " must be ", type, ", got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "gguf_fused_moe: ", name, " must be contiguous");
}

}  // namespace

Tensor gguf_fused_moe(const Tensor &x, const Tensor &ids, const Tensor &weights,
                      const Tensor &packed, const Tensor &bounds)
{
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "gguf_fused_moe: x must be float32 or bfloat16, got ", x.scalar_type());
    check_tensor(x, "x", 2, x.scalar_type());
    check_tensor(ids, "ids", 2, at::kLong);
    check_tensor(weights, "weights", 2, at::kFloat);
    check_tensor(packed, "packed", 1, at::kByte);
    check_tensor(bounds, "bounds", 1, at::kLong);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.const_data_ptr()) % 8 == 0,
                "gguf_fused_moe: packed must be 8-byte aligned");
    const int64_t t = x.size(0), h = x.size(1), e = (bounds.size(0) - 1) / 2;
    TORCH_CHECK(bounds.size(0) % 2 == 1 && e > 0 && e <= INT_MAX, "gguf_fused_moe: bounds "
                "must be [2E + 1], got ", bounds.sizes());
    TORCH_CHECK(t <= INT_MAX && h > 0 && h <= INT_MAX, "gguf_fused_moe: x ", x.sizes(),
                " out of range");
    TORCH_CHECK(ids.size(0) == t && ids.size(1) > 0, "gguf_fused_moe: ids must be [", t,
                ", k], got ", ids.sizes());
    TORCH_CHECK(weights.sizes() == ids.sizes(), "gguf_fused_moe: weights must have ids' shape ",
                ids.sizes(), ", got ", weights.sizes());
    if (ids.numel()) {
        const int64_t *p = ids.const_data_ptr<int64_t>();
        const auto [lo, hi] = std::minmax_element(p, p + ids.numel());
        TORCH_CHECK(*lo >= 0 && *hi < e, "gguf_fused_moe: expert ids must be in [0, ", e,
                    "), got ", *lo, "..", *hi);
    }
    Tensor out = at::empty({t, h}, x.options());
    if (t == 0) return out;
    const int64_t *b = bounds.const_data_ptr<int64_t>();
    if (x.scalar_type() == at::kFloat)
        run<float>(x, ids, weights, packed, b, static_cast<int>(e), out);
    else
        run<bf16>(x, ids, weights, packed, b, static_cast<int>(e), out);
    return out;
}

}  // namespace fleetllm

TORCH_LIBRARY_FRAGMENT(fleetllm, m)
{
    m.def("gguf_fused_moe(Tensor x, Tensor ids, Tensor weights, Tensor packed, Tensor bounds) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(fleetllm, CPU, m)
{
    m.impl("gguf_fused_moe", &fleetllm::gguf_fused_moe);
}
