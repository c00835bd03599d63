"""A float32 projection weight packed for MKL's sgemm (csrc/mkl_sgemm.cpp).

What: MKL's own layout of the weight (`cblas_sgemm_pack`, opaque bytes), multiplied by
`cblas_sgemm_compute` at any number of rows: MKL is the one torch links on x86 (libtorch_cpu).

Why: on Intel CPUs MKL's packed sgemm runs the float32 projections 1.05-1.18x as fast as
oneDNN's packed matmul at 16-2,048 rows on a 2-core Ice Lake Xeon (1.07-1.23x at 64-2,048
rows on the AMX Xeon; `tools/fp32_gemm_ab.py`, docs/perf.md item 36), and its products are
F.linear's bits for most shapes (what transformers runs) where oneDNN's differ in the last
bits. On AMD CPUs MKL is 2-4x slower than oneDNN (a Zen 5, item 32): it applies to Intel
CPUs only (cpu_kernels.mkl_available). MKL has no way back to the dense weight, so a
projection gets this copy only where its dense weight stays anyway (the GEMV's, for small
decode batches: layers.pack_linear_weights); elsewhere oneDNN's packing (which can be
unpacked, for sharded_state) serves as before. MKL asks 1.6-4.9x the weight's bytes for the
buffer but writes 1.00-1.05x the weight's bytes of it (resident memory measured after
packing): the rest is never touched, so never in memory.
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
