"""The LoRA delta of a projection, for a whole batch mixing adapters and the base model.

Each adapted projection (the merged q/k/v and gate/up column-parallel ones, o and down
row-parallel) carries a `LoRASlots`: stacked weights for `max_loras` device slots,
A [in, slots, parts, R] and per part B [slots, R, out_part] (R = max_lora_rank, zero-padded;
an empty slot or an untargeted part is zeros; B holds the adapter's scaling). A step whose
batch has adapter rows sets `LoRAStep` (per token: a one-hot of its slot over the first m
slots, all zeros for a base-model row); then after the base projection, computed once for
the batch,

    xa = x @ A[:, :m]          one GEMM for every slot in use: [T, m * parts * R]
    xa *= onehot               each row keeps its own adapter's block; base rows become 0
    y[:, part] += xa[:, :, part] @ B_part[:m]    one GEMM per part

so the Python work per layer is a few tensor calls whatever the mix of requests (no loop
over requests or adapters). The wasted work is the other slots' products, at most
(m - 1) * R * (parts * in + out) multiply-adds per token; the measured alternatives (a
gather of each token's weights, a loop over adapter groups with index_add) are in
docs/lora.md. Tensor parallel: a column-parallel projection keeps all of A and its rows of B;
a row-parallel one its input columns of A and all of B, and its delta is added to the partial
sum before the all-reduce (sum over ranks of x_r A_r B = x A B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAStep:
    """This step's adapter rows: onehot [tokens, m] in the adapters' dtype (m: slots in use,
    the highest slot + 1)."""

    onehot: torch.Tensor
    m: int


_STEP: LoRAStep | None = None


def set_step(step: LoRAStep | None) -> None:
    """The model runner sets the step's rows before the forward and clears them after."""
    global _STEP
    _STEP = step


def active() -> bool:
    """Does this step have adapter rows (the fused small-batch layer does not apply)?"""
    return _STEP is not None


class LoRASlots:
    """The device slots of one projection: see the module docstring."""

    def __init__(self, in_size: int, part_sizes: list[int], slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.in_size, self.rank, self.dtype = in_size, rank, dtype
        self.part_sizes = part_sizes
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        n = len(part_sizes)
        self.a = torch.zeros(in_size, slots, n, rank, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, rank, size, dtype=dtype, device=device)
                  for size in part_sizes]

    def set(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill a slot: per part (A^T [in, r], B^T scaled [r, out_part]) or None (zeros)."""
        self.clear(slot)
        for p, ab in enumerate(parts):
            if ab is not None:
                a, b = ab
                r = a.shape[1]
                self.a[:, slot, p, :r].copy_(a)
                self.b[p][slot, :r].copy_(b)

    def clear(self, slot: int) -> None:
        self.a[:, slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x, [T, out]) plus each row's adapter delta, in place."""
        step = _STEP
        t, m, n, r = x.shape[0], step.m, len(self.b), self.rank
        xl = x if x.dtype == self.dtype else x.to(self.dtype)
        xa = xl @ self.a.view(self.in_size, -1)[:, :m * n * r]
        xa = xa.view(t, m, n, r).mul_(step.onehot.view(t, m, 1, 1))
        same = y.dtype == self.dtype
        for p, (b, off, size) in enumerate(zip(self.b, self.offsets, self.part_sizes,
                                               strict=True)):
            xp = xa.view(t, m * r) if n == 1 else xa[:, :, p].reshape(t, m * r)
            bp = b.view(-1, size)[:m * r]
            out = y if n == 1 else y[:, off:off + size]
            if same:
                out.addmm_(xp, bp)
            else:
                out.add_((xp @ bp).to(y.dtype))
        return y


def lora_delta(layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The projection's output with this step's adapter deltas (none: y as it is)."""
    slots = getattr(layer, "lora", None)
    if _STEP is None or slots is None:
        return y
    return slots.apply(x, y)
