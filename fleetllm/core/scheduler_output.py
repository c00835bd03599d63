"""What one Scheduler.schedule() call plans for a step: the groups it runs (each with its chunk
of new tokens and whether it samples), the KV blocks to swap in, swap out and copy, the groups
it had to ignore, and what the engine needs to undo a failed step (kv_moved). The engine hands
the plan to the workers, then to Scheduler.complete_step() (or requeue_after_failed_step()).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetllm.sequence import SequenceGroup


@dataclass
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    token_chunk_size: int  # new tokens computed this step, per sequence
    do_sample: bool  # the chunk reaches the end of the sequence: sample the next token


@dataclass
class SchedulerOutputs:
    scheduled_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)  # {cpu: device}
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)  # {device: cpu}
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)  # {src: [dst, ...]}
    # Requests that can never be scheduled; their seqs are FINISHED_IGNORED.
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    # Groups whose blocks this step copies or moves (copy-on-write, swap in, swap out).
    kv_moved: list[SequenceGroup] = field(default_factory=list)
    preempted: int = 0  # groups preempted this step
    running_queue_size: int = 0
    # KV transfer: the connector's plan for the step (what the workers load and save).
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do (ignored groups still need reporting)."""
        return not (self.scheduled_seq_groups or self.blocks_to_swap_in
                    or self.blocks_to_swap_out or self.blocks_to_copy)
