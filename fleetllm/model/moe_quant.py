"""A mixture-of-experts layer's quantized experts (a GGUF file's ffn_{gate,up,down}_exps): one
uint8 buffer of packed copies, and the C++ op that runs them.

What: `pack_experts` turns each expert's gate, up and down blocks (quant/packed.QuantTensor:
this rank's rows of gate and up, its blocks of down's columns) into 2E packed copies in one
buffer (quant/packed.py's format: copy 2e expert e's gate rows then up rows, copy 2e + 1 its
down), with `bounds` int64 [2E + 1] (copy j is bytes bounds[j]..bounds[j + 1]); nothing is
dequantized. FusedExperts (moe_experts.py) keeps them in place of its dense w13 / w2.
How: `cpu_quant_experts` is the C++ op gguf_fused_moe (csrc/moe_quant.cpp: pairs grouped by
expert, q::linear's quantized GEMV, no Python loop over experts); without the kernels,
moe_experts.torch_quant_experts dequantizes the picked experts' copies at each call (also
the op's reference in tests/moe/test_moe_gguf.py). Both round each expert's output to x's
dtype, then add in ascending expert order as the bf16 op does.
What fails: experts whose parts differ in columns (a file whose gate and up disagree) are a
ValueError from pack, which the loader reports as a ModelLoadError naming the layer.
"""

from __future__ import annotations

import torch

from fleetllm.kernels import cpu_kernels
from fleetllm.quant.packed import QuantTensor, pack


def pack_experts(parts: list[tuple[QuantTensor, QuantTensor, QuantTensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, bounds) of each expert's (gate, up, down) blocks, expert order; every copy
    starts 64-byte aligned (pack pads each copy to a multiple of 64 bytes)."""
    copies = []
    for gate, up, down in parts:
        copies.append(pack([gate, up]))
        copies.append(pack([down]))
    sizes = torch.tensor([0] + [c.numel() for c in copies], dtype=torch.int64)
    bounds = torch.cumsum(sizes, 0)
    packed = torch.empty(int(bounds[-1]), dtype=torch.uint8)
    for j, c in enumerate(copies):
        packed[int(bounds[j]):int(bounds[j + 1])].copy_(c)
    return packed, bounds


def cpu_quant_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      packed: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.gguf_fused_moe(x.contiguous(), ids.contiguous(),
                                      weights.contiguous(), packed, bounds)
