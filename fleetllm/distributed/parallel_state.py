"""Process groups for tensor (TP) and pipeline (PP) parallelism.

Global rank = pp_rank * tp_size + tp_rank (a stage is a contiguous run of ranks); output_rank()
is the rank whose result a step returns. Expert parallelism (enable_expert_parallel) adds no
group: its experts are spread over the TP group (expert_parallel() says whether they are; see
model/moe_experts.py). With one worker every collective is a no-op, so the
model code is the same on every backend. gloo on CPU, NCCL on CUDA; the caller's
`init_method` picks the rendezvous (mp: a private `file://` store, gloo on loopback; ray: a
`tcp://` store on rank 0's node and each node's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).
Every collective is counted on entry (collective_count), so a failed call tells the executor
whether that rank's peers may now be paired with stale collectives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_collective_ops = 0  # collectives this process has entered (see collective_count)


def collective_count() -> int:
    """How many collective operations this process has entered through its groups (counted
    before the operation runs, so one that raised or never returned counts too)."""
    return _collective_ops


def _entering_collective() -> None:
    global _collective_ops
    _collective_ops += 1


@dataclass
class GroupCoordinator:
    """One TP or PP group as seen from this rank."""

    ranks: list[int]  # global ranks in this group, in group order
    rank_in_group: int
    group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        _entering_collective()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        _entering_collective()
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensors: list[torch.Tensor], dst_in_group: int) -> None:
        for t in tensors:
            _entering_collective()
            dist.send(t.contiguous(), dst=self.ranks[dst_in_group], group=self.group)

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
             src_in_group: int) -> list[torch.Tensor]:
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            _entering_collective()
            dist.recv(t, src=self.ranks[src_in_group], group=self.group)
            out.append(t)
        return out

    def broadcast(self, x: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return x
        _entering_collective()
        dist.broadcast(x, src=self.ranks[src_in_group], group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        _entering_collective()
        dist.barrier(group=self.group)


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples and returns a step's SamplerOutput: tensor rank 0 of the last
    pipeline stage (the only stage holding logits; TP rank 0 holds the gathered vocab)."""
    return (pp_size - 1) * tp_size


_TP = GroupCoordinator([0], 0)
_PP = GroupCoordinator([0], 0)
_WORLD = GroupCoordinator([0], 0)  # every rank; group None: the default group
_OUTPUT_RANK = 0
_EXPERT_PARALLEL = False  # MoE layers give each TP rank whole experts (docs/moe.md)


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def expert_parallel() -> bool:
    """Whether MoE layers split their experts (whole ones) over the TP group rather than each
    expert's intermediate size; False with one TP rank, where both are the same."""
    return _EXPERT_PARALLEL and _TP.world_size > 1


def init_distributed(world_size: int, rank: int, init_method: str | None, tp_size: int,
                     pp_size: int, device: str, timeout_s: float = 600.0,
                     enable_expert_parallel: bool = False) -> None:
    """Join the global group and build this rank's TP and PP groups. One worker: nothing."""
    global _TP, _PP, _WORLD, _OUTPUT_RANK, _EXPERT_PARALLEL
    _OUTPUT_RANK = output_rank(tp_size, pp_size)
    _EXPERT_PARALLEL = enable_expert_parallel
    _WORLD = GroupCoordinator(list(range(world_size)), rank)
    if world_size == 1:
        _TP, _PP = GroupCoordinator([0], 0), GroupCoordinator([0], 0)
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size,
                                rank=rank, timeout=timedelta(seconds=timeout_s))
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    # new_group must be called by every rank for every group, in the same order.
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, backend=backend)
        if stage == pp_rank:
            _TP = GroupCoordinator(ranks, tp_rank, group)
    for column in range(tp_size):
        ranks = list(range(column, world_size, tp_size))
        group = dist.new_group(ranks, backend=backend)
        if column == tp_rank:
            _PP = GroupCoordinator(ranks, pp_rank, group)


def broadcast_from_output_rank(x: torch.Tensor) -> torch.Tensor:
    """The output rank's x on every rank (multi-step decoding: each rank feeds the sampled
    tokens back itself). x must have the same shape and dtype on every rank."""
    return _WORLD.broadcast(x, _OUTPUT_RANK)


@contextmanager
def alone() -> Iterator[None]:
    """Within it, this rank is a world of its own (tensor and pipeline parallel size 1): a
    draft model, which runs whole on the output rank beside a TP/PP target, is built and run
    in it so that its layers neither shard nor communicate."""
    global _TP, _PP, _WORLD, _EXPERT_PARALLEL
    saved = _TP, _PP, _WORLD, _EXPERT_PARALLEL
    _TP, _PP, _WORLD = GroupCoordinator([0], 0), GroupCoordinator([0], 0), \
        GroupCoordinator([0], 0)
    _EXPERT_PARALLEL = False
    try:
        yield
    finally:
        _TP, _PP, _WORLD, _EXPERT_PARALLEL = saved


def destroy_distributed() -> None:
    global _TP, _PP, _WORLD, _EXPERT_PARALLEL
    _EXPERT_PARALLEL = False
    _TP, _PP, _WORLD = (GroupCoordinator([0], 0), GroupCoordinator([0], 0),
                        GroupCoordinator([0], 0))
    if dist.is_initialized():
        dist.destroy_process_group()


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)
