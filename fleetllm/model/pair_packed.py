"""A bf16 projection weight packed by pairs for the kernels' GEMM (csrc/gemm.cpp).

What: [N, K] becomes [ceil(N/48), K/2, 48, 2] (zero rows past N): panels of 48 outputs, each
pair of k's 48 x 2 weights as 3 64-byte vectors of 16 outputs, which one AVX-512 BF16 dot
product (vdpbf16ps) each multiplies by a row of x's pair broadcast to all lanes. The kernel
keeps 8 rows x 48 outputs of sums in registers, so it needs no horizontal sums and reads 11
vectors per 24 dot products. A panel's pairs lie in the order it reads them, so a thread's run
of panels is one sequential stream. The layout before, 16-output blocks one after another
(a panel's three vectors 24 KiB apart at K = 768, three streams a thread), was 2-17% slower
on decode batches of 1-32 rows, most where the memory is fastest (docs/perf.md, item 26).

Why: decode batches past the GEMV's 8 rows ran oneDNN's packed bf16 matmul at ~60% of the
two cores' dot-product peak; this layout's kernel runs them 1.05-1.35x faster, matches oneDNN
on prompts and the GEMV at 1-8 rows (docs/perf.md, item 24), so on CPUs with AVX-512 it
replaces oneDNN's packed copy and the GEMV at every number of rows, and the dense weight goes
(layers.pack_linear_weights): half the memory the projections took with the two copies.
Its bits do not depend on the rows beside a row (each output one lane, k in order), unlike
oneDNN's: a sequence gets the same logits in any batch.

On AVX-512 CPUs without AVX-512 BF16 (Ice Lake, Cascade Lake) the kernel makes the same sums
with FMAs on the pairs widened in registers (csrc/gemm.cpp, micro_fma): there oneDNN's bf16
matmul has no bf16 instruction either and ran prompts at 60 GFLOP/s against this kernel's 203
on a 2-core Ice Lake Xeon (docs/perf.md, item 35). CPUs with AVX2 and no AVX-512 (Zen 2/3,
Haswell to Comet Lake) make the same sums by FMAs on 8-float vectors (csrc/gemm_avx2.h). There
oneDNN packs no bf16 at all, and a bf16 model otherwise keeps a float32 copy of each projection
for oneDNN (4 bytes a parameter) beside the dense bf16 weight for the GEMV: still the faster
pair on a 2-core Zen 3 (prompts ~1.2x, decode steps of 2-8 rows 1.2-1.4x), so this copy takes
over only where the dense weights would not be kept (layers._packing_plan), from the float32
copy alone: half the memory, and half the bytes every decode step reads (docs/perf.md, item
38). Where it does not apply (no AVX2, an odd K, float32 weights), layers._pack keeps oneDNN's
packing.

Where oneDNN's bf16 matmul runs on AMX tiles (Intel Sapphire Rapids and later), it is 2-8x this
kernel's rate from 12 rows up (1,580 against 196 GFLOP/s at 256 rows on the 125M preset's
projections, 2 cores) and equal at 2-8 rows, where both stream the weight; at one row this
kernel is faster (the 125M projections 16%, a 1B-shaped model's batch-1 decode 1.5x). There a
projection keeps both copies: oneDNN's packed weight, and this one for batches of up to
SMALL_ROWS rows (layers.pack_linear_weights; docs/perf.md, item 29); unless its sizes suit the
kernels' own GEMM on AMX tiles (amx_packed.py, faster still up to 64 rows), whose copy then
takes this one's place.
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
