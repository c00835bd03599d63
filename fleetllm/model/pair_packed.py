"""A bf16 projection weight packed by pairs for the kernels' GEMM (csrc/gemm.cpp).

What: [N, K] becomes [ceil(N/48), K/2, 48, 2] (zero rows past N): panels of 48 outputs whose
k-pairs lie in the order the kernel reads them (one vdpbf16ps per 16 outputs; FMAs on widened
pairs without AVX-512 BF16, 8-float FMAs on AVX2: csrc/gemm_avx2.h), so a thread's panels are
one stream. Each output is one lane summed in k order: a row's bits do not depend on its batch.
Where: AVX-512 CPUs replace oneDNN's copy and the GEMV with it at every row count; AVX2 CPUs
use it only where the dense weights would not be kept; on AMX CPUs it is the small-batch copy
(up to SMALL_ROWS rows) beside oneDNN's, unless amx_packed.py applies (layers._packing_plan).
It does not apply to float32 weights, an odd K, or CPUs without AVX2: oneDNN packs them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fleetllm import envs
from fleetllm.kernels import cpu_kernels

PANEL = 48  # outputs a panel: the kernel's 3 vectors of 16 (csrc/kernels.h, PAIR_PANEL)
SMALL_ROWS = 4  # beside oneDNN on AMX: batches up to this many rows take this copy


class PairPacked(NamedTuple):
    data: torch.Tensor  # [ceil(N/48), K/2, 48, 2] bfloat16
    out_features: int  # N

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def to_dense(self) -> torch.Tensor:
        """The [N, K] weight back."""
        panels, pairs = self.data.shape[:2]
        dense = self.data.permute(0, 2, 1, 3).reshape(panels * PANEL, pairs * 2)
        return dense[:self.out_features].contiguous()


def applies(weight: torch.Tensor) -> bool:
    """This CPU's kernels run `weight` packed by pairs."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and cpu_kernels.gemm_pairs_available())


def batch_invariant() -> bool:
    """FLEETLLM_BATCH_INVARIANT=1: bf16 projections read only this copy, at every number of
    rows (no GEMV, no oneDNN copy, no AMX copy beside it), so a row's outputs are the same bits
    in any batch (as vLLM's VLLM_BATCH_INVARIANT). By default AVX2-only CPUs switch from the
    GEMV to oneDNN's float32 copy past 16 rows and AMX CPUs to oneDNN past the small batches'
    copy, whose sums round differently (docs/spec_decode.md, "bf16")."""
    return envs.get("FLEETLLM_BATCH_INVARIANT")


@functools.cache
def onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 weights on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): else
    layers._pack gives a bf16 weight a float32 copy."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except (RuntimeError, AttributeError):
        return False
    return True


@functools.cache
def onednn_amx() -> bool:
    """oneDNN's bf16 matmul runs on AMX tiles on this CPU (torch enables them at start)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init is not None and init() and torch.backends.mkldnn.is_available())


def nbytes(weight: torch.Tensor) -> int:
    """The bytes of weight's packed copy."""
    n, k = weight.shape
    return -(-n // PANEL) * PANEL * k * weight.element_size()


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> PairPacked:
    """weight [N, K] packed by pairs, into `out` (nbytes(weight) uint8: a slice of the
    huge-page arena layers.pack_linear_weights gives every projection) or new memory."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    panels = F.pad(weight, (0, 0, 0, padded - n)).view(padded // PANEL, PANEL, k // 2, 2)
    shape = (padded // PANEL, k // 2, PANEL, 2)
    data = torch.empty(shape, dtype=weight.dtype) if out is None else \
        out.view(weight.dtype).view(shape)
    data.copy_(panels.permute(0, 2, 1, 3))
    return PairPacked(data, n)


def matmul(x: torch.Tensor, packed: PairPacked, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias)."""
    return cpu_kernels.gemm_pairs(x.contiguous(), packed.data, bias, packed.out_features)
