"""KVConnectorBase_V1: the KV connector API, vLLM v1's method names, in two halves.

One class, built twice per engine: with role SCHEDULER in the engine process (the Scheduler
asks it which prompt tokens an external store holds and what each step should load and save)
and with role WORKER on every rank (it moves the bytes between the store and that rank's KV
cache). The scheduler half's plan for a step, `build_connector_meta`, travels to the workers on
ExecuteModelRequest.kv_connector_metadata; each worker's news, a KVConnectorOutput, comes back
on its SamplerOutput and the executor's KVOutputAggregator merges the ranks' into one.

Per-layer hooks: fleetllm's model runs its layers in fused C++ paths, so the worker calls
`start_load_kv` + `wait_for_layer_load` once before the forward (every layer is loaded
before any runs) and `save_kv_layer` + `wait_for_save` once after it; the per-layer methods
exist for vLLM compatibility and take layer_name=None (all layers).

What fails and how: a block whose load failed is reported by `get_block_ids_with_load_errors`
(KVConnectorOutput.invalid_block_ids); the engine then applies kv_load_failure_policy to each
request holding one ("recompute": computed again without the store; "fail": ended with
finish_reason "error"), and none of those blocks enters the prefix cache.
Asynchronous sends (request_finished returning delay_free=True) are part of the API but not of
the engine yet: the Scheduler raises ConfigurationError if a connector asks for it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetllm.config import EngineConfig
    from fleetllm.sequence import KVConnectorOutput, SequenceGroup


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # in the engine process, beside the Scheduler
    WORKER = 1  # on every rank, beside its KV cache


class KVConnectorMetadata:
    """What the scheduler half tells the worker halves about one step (a connector
    subclasses it; it must be picklable: it crosses process boundaries under mp and ray)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    def __init__(self, config: EngineConfig, role: KVConnectorRole, rank: int = 0):
        self.config = config
        self.kv_transfer_config = config.kv_transfer_config
        self.role = role
        self.rank = rank  # the worker's global rank (0 for the scheduler half)
        self._metadata: KVConnectorMetadata | None = None
        # Scheduler half: the Scheduler's BlockManager (block tables, prefix-cache hashes).
        self.block_manager: Any = None

    # ---------------------------------------------------------------- scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: SequenceGroup, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """(tokens past `num_computed_tokens` (the local prefix-cache hit) the store can
        provide, whether they arrive asynchronously). Whole blocks; at least the prompt's last
        token is left to compute."""

    @abstractmethod
    def update_state_after_alloc(self, request: SequenceGroup, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request was admitted: `block_ids` is its block table; the blocks holding the
        `num_external_tokens` after its local hit are to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The plan for the step `scheduler_output` (SchedulerOutputs); resets the pending
        loads and saves it collected."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' merged news of a step (finished transfers, failed loads)."""

    def request_finished(self, request: SequenceGroup, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended: (free its blocks only after an asynchronous send finishes,
        kv_transfer_params for a peer). Default: free now, nothing to share."""
        return False, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """This rank's KV cache, one tensor per layer: [2, num_blocks, block_size, kv_heads,
        head_dim]. Called again whenever the cache is rebuilt (wake_up)."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self, **kwargs: Any) -> None:
        """Begin loading this step's blocks into the KV cache (here: load all of them)."""

    def wait_for_layer_load(self, layer_name: str | None = None) -> None:
        """Block until `layer_name` (None: every layer) is loaded."""

    def save_kv_layer(self, layer_name: str | None = None, kv_layer: Any = None,
                      **kwargs: Any) -> None:
        """Begin saving `layer_name`'s blocks of this step (None: every layer)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        """(requests whose asynchronous send finished, whose asynchronous receive
        finished) since the last call. Synchronous connectors: (None, None)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call (then forgotten)."""
        return set()

    def get_kv_connector_stats(self) -> dict[str, int] | None:
        """This rank's counters since the last call (then reset), e.g. bytes moved; the
        executor sums the ranks' and the scheduler half gets them in
        update_connector_output (KVConnectorOutput.kv_connector_stats)."""
        return None
