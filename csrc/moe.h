// The fused mixture-of-experts op (moe.cpp), registered by ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

namespace fleetllm {

// out[t] = sum over j of weights[t, j] * expert(ids[t, j], x[t]), where expert(e, x) =
// (silu(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T)) @ w2[e]^T. x [T, H] and out in float32 or
// bfloat16; w13 [E, 2I, H] and w2 [E, H, I] of x's dtype; ids int64 [T, k] in [0, E);
// weights float32 [T, k]. Experts no row picked are never read.
at::Tensor fused_moe(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights,
                     const at::Tensor &w13, const at::Tensor &w2);

}  // namespace fleetllm
