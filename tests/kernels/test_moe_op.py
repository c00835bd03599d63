"""The fused MoE op (csrc/moe.cpp) against the PyTorch path (moe_experts.torch_experts), and
the PyTorch path against transformers' own experts loop."""

from __future__ import annotations

import pytest
import torch

from fleetllm.kernels import cpu_kernels
from fleetllm.model.moe_experts import torch_experts

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="the CPU kernels are not built here")


def _case(tokens: int, experts: int, hidden: int, inter: int, k: int, dtype: torch.dtype,
          seed: int, unpicked: int = 0):
    """Random inputs; the last `unpicked` experts are picked by no token and hold NaN, so
    reading them would show in the output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    w13[experts - unpicked:] = float("nan")
    w2[experts - unpicked:] = float("nan")
    ids = torch.stack([torch.randperm(experts - unpicked, generator=g)[:k]
                       for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    return x, ids, weights, w13, w2


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,hidden,inter,k", [
    (1, 8, 64, 32, 2),       # a decode step: one row per expert
    (1, 16, 96, 48, 8),      # top-8, odd multiples of the GEMV's tiles
    (5, 5, 64, 40, 4),       # every expert (but the NaN one) picked by several rows
    (37, 32, 128, 64, 3),    # a prompt: many experts, shared among the threads
    (200, 8, 48, 24, 2),     # many rows per expert: ATen's matmul
])
def test_op_matches_pytorch_path(dtype, tokens, experts, hidden, inter, k):
    x, ids, weights, w13, w2 = _case(tokens, experts, hidden, inter, k, dtype, seed=tokens,
                                     unpicked=1)
    got = cpu_kernels.fused_moe(x, ids, weights, w13, w2)
    want = torch_experts(x, ids, weights, w13, w2)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert torch.isfinite(got).all()  # the unpicked expert's NaN weights were never read
    # float32: sums in another order; bf16: identical (each product and add rounded alike)
    # except where the GEMV's float32 sums round the other way: a few ulps on a few values
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_mixes_matmul_and_gemv_experts(dtype):
    """Every token picks expert 0 (40 rows: ATen's matmul) and one other (a few rows each: the
    GEMV kernel); the NaN expert is picked by nobody."""
    x, ids, weights, w13, w2 = _case(40, 12, 64, 32, 2, dtype, seed=7, unpicked=1)
    ids[:, 0] = 0
    ids[:, 1] = 1 + torch.arange(40) % 10
    got = cpu_kernels.fused_moe(x, ids, weights, w13, w2)
    want = torch_experts(x, ids, weights, w13, w2)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernels
def test_op_with_no_tokens_and_bad_arguments():
    x, ids, weights, w13, w2 = _case(3, 4, 32, 16, 2, torch.float32, seed=0)
    assert cpu_kernels.fused_moe(x[:0], ids[:0], weights[:0], w13, w2).shape == (0, 32)
    with pytest.raises(RuntimeError, match="expert ids"):
        cpu_kernels.fused_moe(x, ids + 4, weights, w13, w2)
    with pytest.raises(RuntimeError, match="w13"):
        cpu_kernels.fused_moe(x, ids, weights, w13[:, :8], w2)
    with pytest.raises(RuntimeError, match="weights"):
        cpu_kernels.fused_moe(x, ids, weights.double(), w13, w2)
    with pytest.raises(RuntimeError, match="bfloat16|float32|w2"):
        cpu_kernels.fused_moe(x, ids, weights, w13, w2.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pytorch_path_matches_transformers_experts(dtype):
    """The reference itself: transformers' Qwen3MoeExperts on the same stacked weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    x, ids, weights, w13, w2 = _case(9, 8, 64, 32, 2, dtype, seed=3)
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8)
    hf = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        want = hf(x, ids, weights)  # float32 weights: Mixtral's form
    # The same order of operations; in float32 the matmuls' own blocking may still differ in
    # the last bit (MKL's sgemm on an AMD Zen 5: 1.2e-7 apart), so float32 is allowed that.
    exact = dtype == torch.bfloat16
    torch.testing.assert_close(torch_experts(x, ids, weights, w13, w2), want,
                               rtol=0 if exact else 2e-6, atol=0 if exact else 5e-7)
