"""SharedStorageConnector (vLLM's name): a prefix cache that outlives the instance, in files.

    kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": DIR,
                                                      "max_bytes": 8 << 30}}

How: every full KV block of a prompt is written, per TP rank, to a file named by its
prefix-cache hash (block_store.py). When a new prompt's prefix goes beyond the local
prefix-cache hit, the scheduler half counts the consecutive blocks whose files exist for every
rank (`get_num_new_matched_tokens`); the request is admitted with those tokens computed, and
each worker reads its files into the blocks before the step's forward.
Saves happen after the forward of the step that completed a block, for requests that loaded
nothing in that step (their KV depends only on blocks already known good); a request that
loaded saves its new blocks at its next step. Only prompt blocks are stored.

What fails and how: a missing file or a corrupt one (short, foreign header, crc mismatch;
it is deleted) fails that block's load: the worker reports it and the engine applies
kv_load_failure_policy. A request that failed once never loads again (recompute is from its
own tokens: the Scheduler no longer asks for it). A failing write is logged and skipped (the
store is a cache).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fleetllm.errors import ConfigurationError
from fleetllm.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from fleetllm.kv_transfer.block_store import BlockStore, CorruptBlockError, compat_digest

if TYPE_CHECKING:
    from fleetllm.config import EngineConfig
    from fleetllm.sequence import KVConnectorOutput, SequenceGroup

logger = logging.getLogger(__name__)

BlockRef = tuple[int, bytes]  # (device block id, prefix-cache hash)


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    loads: dict[str, list[BlockRef]] = field(default_factory=dict)  # per request
    saves: dict[str, list[BlockRef]] = field(default_factory=dict)


def _store_from(config: EngineConfig) -> BlockStore:
    extra = dict(config.kv_transfer_config.kv_connector_extra_config)
    path = extra.pop("shared_storage_path", None)
    max_bytes = extra.pop("max_bytes", None)
    if extra:
        raise ConfigurationError(f"kv_transfer_config: kv_connector_extra_config keys "
                                 f"{sorted(extra)} are not known to SharedStorageConnector "
                                 "(shared_storage_path, max_bytes)")
    if not isinstance(path, str) or not path:
        raise ConfigurationError("kv_transfer_config: kv_connector_extra_config needs "
                                 "'shared_storage_path': a directory for the KV files")
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                  or max_bytes <= 0):
        raise ConfigurationError("kv_transfer_config: kv_connector_extra_config max_bytes "
                                 f"must be an int > 0 (bytes), got {max_bytes!r}")
    return BlockStore(path, compat_digest(config), max_bytes)


def remote_prefill_blocks(request: SequenceGroup) -> int | None:
    """How many blocks a decode leg's producer stored (its kv_transfer_params with
    do_remote_prefill), or None for a request that is not one."""
    params = request.sampling_params.kv_transfer_params if request.sampling_params else None
    if not params or not params.get("do_remote_prefill"):
        return None
    ids = params.get("remote_block_ids")
    return len(ids) if isinstance(ids, list) else 0


class SharedStorageConnector(KVConnectorBase_V1):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, rank: int = 0):
        super().__init__(config, role, rank)
        self.store = _store_from(config)
        self.block_size = config.cache_config.block_size
        self.world_size = config.parallel_config.world_size
        kt = config.kv_transfer_config
        self.can_load, self.can_save = kt.is_kv_consumer, kt.is_kv_producer
        # scheduler half
        self._loads: dict[str, list[BlockRef]] = {}  # admitted this step, to load
        self._saved_upto: dict[str, int] = {}  # per request: blocks stored or known stored
        # per request: its device blocks known stored (the engine frees a finished request's
        # blocks before request_finished, which reports them as remote_block_ids)
        self._stored_ids: dict[str, list[int]] = {}
        self.stats = {"requests_loaded": 0, "blocks_loaded": 0, "tokens_loaded": 0,
                      "requests_saved": 0, "blocks_saved": 0, "bytes_loaded": 0,
                      "bytes_saved": 0}  # bytes: KV payload, all ranks
        self._saving: set[str] = set()  # requests that wrote a block (requests_saved)
        # worker half
        self._failed_blocks: set[int] = set()
        self._moved = {"bytes_loaded": 0, "bytes_saved": 0}  # since the last report

    # ---------------------------------------------------------------- scheduler side

    def _prompt_hashes(self, request: SequenceGroup, limit_tokens: int) -> list[bytes]:
        seq = request.unfinished_seqs()[0]
        return self.block_manager.block_hashes(seq, limit_tokens // self.block_size)

    def get_num_new_matched_tokens(self, request: SequenceGroup, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if not self.can_load:
            return 0, False
        # Whole blocks of the prompt, leaving its last token to compute (its logits).
        limit = (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size
        hashes = self._prompt_hashes(request, limit)
        first = num_computed_tokens // self.block_size
        # A decode leg: the producer stored its first `remote` blocks; they are loaded
        # whether or not their files are there now (a missing one fails its load, and
        # kv_load_failure_policy applies), never silently recomputed. Past them, as for any
        # prompt, the consecutive blocks the store holds.
        remote = remote_prefill_blocks(request) or 0
        found = max(0, min(remote, len(hashes)) - first)
        for digest in hashes[first + found:]:
            if not self.store.has_block(digest, self.world_size):
                break
            found += 1
        return found * self.block_size, False

    def update_state_after_alloc(self, request: SequenceGroup, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        end = request.unfinished_seqs()[0].data.num_computed_tokens // self.block_size
        start = end - num_external_tokens // self.block_size
        # Its blocks are checked against the store from the first: a local hit may be
        # missing there (evicted by the cap, or written by no one).
        self._saved_upto[rid] = 0
        self._stored_ids.pop(rid, None)
        if num_external_tokens:
            hashes = self._prompt_hashes(request, end * self.block_size)
            self._loads[rid] = [(block_ids[i], hashes[i]) for i in range(start, end)]
            self.stats["requests_loaded"] += 1
            self.stats["blocks_loaded"] += end - start
            self.stats["tokens_loaded"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._loads)
        self._loads = {}
        if not self.can_save:
            return meta
        planned: set[bytes] = set()  # two prompts of the step may complete the same block
        for scheduled in scheduler_output.scheduled_seq_groups:
            group = scheduled.seq_group
            rid = group.request_id
            seqs = group.unfinished_seqs()
            if rid in meta.loads or len(seqs) != 1 or group.pooling_params is not None:
                continue  # loads first; a forked group's blocks are the parent's prompt
            seq = seqs[0]
            full = min(seq.data.num_computed_tokens + scheduled.token_chunk_size,
                       len(seq.prompt_token_ids)) // self.block_size
            start = self._saved_upto.get(rid, 0)
            if full <= start:
                continue
            table = self.block_manager.get_block_table(seq)
            hashes = self.block_manager.block_hashes(seq, full)
            saves = [(table[i], hashes[i]) for i in range(start, full) if hashes[i] not in
                     planned and not self.store.has_block(hashes[i], self.world_size)]
            planned.update(h for _, h in saves)
            self._saved_upto[rid] = full
            self._stored_ids[rid] = list(table[:full])
            if saves:
                meta.saves[rid] = saves
                self.stats["blocks_saved"] += len(saves)
                if rid not in self._saving:
                    self._saving.add(rid)
                    self.stats["requests_saved"] += 1
        return meta

    def request_finished(self, request: SequenceGroup, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """A prefill leg (kv_transfer_params do_remote_decode) that completed on a producer
        answers with the params its decode leg sends to a consumer: vLLM's keys, with
        remote_block_ids this instance's blocks of the stored prompt (their count is what
        the consumer loads) and remote_engine_id the store's compatibility digest. The
        blocks themselves are already in the files: nothing is held."""
        rid = request.request_id
        self._saved_upto.pop(rid, None)
        self._saving.discard(rid)
        stored = self._stored_ids.pop(rid, [])
        self._loads.pop(rid, None)
        params = request.sampling_params.kv_transfer_params if request.sampling_params \
            else None
        done = all(s.status.finish_reason in ("stop", "length") for s in request.seqs)
        if not (self.can_save and params and params.get("do_remote_decode") and done):
            return False, None
        return False, {"do_remote_decode": False, "do_remote_prefill": True,
                       "remote_engine_id": self.store.compat.hex(),
                       "remote_block_ids": stored,
                       "remote_host": None, "remote_port": None}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Synchronous: nothing finishes later; failed loads are the engine's to apply.
        for name, value in (connector_output.kv_connector_stats or {}).items():
            self.stats[name] = self.stats.get(name, 0) + value

    # ---------------------------------------------------------------- worker side

    def _layout(self) -> tuple[str, tuple[int, ...], torch.dtype, int]:
        first = self.kv_caches[0]
        shape = (len(self.kv_caches), 2, *first.shape[2:])
        nbytes = first[:, 0].numel() * first.element_size() * len(self.kv_caches)
        return f"{first.dtype}:{'x'.join(map(str, shape))}", shape, first.dtype, nbytes

    def start_load_kv(self, **kwargs: Any) -> None:
        """Read every block of this step's loads (all layers) into the KV cache."""
        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata) or not meta.loads:
            return
        layout, shape, dtype, nbytes = self._layout()
        for refs in meta.loads.values():
            for block_id, digest in refs:
                try:
                    payload = self.store.read(digest, self.rank, layout, nbytes)
                except (OSError, CorruptBlockError) as e:
                    logger.warning("KV block load failed (rank %d): %s", self.rank, e)
                    self._failed_blocks.add(block_id)
                    continue
                self._moved["bytes_loaded"] += len(payload)
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                block = data.view(dtype).view(shape)
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, block_id].copy_(block[layer])

    def wait_for_save(self) -> None:
        """Write this step's completed blocks (all layers), then enforce the size cap."""
        meta = self._metadata
        if not isinstance(meta, SharedStorageMetadata) or not meta.saves:
            return
        layout = self._layout()[0]
        written = 0
        for refs in meta.saves.values():
            for block_id, digest in refs:
                block = torch.stack([c[:, block_id] for c in self.kv_caches]).contiguous()
                payload = block.view(torch.uint8).numpy().tobytes()
                try:
                    written += self.store.write(digest, self.rank, layout, payload)
                    self._moved["bytes_saved"] += len(payload)
                except OSError as e:
                    logger.warning("KV block save failed (rank %d): %s", self.rank, e)
        if self.rank == 0:
            self.store.note_written(written * self.world_size)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> dict[str, int] | None:
        moved, self._moved = self._moved, {"bytes_loaded": 0, "bytes_saved": 0}
        return moved if any(moved.values()) else None
