"""A mixture-of-experts layer's experts as two stacked tensors, and the two ways to run them.

What: `FusedExperts` holds this rank's share of every expert: w13 [E, 2I, H] (each expert's
gate rows, then its up rows) and w2 [E, H, I], I being the intermediate size over the
tensor-parallel ranks (each rank keeps the same slice of every expert: w13's rows, w2's
columns; the block all-reduces the partial sums as the dense MLP does). With expert
parallelism (parallel_state.expert_parallel()) a rank holds whole experts instead, vLLM's
contiguous split: rank r of N the E / N experts from r * E / N (`first`, `local`); the
others' checkpoint tensors are skipped unread, and forward runs only the pairs routed to its
own experts (each token's experts in ascending order, as both kernels add them), so the
all-reduce sums whole experts' outputs.
How: `forward(x, ids, weights)` runs the chosen kernel, picked once after loading by
`choose_kernel` (called by kernel_choice.select_kernels): the C++ op `fused_moe`
(csrc/moe.cpp: pairs grouped by expert, GEMV kernels, no Python loop) on the CPU with the
kernels built, else `torch_experts` (sort by expert, one F.linear pair per expert picked:
CUDA, no kernels, and the tests' reference). Both add each token's experts in ascending
expert order, rounding as transformers' index_add_ loop does.
Quantized experts (a GGUF file's, quant/packed.QuantTensor): each expert's blocks are kept as
they load, then `finish_quantized` (called by quant/gguf_loader.finish) packs them
(moe_quant.pack_experts: one buffer, no dequantized copy) and drops w13 / w2; the kernels are
then the C++ op gguf_fused_moe (moe_quant.py), else `torch_quant_experts` (the picked experts
dequantized per call). Experts stored unquantized (F32 / F16 / BF16) fill w13 / w2 instead.
What fails: a checkpoint expert tensor of the wrong shape is a ValueError, a quantized one
other than a GGUF file's (AWQ / GPTQ groups) a ValueError too, and so is a GGUF tensor
whose blocks this rank's share of the intermediate size would split (tensor parallelism);
the loader turns each into a ModelLoadError naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.distributed.parallel_state import expert_parallel, get_tp_group
from fleetllm.kernels import cpu_kernels
from fleetllm.model.layers import Quantized, load_full, narrow
from fleetllm.model.moe_quant import cpu_quant_experts, pack_experts
from fleetllm.quant.packed import QuantTensor, dequantize_packed

ExpertsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          torch.Tensor], torch.Tensor]
GATE, UP, DOWN = 0, 1, 2  # an expert tensor's part


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
               expert_out: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts' weighted sum in PyTorch, x [T, H], ids [T, k], weights float32
    [T, k]: each picked expert's rows through expert_out(expert, its rows of x), its output
    times the pairs' weights rounded to x's dtype and added in ascending expert order
    (transformers' index_add_ loop); experts no token picked are never run."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    out = torch.zeros_like(x)
    start = 0
    for expert, rows in enumerate(counts):
        if not rows:
            continue
        pairs = order[start:start + rows]
        token = tokens[start:start + rows]
        y = expert_out(expert, x[token])
        out.index_add_(0, token, (y * weights.reshape(-1)[pairs, None]).to(x.dtype))
        start += rows
    return out


def torch_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """routed_sum over stacked dense experts, in x's dtype."""
    def expert_out(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2[expert])

    return routed_sum(x, ids, weights, w13.shape[0], expert_out)


def torch_quant_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        packed: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """routed_sum over packed quantized experts (moe_quant.pack_experts): each picked
    expert's copies dequantized now (gguf's reference), run in float32, its output rounded
    to x's dtype. The path without the kernels, and gguf_fused_moe's reference in tests."""
    b = bounds.tolist()

    def expert_out(expert: int, rows: torch.Tensor) -> torch.Tensor:
        w13 = dequantize_packed(packed[b[2 * expert]:b[2 * expert + 1]])
        w2 = dequantize_packed(packed[b[2 * expert + 1]:b[2 * expert + 2]])
        gate, up = F.linear(rows.float(), w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2).to(x.dtype)

    return routed_sum(x, ids, weights, (bounds.numel() - 1) // 2, expert_out)


def cpu_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.fused_moe(x.contiguous(), ids.contiguous(), weights.contiguous(),
                                 w13, w2)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        tp = get_tp_group()
        self.num_experts = num_experts
        self.ep = expert_parallel()  # whole experts on this rank, not a slice of each
        ranks = tp.world_size
        self.local = num_experts // ranks if self.ep else num_experts  # experts held here
        self.first = tp.rank_in_group * self.local if self.ep else 0  # the first one's id
        self.shard = intermediate_size if self.ep else intermediate_size // ranks
        self.start = 0 if self.ep else tp.rank_in_group * self.shard
        self.w13 = nn.Parameter(torch.empty(self.local, 2 * self.shard, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.local, hidden_size, self.shard))
        self.kernel: ExpertsKernel = torch_experts
        self._loaded: set[tuple[int, int]] = set()  # (expert, part) filled so far
        self._blocks: dict[tuple[int, int], QuantTensor] = {}  # a GGUF file's, until packed
        # the quantized experts (moe_quant.pack_experts), in place of w13 / w2
        self.packed: torch.Tensor | None = None
        self.bounds: torch.Tensor | None = None

    def choose_kernel(self) -> None:
        """Once, after loading: the C++ op where it runs these weights, else PyTorch's."""
        if self.packed is not None:
            usable = cpu_kernels.available() and self.packed.device.type == "cpu"
            self.kernel = cpu_quant_experts if usable else torch_quant_experts
            return
        usable = cpu_kernels.usable(self.w13, self.w2) and self.w13.is_contiguous() \
            and self.w2.is_contiguous()
        self.kernel = cpu_experts if usable else torch_experts

    def load_expert(self, expert: int, part: int, loaded: Any) -> bool:
        """Copy this rank's slice of one checkpoint expert tensor (GATE, UP: rows [I, H];
        DOWN: columns [H, I]) into the stacked weights, or keep a GGUF tensor's blocks of it
        for finish_quantized; True once every expert's gate and up (part < DOWN) or down
        tensor is in. Another rank's expert (expert parallelism) is skipped, never read."""
        if isinstance(loaded, Quantized) and not isinstance(loaded, QuantTensor):
            raise ValueError("quantized expert weights are supported from GGUF files only "
                             "(and bf16 / float32 safetensors)")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is not in 0..{self.num_experts - 1}")
        expert -= self.first  # its index among this rank's experts
        if not 0 <= expert < self.local:
            return False
        dim = 1 if part == DOWN else 0  # down's columns, gate's and up's rows
        piece = narrow(loaded, dim, self.start, self.shard)
        if part == DOWN:
            target = self.w2.data[expert]
        else:
            target = self.w13.data[expert, part * self.shard:(part + 1) * self.shard]
        if tuple(piece.shape) != tuple(target.shape):
            raise ValueError(f"this rank's slice has shape {tuple(piece.shape)}, the "
                             f"model's is {tuple(target.shape)}")
        if isinstance(piece, QuantTensor):  # kept as blocks until finish_quantized
            self._blocks[(expert, part)] = piece
        else:
            target.copy_(load_full(piece))
        self._loaded.add((expert, part))
        parts = (DOWN,) if part == DOWN else (GATE, UP)
        return all((e, p) in self._loaded for e in range(self.local) for p in parts)

    def finish_quantized(self) -> None:
        """After loading a GGUF file: its experts' blocks packed into one buffer in place of
        w13 / w2 (dropped, never written), or, where every expert tensor is stored unquantized,
        dequantized into w13 / w2."""
        if not self._blocks:
            return
        blocks, self._blocks = self._blocks, {}
        missing = [(e + self.first, p) for e in range(self.local) for p in (GATE, UP, DOWN)
                   if (e, p) not in blocks]
        if missing:
            raise ValueError(f"lacks expert tensors (expert, part 0 gate / 1 up / 2 down): "
                             f"{missing[:4]}")
        parts = [(blocks[(e, GATE)], blocks[(e, UP)], blocks[(e, DOWN)])
                 for e in range(self.local)]
        if not any(t.quantized for trio in parts for t in trio):
            for e, (gate, up, down) in enumerate(parts):
                self.w13.data[e].copy_(torch.cat([gate.dequantize(), up.dequantize()]))
                self.w2.data[e].copy_(down.dequantize())
            return
        self.packed, self.bounds = pack_experts(parts)
        self.w13 = self.w2 = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """This rank's partial sum of the routed experts for x [T, H]."""
        if self.ep:
            return self._own_experts(x, ids, weights)
        return self._run(x, ids, weights)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.kernel(x, ids, weights, self.packed, self.bounds)
        return self.kernel(x, ids, weights, self.w13, self.w2)

    def _own_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                     ) -> torch.Tensor:
        """Expert parallelism: the pairs routed to this rank's experts, one row a pair (k=1),
        through the kernel, then added into their tokens' rows; a token's experts in ascending
        order, rounding after each add as the kernels' own weighted sum does."""
        ids, order = ids.sort(dim=1)
        weights = weights.gather(1, order)
        local = (ids - self.first).reshape(-1)
        mine = ((local >= 0) & (local < self.local)).nonzero().squeeze(1)
        out = torch.zeros_like(x)
        if mine.numel():
            token = mine // ids.shape[1]
            y = self._run(x[token], local[mine, None], weights.reshape(-1)[mine, None])
            out.index_add_(0, token, y)
        return out
