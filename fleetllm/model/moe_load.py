"""Expert load on a worker: how many (token, expert) pairs each MoE layer's router picked.

What: every moe.SparseMoeBlock adds a bincount of its router's top-k ids to its
`expert_tokens` at each forward (the C++ op and the PyTorch path alike: the count is taken
before either runs); `take_expert_load` returns what this rank's layers counted since the
last take and zeroes it. The engine (engine/expert_load.py) calls `worker_expert_load` on
every rank through collective_rpc when asked for the load, never in a step, and sums the
replies.
How: the router runs replicated on every tensor-parallel rank, so only a stage's first TP
rank reports (the others zero their counts and report nothing); pipeline stages report their
own layers. The profile run's dummy tokens are dropped (`clear_expert_load` after it).
What fails: nothing on a dense model (no MoE layer: an empty reply).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fleetllm.distributed.parallel_state import get_tp_group


def _blocks(model: nn.Module) -> list[nn.Module]:
    from fleetllm.model.moe import SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def take_expert_load(model: nn.Module) -> dict[int, list[int]]:
    """{layer index: pairs routed to each expert} since the last take, this rank's MoE layers
    (empty on a TP rank other than the first); the counts restart at zero."""
    out = {}
    report = get_tp_group().is_first
    for block in _blocks(model):
        if report:
            out[block.layer_index] = block.expert_tokens.tolist()
        block.expert_tokens.zero_()
    return out


def clear_expert_load(model: nn.Module) -> None:
    for block in _blocks(model):
        block.expert_tokens.zero_()


def _model(worker: Any) -> nn.Module | None:
    """The target model of a worker (a speculative decoding worker's scorer's)."""
    for holder in (worker, getattr(worker, "scorer", None)):
        runner = getattr(holder, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is not None:
            return model
    return None


def worker_expert_load(worker: Any) -> dict[int, list[int]]:
    """collective_rpc's call on each worker: take_expert_load of its model ({} without one,
    e.g. while its weights sleep)."""
    model = _model(worker)
    return {} if model is None else take_expert_load(model)
