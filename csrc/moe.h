// The fused mixture-of-experts op (moe.cpp), registered by ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fleetllm {

// out[t] = sum over j of weights[t, j] * expert(ids[t, j], x[t]), where expert(e, x) =
// (silu(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T)) @ w2[e]^T. x [T, H] and out in float32 or
// bfloat16; w13 [E, 2I, H] and w2 [E, H, I] of x's dtype; ids int64 [T, k] in [0, E);
// weights float32 [T, k]. Experts no row picked are never read.
at::Tensor fused_moe(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights,
                     const at::Tensor &w13, const at::Tensor &w2);

// A step's (token, slot) pairs grouped by expert, a stable counting sort (moe.cpp's and
// moe_quant.cpp's ops): expert e's counts[e] pairs are rows [row_start[e], row_start[e + 1])
// in token order, pair p is row pair_row[p], and active lists the experts some pair picked.
struct ExpertGroups {
    std::vector<int> counts, active;
    std::vector<long> row_start, pair_row;
    ExpertGroups(const int64_t *id, long pairs, int E)
        : counts(E, 0), row_start(E + 1, 0), pair_row(pairs)
    {
        for (long p = 0; p < pairs; p++) counts[id[p]]++;
        std::vector<long> next(E);
        for (int e = 0; e < E; e++) {
            row_start[e + 1] = row_start[e] + counts[e];
            next[e] = row_start[e];
            if (counts[e]) active.push_back(e);
        }
        for (long p = 0; p < pairs; p++) pair_row[p] = next[id[p]]++;
    }
};

}  // namespace fleetllm
