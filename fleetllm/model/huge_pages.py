"""CPU memory for the weights and the KV cache in transparent huge pages (2 MiB, Linux THP).

Why: a decode step streams every weight and reads scattered KV blocks; with 4 KiB pages that
is a TLB miss every page (two page-table walks in a VM), and glibc's malloc gives huge pages
only where THP is "always", while most machines ship "madvise".
How: one anonymous mapping per tensor group (mmap), advised MADV_HUGEPAGE before it is touched,
made a tensor with torch.frombuffer; the tensors placed in it are views that keep the mapping
alive until the last goes. Without free huge pages the kernel gives ordinary ones.
Off with FLEETLLM_HUGE_PAGES=0; nothing changes where THP is "never" or absent (not Linux).
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import nn

from fleetllm import envs

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start in a shared mapping: a cache line, as torch's allocator


def thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise" or "never"); "" where it has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.partition("[")[2].partition("]")[0]


def enabled() -> bool:
    """Huge-page placement applies here: not turned off, and the kernel has THP on."""
    if not envs.get("FLEETLLM_HUGE_PAGES") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return thp_mode() in ("always", "madvise")


def _mapping(nbytes: int) -> torch.Tensor | None:
    """nbytes of fresh zeroed memory advised MADV_HUGEPAGE, as a uint8 tensor starting on a
    huge-page boundary; None if the kernel refuses the mapping or the advice (the caller then
    allocates as before, and fails as before if memory is short). The mapping covers whole
    huge pages from that boundary on (the kernel gives one only where 2 aligned MiB are
    mapped), so the last one is huge too: at most 2 MiB more than asked for."""
    whole_pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        mm = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        mm.close()
        return None
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def place_parameters(model: nn.Module) -> int:
    """Give the model's CPU parameters storage in one huge-page mapping, in the order the
    model registers them (a layer's weights together). Their values are NOT kept: call it
    between building the model and loading its weights (every loader copies into the
    parameters in place). Returns the bytes placed; 0 when enabled() is false."""
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel()]
    if not params or not enabled():
        return 0
    sizes = [p.numel() * p.element_size() for p in params]
    spans = [-(-n // _ALIGN) * _ALIGN for n in sizes]  # each rounded up to the next start
    arena = _mapping(sum(spans))
    if arena is None:
        return 0
    offset = 0
    for param, n, span in zip(params, sizes, spans, strict=True):
        param.data = arena[offset:offset + n].view(param.dtype).view(param.shape)
        offset += span
    return offset


def empty(nbytes: int) -> torch.Tensor:
    """nbytes of CPU memory (uint8), in its own huge-page mapping where enabled() and at least
    one huge page (zeroed, untouched: taken as it is written), else torch.empty's."""
    memory = _mapping(nbytes) if nbytes >= HUGE_PAGE and enabled() else None
    return torch.empty(nbytes, dtype=torch.uint8) if memory is None else memory


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in its own huge-page mapping where
    enabled() and it is at least one huge page. Written once here, so the memory is taken now,
    as torch.zeros takes it (a step does not fault pages in)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = _mapping(nbytes) if nbytes >= HUGE_PAGE and enabled() else None
    if memory is None:
        return torch.zeros(shape, dtype=dtype)
    return memory.view(dtype).view(shape).zero_()
