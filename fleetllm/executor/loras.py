"""ResidentLoRAs: what the executor knows its workers hold of LoRA adapters, so that new
workers after a restart get them back (restart_failed_workers calls `restore`).

It mirrors the workers' host-memory LRU (max_cpu_loras; lora/manager.py) from the calls that
change it: add_lora, remove_lora, pin_lora, and the adapters each step names (a worker loads
those on demand). Pinned adapters are never evicted, as on the workers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fleetllm.lora.request import LoRARequest
from fleetllm.sequence import ExecuteModelRequest

Rpc = Callable[..., list[Any]]


class ResidentLoRAs:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        self.pinned: set[int] = set()

    def touch(self, request: LoRARequest) -> None:
        rid = request.lora_int_id
        self.loaded[rid] = request
        self.loaded.move_to_end(rid)
        for old in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                break
            if old != rid and old not in self.pinned:
                del self.loaded[old]

    def step(self, request: ExecuteModelRequest) -> None:
        for group in request.seq_group_metadata_list:
            if group.lora_request is not None:
                self.touch(group.lora_request)

    def remove(self, lora_id: int) -> None:
        self.loaded.pop(lora_id, None)
        self.pinned.discard(lora_id)

    def restore(self, rpc: Rpc) -> None:
        """Load the resident adapters into new workers, least recently used first (so the
        workers' LRU order is the old one), and pin the pinned ones."""
        for request in self.loaded.values():
            rpc("add_lora", args=(request,))
        for lora_id in self.pinned:
            rpc("pin_lora", args=(lora_id,))
