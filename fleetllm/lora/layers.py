"""The LoRA delta of a projection, for a whole batch mixing adapters and the base model.

Each adapted projection carries `LoRASlots`: A [slots, in, parts * R] and per merged part
B [slots, R, out_part] for `max_loras` device slots (zero-padded to R = max_lora_rank; B holds
the scaling). A step with adapter rows sets `LoRAStep` (its adapter tokens grouped by slot, m
groups padded to L). After the base projection each layer adds
    y.index_add_(gather, bmm(bmm(x[gather] * pad, A[slots]), B[slots]))   per part
a fixed handful of calls whatever the mix, base rows untouched; groups too uneven
(MAX_PADDING) run per group instead. docs/lora.md compares the alternatives.
Tensor parallel: column-parallel keeps all of A and its columns of B; row-parallel its rows of
A and all of B, the delta joining the partial sum before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetllm import envs

# Padding the groups to the longest costs its waste in products; past this share the
# per-group GEMMs (a loop over the step's adapters, not its requests) are faster.
MAX_PADDING = 0.25


@dataclass
class LoRAStep:
    """This step's adapter rows, grouped by slot. Padded (groups of about one size, as a
    decode step of an even mix): `gather` [m * L] the token of each group position (pads
    repeat a row of the group), `pad` [m * L, 1] zeros at the pads (None: no pads), `slots`
    [m] the groups' slots (None: slots 0..m-1, a view, no copy). Segments (uneven groups, as
    prefill chunks): `gather` the adapter tokens sorted by slot and `segments` each group's
    (slot, start, end) in it."""

    gather: torch.Tensor
    pad: torch.Tensor | None
    slots: torch.Tensor | None
    m: int
    length: int
    segments: list[tuple[int, int, int]] | None = None
    # Every token runs one adapter (in this slot): no gather, no index_add, GEMMs into y.
    only_slot: int | None = None

    @classmethod
    def build(cls, token_slots: list[int], dtype: torch.dtype, device: torch.device
              ) -> LoRAStep:
        groups: dict[int, list[int]] = {}
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(token)
        order = sorted(groups)
        length = max(len(g) for g in groups.values())
        rows = sum(len(g) for g in groups.values())
        if len(order) == 1 and rows == len(token_slots):
            return cls(torch.empty(0, dtype=torch.long), None, None, 1, rows,
                       only_slot=order[0])
        if len(order) * length > (1 + MAX_PADDING) * rows:
            gather, segments = [], []
            for slot in order:
                segments.append((slot, len(gather), len(gather) + len(groups[slot])))
                gather += groups[slot]
            return cls(torch.tensor(gather, device=device), None, None, len(order), 0,
                       segments)
        gather, pad = [], []
        for slot in order:
            group = groups[slot]
            gather += group + [group[0]] * (length - len(group))
            pad += [1.0] * len(group) + [0.0] * (length - len(group))
        prefix = order == list(range(len(order)))
        return cls(torch.tensor(gather, device=device),
                   torch.tensor(pad, dtype=dtype, device=device)[:, None]
                   if len(pad) != rows else None,
                   None if prefix else torch.tensor(order, device=device), len(order), length)


_STEP: LoRAStep | None = None
# The deltas' products are small (rank 16 wide): with torch's threads each is a parallel
# region whose barrier waits for a second thread that, on a shared or busy machine, may not
# be running; one thread measured faster end to end (bench throughput --lora 8 on 2 shared
# cores: 0.81x base-only instead of 0.64x). FLEETLLM_LORA_ONE_THREAD=0 keeps torch's threads.
_ONE_THREAD = envs.get("FLEETLLM_LORA_ONE_THREAD")


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
        self.a = torch.zeros(slots, in_size, len(part_sizes) * rank, dtype=dtype,
                             device=device)
        # One B per part, not one block-diagonal B: a third of the products for q/k/v.
        self.b = [torch.zeros(slots, rank, size, dtype=dtype, device=device)
                  for size in part_sizes]

    def set(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill a slot: per part (A^T [in, r], B^T scaled [r, out_part]) or None (zeros)."""
        self.clear(slot)
        for p, ab in enumerate(parts):
            if ab is not None:
                a, b = ab
                r, lo = a.shape[1], p * self.rank
                self.a[slot, :, lo:lo + r].copy_(a)
                self.b[p][slot, :r].copy_(b)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x, [T, out]) plus each adapter row's delta, in place."""
        step = _STEP
        threads = torch.get_num_threads()
        if _ONE_THREAD and threads > 1:
            torch.set_num_threads(1)
        try:
            if step.only_slot is not None:
                return self._one_adapter(x, y, step.only_slot)
            xs = x.index_select(0, step.gather)
            if xs.dtype != self.dtype:
                xs = xs.to(self.dtype)
            if step.segments is not None:
                delta = self._segments(xs, step.segments)
            else:
                delta = self._padded(xs, step)
            y.index_add_(0, step.gather, delta if delta.dtype == y.dtype else delta.to(y.dtype))
        finally:
            if _ONE_THREAD and threads > 1:
                torch.set_num_threads(threads)
        return y

    def _one_adapter(self, x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
        """A batch of one adapter's rows only: y += (x @ A) @ B per part, in place."""
        xl = x if x.dtype == self.dtype else x.to(self.dtype)
        xa = xl @ self.a[slot]
        r = self.rank
        for p, (b, off, size) in enumerate(zip(self.b, self.offsets, self.part_sizes,
                                               strict=True)):
            delta = xa[:, p * r:(p + 1) * r] @ b[slot]
            y[:, off:off + size] += delta if delta.dtype == y.dtype else delta.to(y.dtype)
        return y

    def _padded(self, xs: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        m, length = step.m, step.length
        if step.pad is not None:
            xs.mul_(step.pad)
        if step.slots is None:
            a, bs = self.a[:m], [b[:m] for b in self.b]
        else:
            a = self.a.index_select(0, step.slots)
            bs = [b.index_select(0, step.slots) for b in self.b]
        xa = torch.bmm(xs.view(m, length, self.in_size), a)
        r = self.rank
        if len(bs) == 1:
            delta = torch.bmm(xa, bs[0])
        else:  # measured faster than index_add_ into each part's columns
            delta = torch.cat([torch.bmm(xa[:, :, p * r:(p + 1) * r], b)
                               for p, b in enumerate(bs)], dim=-1)
        return delta.view(m * length, -1)

    def _segments(self, xs: torch.Tensor, segments: list[tuple[int, int, int]]
                  ) -> torch.Tensor:
        """Uneven groups: each group's rows (contiguous in xs) through its own A and B, the
        products written in place: no padding, a few GEMMs per adapter in the step."""
        r = self.rank
        xa = xs.new_empty(xs.shape[0], self.a.shape[-1])
        for slot, lo, hi in segments:
            torch.mm(xs[lo:hi], self.a[slot], out=xa[lo:hi])
        parts = []
        for p, b in enumerate(self.b):
            d = xs.new_empty(xs.shape[0], b.shape[-1])
            xp = xa[:, p * r:(p + 1) * r]
            for slot, lo, hi in segments:
                torch.mm(xp[lo:hi], b[slot], out=d[lo:hi])
            parts.append(d)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def lora_delta(layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The projection's output with this step's adapter deltas (none: y as it is)."""
    slots = getattr(layer, "lora", None)
    if _STEP is None or slots is None:
        return y
    return slots.apply(x, y)
