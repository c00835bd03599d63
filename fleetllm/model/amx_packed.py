"""A bf16 projection weight packed for AMX tiles, for the kernels' GEMM (csrc/gemm_amx.cpp).

What: [N, K] becomes [N/32, K/32, 2, 16, 32]: per panel of 32 outputs and block of 32 k, two
B tiles in the VNNI layout TDPBF16PS reads, a panel's blocks in k order (one stream a thread).
Why: on decode batches (1-64 rows) this runs faster than oneDNN's AMX matmul with the same
sums (equal bits up to 32 rows); from ~128 rows oneDNN's cache blocking wins and keeps its copy.
Where: AMX-BF16 CPUs (cpu_kernels.amx_available), bf16 weights with N and K multiples of 32:
the small-batch copy beside oneDNN's (layers.pack_linear_weights), in place of pair_packed.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fleetllm.kernels import cpu_kernels

MAX_ROWS = 64  # batches up to this many rows take this copy; larger ones oneDNN's


class AmxPacked(NamedTuple):
    data: torch.Tensor  # [N/32, K/32, 2, 16, 32] bfloat16
    out_features: int  # N

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def to_dense(self) -> torch.Tensor:
        """The [N, K] weight back."""
        p, kb = self.data.shape[:2]
        return (self.data.view(p, kb, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5)
                .reshape(p * 32, kb * 32).contiguous())


def applies(weight: torch.Tensor) -> bool:
    """This CPU's kernels run `weight` packed for AMX tiles."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0
            and cpu_kernels.amx_available())


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> AmxPacked:
    """weight [N, K] (out, in) in the kernel's layout, element (n, k) at [n // 32, k // 32,
    n % 32 // 16, k % 32 // 2, (n % 16) * 2 + k % 2]; into `out` (at least N * K * 2 uint8:
    a slice of layers.pack_linear_weights' huge-page arena) or new memory."""
    n, k = weight.shape
    shape = (n // 32, k // 32, 2, 16, 32)
    data = torch.empty(shape, dtype=weight.dtype) if out is None else \
        out[:n * k * weight.element_size()].view(weight.dtype).view(shape)
    data.view(n // 32, k // 32, 2, 16, 16, 2).copy_(
        weight.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5))
    return AmxPacked(data, n)


def matmul(x: torch.Tensor, packed: AmxPacked, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) with W packed for AMX tiles."""
    return cpu_kernels.gemm_amx(x.contiguous(), packed.data, bias, packed.out_features)
