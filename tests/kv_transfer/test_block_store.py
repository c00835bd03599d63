"""The SharedStorageConnector's files: atomic, checked on read, LRU-capped (issue 74)."""

from __future__ import annotations

import os
import time

import pytest

from fleetllm.kv_transfer.block_store import BlockStore, CorruptBlockError

COMPAT = bytes(range(16))
LAYOUT = "torch.float32:2x2x16x2x16"
PAYLOAD = bytes(range(256)) * 32  # 8 KiB


def test_a_block_reads_back_and_every_kind_of_damage_is_refused(tmp_path):
    store = BlockStore(tmp_path, COMPAT)
    h = bytes(16)
    store.write(h, 0, LAYOUT, PAYLOAD)
    assert store.read(h, 0, LAYOUT, len(PAYLOAD)) == PAYLOAD
    path = store.path(h, 0)
    good = path.read_bytes()
    for damaged in (good[:-1], good + b"x", good[:-5] + b"\0" + good[-4:],
                    good.replace(COMPAT, bytes(16), 1)):
        path.write_bytes(damaged)
        with pytest.raises(CorruptBlockError):
            store.read(h, 0, LAYOUT, len(PAYLOAD))
        assert not path.exists()  # deleted: never read again
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(good)
    with pytest.raises(CorruptBlockError):  # another layout (dtype, shape) of the same bytes
        store.read(h, 0, "torch.bfloat16:2x2x16x2x32", len(PAYLOAD))
    store.write(h, 1, LAYOUT, PAYLOAD)
    os.replace(store.path(h, 1), store.path(h, 0))  # rank 1's file where rank 0's belongs
    with pytest.raises(CorruptBlockError):
        store.read(h, 0, LAYOUT, len(PAYLOAD))
    with pytest.raises(FileNotFoundError):
        store.read(bytes([1] * 16), 0, LAYOUT, len(PAYLOAD))


def test_a_crash_mid_write_leaves_nothing_a_reader_opens(tmp_path, monkeypatch):
    store = BlockStore(tmp_path, COMPAT)
    h = bytes(16)

    def crash(fd):
        raise OSError("disk gone")  # the payload was written, fsync never returns

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        store.write(h, 0, LAYOUT, PAYLOAD)
    monkeypatch.undo()
    assert not store.has_block(h, 1)
    assert list(tmp_path.rglob("*")) == [store.dir, store.path(h, 0).parent]  # no temp left


def test_the_size_cap_evicts_least_recently_used_blocks_all_ranks_together(tmp_path):
    one = BlockStore(tmp_path, COMPAT).write(bytes(16), 0, LAYOUT, PAYLOAD)  # bytes a file
    store = BlockStore(tmp_path, COMPAT, max_bytes=6 * one)  # 3 blocks of 2 ranks
    hashes = [bytes([i]) * 16 for i in range(5)]
    store.evict_to(0)
    for h in hashes[:3]:
        for rank in (0, 1):
            store.write(h, rank, LAYOUT, PAYLOAD)
        store.note_written(2 * one)
        time.sleep(0.02)
    store.read(hashes[0], 1, LAYOUT, len(PAYLOAD))  # a use: block 0 is now the newest
    time.sleep(0.02)
    for h in hashes[3:]:
        for rank in (0, 1):
            store.write(h, rank, LAYOUT, PAYLOAD)
        store.note_written(2 * one)
        time.sleep(0.02)
    kept = [h for h in hashes if store.has_block(h, 2)]
    assert kept == [hashes[0], hashes[3], hashes[4]]
    assert not any(store.path(h, r).exists() for h in hashes[1:3] for r in (0, 1))
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.kv")) <= 6 * one
