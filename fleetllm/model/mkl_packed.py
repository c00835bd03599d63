"""A float32 projection weight packed for MKL's sgemm (csrc/mkl_sgemm.cpp).

What: MKL's opaque layout (`cblas_sgemm_pack`), multiplied by `cblas_sgemm_compute` at any
number of rows, with the MKL that torch links on x86. Why: on Intel CPUs it is faster than
oneDNN's packed matmul for float32 and gives F.linear's bits for most shapes; on AMD it is
slower, so it applies on Intel only (cpu_kernels.mkl_available). MKL cannot unpack, so a
projection gets it only where its dense weight stays anyway (the GEMV's); elsewhere oneDNN's
packing serves (sharded_state can unpack that). MKL reserves more than the weight's bytes but
touches only about the weight's size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fleetllm.kernels import cpu_kernels


class MklPacked(NamedTuple):
    data: torch.Tensor  # uint8: MKL's packed buffer
    out_features: int  # N
    in_features: int  # K

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def nbytes(self) -> int:
        """The memory it takes: what MKL writes of its buffer, the weight's float32 bytes
        (resident 1.00-1.05x them on the 125M and test shapes; the rest is never touched)."""
        return self.out_features * self.in_features * 4


def applies(weight: torch.Tensor) -> bool:
    """This CPU multiplies `weight` by MKL's packed sgemm."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and cpu_kernels.mkl_available())


def pack(weight: torch.Tensor) -> MklPacked:
    return MklPacked(cpu_kernels.mkl_pack(weight.contiguous()), *weight.shape)


def matmul(x: torch.Tensor, packed: MklPacked, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias), as F.linear computes it."""
    return cpu_kernels.mkl_linear(x.contiguous(), packed.data, bias, packed.out_features)
