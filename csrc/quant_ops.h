// The quantized projections' ops (quant_ops.cpp), also called by ops.cpp's one-call decode
// paths for LinearKind GGUF: a projection's packed copy (quant.h) is a 1-D uint8 tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace fleetllm {

// x [M, K] (float32 or bfloat16, contiguous) @ w^T (+ bias) in x's dtype, float32 sums.
at::Tensor gguf_linear(const at::Tensor &x, const at::Tensor &packed,
                       const std::optional<at::Tensor> &bias);

// The rows of a packed copy at `ids` (int64 [T]; an embedding's lookup) as `dtype` [T, K].
at::Tensor gguf_rows(const at::Tensor &packed, const at::Tensor &ids, at::ScalarType dtype);

// x @ w^T (+ b) by oneDNN's matmul (mkldnn::_linear_pointwise; w dense or oneDNN's packed
// copy): ops.cpp's packed projections and LM head, and a dequantized chunk's GEMM in float32.
at::Tensor onednn_linear(const at::Tensor &x, const at::Tensor &w,
                         const std::optional<at::Tensor> &b);

// Whether t is a packed copy (1-D uint8), and its (in, out) features (K, N): its header
// parsed and checked once.
bool is_gguf_packed(const at::Tensor &t);
std::pair<int64_t, int64_t> gguf_features(const at::Tensor &packed);

}  // namespace fleetllm
