"""Which LinearKernel (linear_kernels.py) each projection and the LM head gets: decided once,
after loading (`select_kernels`), from the CPU, the weights' dtype and sizes, and two budgets.

The dense weights stay for the GEMV while the projections weigh at most
FLEETLLM_GEMV_MAX_BYTES (Gemv, then MKL's float32 packing on Intel or oneDNN's); bf16 weights
are packed by pairs where the CPU has the kernels and the dense ones would not stay (AVX2) or
oneDNN packs bf16 (AVX-512), and on AMX CPUs they are the small batches' copy (Amx where the
sizes suit the tiles) beside oneDNN's, within a quarter of memory. The copies by pairs share
one huge-page arena. FLEETLLM_LINEAR=dense or =packed forces one side; FLEETLLM_BATCH_INVARIANT
keeps only the kernels' own copy.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm import envs
from fleetllm.kernels import cpu_kernels
from fleetllm.model import huge_pages
from fleetllm.model import linear_kernels as lk
from fleetllm.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from fleetllm.model.moe_experts import FusedExperts

logger = logging.getLogger(__name__)


def select_kernels(model: nn.Module) -> int:
    """Set `module.kernel` on every projection and the LM head; where a packed copy replaces
    the dense weight, `module.weight` becomes None (unless the embedding shares it). Returns
    the number of modules packed (0: none, the model unchanged but for TorchLinear/Gemv)."""
    linears, shared, packable, keep_dense, by_pairs = _plan(model)
    for module in model.modules():  # a mixture of experts' stacked weights: C++ op or PyTorch
        if isinstance(module, FusedExperts):
            module.choose_kernel()
    # A GGUF model's unquantized projections keep their dense weights: the one-call decode
    # paths read them beside the quantized ones (LinearKind.GGUF).
    gguf = any(isinstance(m.kernel, lk.Gguf) for m in linears)
    packed = _pack(linears, keep_dense, by_pairs) if packable and not gguf else {}
    for module in linears:
        weight = module.weight
        if weight is None:
            continue
        kernel = packed.get(module)
        if kernel is None:
            kernel = lk.TorchLinear(module)
        elif not keep_dense and id(weight) not in shared:
            module.weight = None  # the packed copy replaces it
        own_copy = isinstance(kernel, lk.Pairs | lk.Amx | lk.SmallBatches)  # every row count
        if module.weight is not None and not own_copy and cpu_kernels.usable(weight):
            head = isinstance(module, ParallelLMHead)
            kernel = lk.Gemv(weight, kernel, *lk.gemv_limits(kernel, head))
        module.kernel = kernel
    return len(packed)


def dense_weights_kept(model: nn.Module) -> bool:
    """Whether the projections' dense weights stay after select_kernels; computable before
    loading, from the shapes alone (huge_pages places them then)."""
    _, _, packable, keep_dense, _ = _plan(model)
    return keep_dense or not packable


def _pack(linears: list[nn.Module], keep_dense: bool, by_pairs: bool
          ) -> dict[nn.Module, lk.LinearKernel]:
    """Each packable module's packed kernel, each copy checked against F.linear on a few rows;
    a failure stops packing there (the rest keep F.linear), with a warning."""
    pairs = [m.weight for m in linears if m.weight is not None and _can_pack(m.weight)
             and lk.Pairs.applies(m.weight)] if by_pairs else []
    invariant = lk.batch_invariant()
    amx = bool(pairs) and lk.onednn_amx() and not invariant  # beside oneDNN's
    if amx and sum(map(lk.Pairs.size, pairs)) > _pairs_budget():
        pairs = []  # oneDNN's alone: 16-30% slower at one row, the same from two
    arena = huge_pages.empty(sum(map(lk.Pairs.size, pairs))) if pairs else None
    by_pairs_ids = {id(w) for w in pairs}
    offset = 0
    out: dict[nn.Module, lk.LinearKernel] = {}
    for module in linears:
        weight = module.weight
        if weight is None or not _can_pack(weight):
            continue
        try:
            small = None
            if id(weight) in by_pairs_ids:
                size = lk.Pairs.size(weight)
                layout = lk.Amx if (amx or invariant) and lk.Amx.applies(weight) else lk.Pairs
                small = layout.pack(weight.detach(), arena[offset:offset + size])
                offset += size
            if small is not None and not amx:
                kernel: lk.LinearKernel = small
            elif keep_dense and lk.Mkl.applies(weight):  # MKL's has no way back to dense
                kernel = lk.Mkl(weight.detach())
            else:
                kernel = lk.OneDnn(weight.detach())
                if small is not None:
                    kernel = lk.SmallBatches(small, kernel)
            _check(kernel, weight)
        except (RuntimeError, AssertionError) as e:
            logger.warning("oneDNN weight packing unavailable (%s): plain F.linear", e)
            return out
        out[module] = kernel
    return out


def _check(kernel: lk.LinearKernel, weight: torch.Tensor) -> None:
    probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.dtype)
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16: output rounding
    want = F.linear(probe, weight).float()
    for copy in kernel.copies():
        got = copy(probe).float()
        # not torch.testing.assert_close: it imports torch.distributed.tensor (~1 s)
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            err = (got - want).abs().max().item()
            raise AssertionError(f"packed copy differs from F.linear by {err:.3g}")


def _can_pack(weight: torch.Tensor) -> bool:
    if envs.get("FLEETLLM_LINEAR") == "dense":
        return False
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def _plan(model: nn.Module) -> tuple[list[nn.Module], set[int], bool, bool, bool]:
    """The projections (and LM head), the ids of weights the embedding shares, whether any
    can be packed, whether the dense weights stay beside the packed copies, and whether the
    bf16 ones are packed by pairs."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)
              and not isinstance(m, ParallelLMHead)}
    linears = [m for m in model.modules()
               if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead)]
    # What keeping the dense weights costs: a tied LM head's is the embedding's, kept anyway.
    dense_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears
                      if m.weight is not None and id(m.weight) not in shared)
    dense_ok = envs.get("FLEETLLM_LINEAR") == "auto" and cpu_kernels.available() \
        and dense_bytes <= _dense_budget()
    # Pairs serve every number of rows: no dense copy then. Where oneDNN packs no bf16 (AVX2),
    # its float32 copy plus the dense weight for the GEMV were the faster pair, so pairs take
    # over there only where the dense weights would not stay.
    by_pairs = any(m.weight is not None and lk.Pairs.applies(m.weight) for m in linears) \
        and (not dense_ok or lk.onednn_packs_bf16() or lk.batch_invariant())
    keep_dense = dense_ok and not by_pairs
    packable = any(m.weight is not None and _can_pack(m.weight) for m in linears)
    return linears, shared, packable, keep_dense, by_pairs


def _dense_budget() -> int:
    """The most bytes of projections that keep their dense weight beside a packed copy."""
    budget = envs.get("FLEETLLM_GEMV_MAX_BYTES")
    return 2 << 30 if budget is None else budget


def _pairs_budget() -> int:
    """The same for the copies by pairs beside oneDNN's on AMX: FLEETLLM_GEMV_MAX_BYTES if
    set, else a quarter of the machine's memory (at least 2 GiB)."""
    if envs.get("FLEETLLM_GEMV_MAX_BYTES") is not None:
        return _dense_budget()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return max(2 << 30, memory // 4)
