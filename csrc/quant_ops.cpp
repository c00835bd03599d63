// torch.ops.fleetllm.gguf_* : the quantized projections' ops (quant_ops.h), with their checks
// (a packed copy's header is parsed and bounds-checked at every call: a RuntimeError, never a
// wild read) and registration (a fragment of ops.cpp's library).
#include "quant_ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <string>

#include "quant.h"

namespace fleetllm {

namespace q = kernels::quant;
using at::Tensor;

namespace {

// Rows of x past which a call dequantizes chunks of the weight for a GEMM instead (a prompt:
// the GEMM's blocking beats re-unpacking each block per 8 rows); in bf16 for a bf16 x (the
// weights rounded to bf16 as a bf16 model's are: AMX's GEMM, 3x faster here than float32's).
// Where VNNI reads every part, its 8-row passes win up to 32 rows for a float32 x (a 4096 x 768
// weight, 32 rows: 2.2 ms in passes, ~2.6 ms dequantized into float32's GEMM) and up to 12 for
// a bf16 x (one thread: 9-12 rows 1.0-1.4 ms in passes, 1.4-1.6 dequantized for AMX's GEMM,
// which wins from 13; the float unpacking took 1.5-2.5 ms there).
constexpr int64_t GEMM_ROWS = 16, VNNI_GEMM_ROWS = 32, VNNI_BF16_GEMM_ROWS = 12, VNNI_ROWS = 8;
// W8A8's int8 GEMM (int8_linear) from this many rows: it gives the GEMV's integer sums, and
// from 8 rows its time (one thread, a 6144 x 768 weight, the int8 copy included: 8 rows 0.43-
// 0.47 ms, 12 0.51) beats the passes' (0.50, 0.78); 2-4 rows stay on the GEMV (0.15-0.26 ms
// against 0.39-0.51).
constexpr int64_t INT8_GEMM_ROWS = 8;
// Weight elements dequantized per GEMM (at least 1024 rows): few, large calls. Each call costs
// a thread hand-off and a copy into y; a 4096 x 768 weight in 4 chunks of 1024 rows took 0.35-0.5
// ms more than in one (one thread, 17-64 rows of bf16 x; one mm: 0.6-0.85 ms).
constexpr int64_t CHUNK_ELEMS = 4 << 20, CHUNK_MIN_ROWS = 1024;

// Whether a kernel this CPU runs (`available`) reads every part of w: the VNNI GEMV (its
// passes then serve up to VNNI_GEMM_ROWS), the AVX-512 dequantizer (a bf16 GEMM's chunks are
// then written as bf16 directly, without a float32 copy to convert).
bool reads_all(const q::Weight &w, bool available, bool (*reads)(int64_t type, int K))
{
    for (int p = 0; p < w.parts && available; p++)
        available = reads(w.part[p].type, w.K);
    return available;
}
bool vnni_all(const q::Weight &w)
{
    return reads_all(w, q::vnni_available(), q::vnni_reads);
}
bool fast_dequant_all(const q::Weight &w)
{
    return reads_all(w, q::fast_dequant_available(),
                     [](int64_t type, int) { return q::fast_dequant_reads(type); });
}

q::Weight parsed(const Tensor &packed)
{
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                    packed.dim() == 1 && packed.is_contiguous(),
                "a packed quantized weight must be a contiguous CPU uint8 1-D tensor, got ",
                packed.scalar_type(), " ", packed.sizes());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.const_data_ptr()) % 8 == 0,
                "a packed quantized weight must be 8-byte aligned");
    q::Weight w;
    const char *err = q::parse(packed.const_data_ptr<uint8_t>(), packed.numel(), w);
    TORCH_CHECK(err == nullptr, "packed quantized weight: ", err ? err : "");
    return w;
}

// x's columns in the weight's stored order, x[:, perm] (GPTQ's act-order): one gather at
// entry, so that every path after it reads x as it does without a permutation.
template <typename T> void gather_columns(const T *x, const int64_t *perm, int64_t m, int K,
                                          T *out)
{
    at::parallel_for(0, m, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++)
            for (int k = 0; k < K; k++) out[r * K + k] = x[r * K + perm[k]];
    });
}

Tensor permuted(const Tensor &x, const q::Weight &w)
{
    Tensor out = at::empty_like(x);
    if (x.scalar_type() == at::kFloat)
        gather_columns(x.const_data_ptr<float>(), w.perm, x.size(0), w.K,
                       out.mutable_data_ptr<float>());
    else
        gather_columns(x.const_data_ptr<at::BFloat16>(), w.perm, x.size(0), w.K,
                       out.mutable_data_ptr<at::BFloat16>());
    return out;
}

// Rows [r0, r0 + rows) of a W8A8 weight (every part Q8_0, one scale a row) as int8 [rows, K]
// and each row's scale (its first block's).
void int8_rows(const q::Weight &w, int64_t r0, int64_t rows, int8_t *out, float *scale)
{
    at::parallel_for(0, rows, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            int64_t n = r0 + i;
            int pi = 0;
            while (n >= w.part[pi].rows) n -= w.part[pi++].rows;
            const uint8_t *row = w.part[pi].data + n * w.part[pi].row_bytes;
            uint16_t d;
            std::memcpy(&d, row, 2);
            scale[i] = static_cast<float>(c10::Half(d, c10::Half::from_bits()));
            for (int b = 0; b < w.K / 32; b++)
                std::memcpy(out + i * w.K + 32 * b, row + 34 * b + 2, 32);
        }
    });
}

// W8A8's activations, as vLLM quantizes them: each row of x (float32) to int8 with the scale
// max |x| / 127; returns the levels (float32, integers in [-127, 127]) and the scales [m, 1].
std::pair<Tensor, Tensor> int8_levels(const Tensor &xf)
{
    Tensor sx = xf.abs().amax(1, true).div_(127.0f);
    return {xf.div(sx.clamp_min(FLT_MIN)).round_(), sx};
}

// W8A8's GEMM: x's int8 levels, the weights' int8 values, oneDNN's int8 GEMM (at::_int_mm:
// VNNI, or AMX-INT8 where the CPU has it; about twice bf16's GEMM on a Zen 5), the int32 sums
// scaled by both scales. float32 [m, N].
Tensor int8_linear(const Tensor &xp, const q::Weight &w)
{
    const Tensor xf = xp.to(at::kFloat);
    const auto [levels, sx] = int8_levels(xf);
    const Tensor xq = levels.to(at::kChar);
    const int64_t chunk =
        std::min<int64_t>(std::max<int64_t>(CHUNK_ELEMS / w.K, CHUNK_MIN_ROWS), w.N);
    Tensor wq = at::empty({chunk, w.K}, xf.options().dtype(at::kChar));
    Tensor sw = at::empty({chunk}, xf.options());
    Tensor y = at::empty({xf.size(0), w.N}, xf.options());
    for (int64_t n0 = 0; n0 < w.N; n0 += chunk) {
        const int64_t rows = std::min(chunk, w.N - n0);
        int8_rows(w, n0, rows, wq.mutable_data_ptr<int8_t>(), sw.mutable_data_ptr<float>());
        const Tensor acc = at::_int_mm(xq, wq.narrow(0, 0, rows).t());
        y.narrow(1, n0, rows).copy_(acc.to(at::kFloat).mul_(sx).mul_(sw.narrow(0, 0, rows)));
    }
    return y;
}

}  // namespace

Tensor onednn_linear(const Tensor &x, const Tensor &w, const std::optional<Tensor> &b)
{
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, w, b, std::string("none"),
                            c10::List<std::optional<at::Scalar>>({std::nullopt}), std::string()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
}

bool is_gguf_packed(const Tensor &t)
{
    return t.scalar_type() == at::kByte && t.dim() == 1 && !t.is_mkldnn();
}

std::pair<int64_t, int64_t> gguf_features(const Tensor &packed)
{
    const q::Weight w = parsed(packed);
    return {w.K, w.N};
}

Tensor gguf_linear(const Tensor &x, const Tensor &packed, const std::optional<Tensor> &bias)
{
    const q::Weight w = parsed(packed);
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "gguf_linear: x must be a contiguous CPU float32 or bfloat16 [M, K], got ",
                x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(x.size(1) == w.K, "gguf_linear: x has ", x.size(1), " features, the weight ",
                w.K);
    if (bias)
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.N, "gguf_linear: bias must be [",
                    w.N, "], got ", bias->sizes());
    const int64_t m = x.size(0);
    TORCH_CHECK(m <= INT32_MAX, "gguf_linear: too many rows");
    const Tensor xp = w.perm ? permuted(x, w) : x;  // x in the stored column order
    Tensor y;
    const bool vnni = vnni_all(w);
    const bool passes =
        vnni && m <= (x.scalar_type() == at::kFloat ? VNNI_GEMM_ROWS : VNNI_BF16_GEMM_ROWS);
    const bool gemv = (!vnni && m <= GEMM_ROWS) || w.K % 16 || passes;
    if (w.int8_acts && (m >= INT8_GEMM_ROWS || !gemv)) {
        y = int8_linear(xp, w);
    } else if (gemv) {  // float32 x for the GEMV (W8A8: its VNNI path quantizes x per row;
                        // elsewhere x's int8 levels times their scales)
        Tensor xf = xp.scalar_type() == at::kFloat ? xp : xp.to(at::kFloat);
        if (w.int8_acts && !vnni) {
            const auto [levels, sx] = int8_levels(xf);
            xf = levels.mul_(sx);
        }
        y = at::empty({m, w.N}, xf.options());
        const int64_t step = passes ? VNNI_ROWS : std::max<int64_t>(m, 1);
        for (int64_t m0 = 0; m0 < m; m0 += step)
            q::linear(xf.const_data_ptr<float>() + m0 * w.K,
                      static_cast<int>(std::min(step, m - m0)), w,
                      y.mutable_data_ptr<float>() + m0 * w.N, at::get_num_threads());
    } else {  // chunks of the weight dequantized, each a GEMM in x's dtype (bf16: AMX's)
        const bool bf16 = x.scalar_type() == at::kBFloat16;
        const bool direct = bf16 && fast_dequant_all(w);  // bf16 chunks, no float32 pass
        const int64_t chunk =
            std::min<int64_t>(std::max<int64_t>(CHUNK_ELEMS / w.K, CHUNK_MIN_ROWS), w.N);
        if (chunk < w.N)
            y = at::empty({m, w.N}, xp.options());
        Tensor dense = at::empty({chunk, w.K}, xp.options().dtype(direct ? at::kBFloat16
                                                                          : at::kFloat));
        for (int64_t n0 = 0; n0 < w.N; n0 += chunk) {
            const int64_t rows = std::min(chunk, w.N - n0);
            Tensor d = dense.narrow(0, 0, rows);
            if (direct)
                q::dequantize_bf16(w, n0, rows,
                                   reinterpret_cast<uint16_t *>(d.mutable_data_ptr<at::BFloat16>()),
                                   at::get_num_threads());
            else
                q::dequantize(w, n0, rows, d.mutable_data_ptr<float>(), at::get_num_threads());
            const Tensor dt = bf16 && !direct ? d.to(at::kBFloat16) : d;
            // x as it is; float32 through oneDNN: ATen's mm takes MKL's sgemm, 2.2-2.5x
            // slower on an AMD Zen 5 (13-128 rows of a 6144 x 768 weight, one thread)
            Tensor part = bf16 ? at::mm(xp, dt.t()) : onednn_linear(xp, dt, std::nullopt);
            if (rows == w.N)  // one chunk: the product is y
                y = part;
            else
                y.narrow(1, n0, rows).copy_(part);
        }
        if (bias)
            y.add_(bias->to(y.scalar_type()));
        return y;
    }
    if (bias)
        y.add_(bias->to(at::kFloat));
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

Tensor gguf_rows(const Tensor &packed, const Tensor &ids, at::ScalarType dtype)
{
    const q::Weight w = parsed(packed);
    TORCH_CHECK(w.perm == nullptr, "gguf_rows: this packed copy permutes its columns "
                "(act-order), which an embedding's rows never do");
    TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
                    ids.is_contiguous(),
                "gguf_rows: ids must be a contiguous int64 [T]");
    const int64_t t = ids.size(0);
    Tensor out = at::empty({t, w.K}, at::TensorOptions().dtype(at::kFloat));
    const int64_t *id = ids.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < t; r++) {
        TORCH_CHECK(id[r] >= 0 && id[r] < w.N, "token id ", id[r], " is outside the vocabulary "
                    "[0, ", w.N, ")");
        q::dequantize(w, id[r], 1, out.mutable_data_ptr<float>() + r * w.K, 1);
    }
    return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace fleetllm

TORCH_LIBRARY_FRAGMENT(fleetllm, m)
{
    m.def("gguf_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
    m.def("gguf_rows(Tensor packed, Tensor ids, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(fleetllm, CPU, m)
{
    m.impl("gguf_linear", &fleetllm::gguf_linear);
    m.impl("gguf_rows", &fleetllm::gguf_rows);
}
