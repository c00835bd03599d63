"""The files of SharedStorageConnector: one file per (full KV block, tensor-parallel rank).

Layout: DIR/<compat>/<hash[:2]>/<hash>.r<rank>.kv, where <hash> is the block's prefix-cache
hash (fleetllm/core/prefix_cache.py: it chains every token before the block's end, and the
LoRA salt) and <compat> a digest of what makes KV bytes reusable: the checkpoint (config.json,
weight files' names, sizes and mtimes), dtype, KV dtype, quantization, load format, block size
and the TP x PP layout. An instance with another model, dtype, block size or layout looks in
another directory and never reads these files.

A file is a fixed binary header then raw tensor bytes (no pickle):
    magic b"FLKVBLK1" | compat (16 bytes) | rank u32 | crc32 u32 | payload length u64 |
    layout length u16 | layout (utf-8: "<torch dtype>:<shape>") | payload
`read` checks every field against what the reader expects; a file that is short, long,
foreign or whose crc32 differs is corrupt: it is deleted and the load fails (the connector
reports the block). Writes are atomic: a temporary file in the same directory, fsync,
os.replace; a crash mid-write leaves only a temporary file, which no reader opens (and the
next eviction pass removes). Several instances may share DIR.

Size cap (`max_bytes`): LRU by mtime (a read touches the file). The instance's rank 0 evicts
the least recently used blocks, all ranks' files of a block together, until the files under
DIR/<compat> fit. A block evicted between the scheduler's lookup and a worker's read is a
load failure like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

MAGIC = b"FLKVBLK1"
_HEAD = struct.Struct("<8s16sIIQH")  # magic, compat, rank, crc32, payload length, layout len
SUFFIX = ".kv"


class CorruptBlockError(Exception):
    """A block file exists but is not a complete, compatible block (it was deleted)."""


def compat_digest(config: Any) -> bytes:
    """16 bytes naming what a stored block is valid for (see the module docstring)."""
    m, c, p, load = config.model_config, config.cache_config, config.parallel_config, \
        config.load_config
    model = Path(m.model)
    files: list[Any] = []
    if model.is_dir():
        cfg = model / "config.json"
        files.append(cfg.read_text() if cfg.exists() else None)
        for f in sorted(model.iterdir()):
            if f.suffix in (".safetensors", ".gguf", ".bin"):
                st = f.stat()
                files.append([f.name, st.st_size, st.st_mtime_ns])
    elif model.exists():  # a GGUF file
        st = model.stat()
        files.append([str(model.resolve()), st.st_size, st.st_mtime_ns])
    key = {"files": files, "dtype": str(m.dtype), "kv_cache_dtype": c.kv_cache_dtype,
           "quantization": m.quantization, "load_format": load.load_format,
           "seed": m.seed if load.load_format == "dummy" else None,
           "block_size": c.block_size, "tp": p.tensor_parallel_size,
           "pp": p.pipeline_parallel_size, "version": 1}
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).digest()


class BlockStore:
    def __init__(self, root: str | os.PathLike, compat: bytes, max_bytes: int | None = None):
        self.compat = compat
        self.dir = Path(root) / compat.hex()
        self.max_bytes = max_bytes
        self._bytes_estimate: int | None = None  # of the files under self.dir (rank 0)

    def path(self, block_hash: bytes, rank: int) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / f"{h}.r{rank}{SUFFIX}"

    def has_block(self, block_hash: bytes, world_size: int) -> bool:
        """Every rank's file of the block exists."""
        return all(self.path(block_hash, r).exists() for r in range(world_size))

    def write(self, block_hash: bytes, rank: int, layout: str, payload: bytes) -> int:
        """Store one rank's block atomically; returns the bytes written."""
        target = self.path(block_hash, rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        lay = layout.encode()
        head = _HEAD.pack(MAGIC, self.compat, rank, zlib.crc32(payload), len(payload), len(lay))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(lay)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(head) + len(lay) + len(payload)

    def read(self, block_hash: bytes, rank: int, layout: str, nbytes: int) -> bytes:
        """The payload of one rank's block. FileNotFoundError if missing; CorruptBlockError
        (and the file is deleted) if it is not exactly a compatible block."""
        path = self.path(block_hash, rank)
        with open(path, "rb") as f:
            data = f.read()
        lay = layout.encode()
        why = None
        if len(data) != _HEAD.size + len(lay) + nbytes:
            why = f"{len(data)} bytes, expected {_HEAD.size + len(lay) + nbytes}"
        else:
            magic, compat, file_rank, crc, length, lay_len = _HEAD.unpack_from(data)
            payload = data[_HEAD.size + lay_len:]
            if (magic, compat, file_rank, length, lay_len) != (MAGIC, self.compat, rank,
                                                               nbytes, len(lay)):
                why = "a header of another store, rank or layout"
            elif data[_HEAD.size:_HEAD.size + lay_len] != lay:
                why = "another layout"
            elif zlib.crc32(payload) != crc:
                why = "a crc32 mismatch"
        if why is not None:
            path.unlink(missing_ok=True)  # never read again; the next save rewrites it
            raise CorruptBlockError(f"{path}: {why}")
        now = time.time()
        try:
            os.utime(path, (now, now))  # LRU: a read is a use
        except OSError:
            pass
        return payload

    # ---------------------------------------------------------------- size cap (LRU)

    def note_written(self, nbytes: int) -> None:
        """Rank 0, after its saves of a step: `nbytes` more under the store (all ranks);
        evicts least recently used blocks when over max_bytes."""
        if self.max_bytes is None:
            return
        if self._bytes_estimate is None:
            self._bytes_estimate = self._scan()[0]
        self._bytes_estimate += nbytes
        if self._bytes_estimate > self.max_bytes:
            self._bytes_estimate = self.evict_to(self.max_bytes)

    def _scan(self) -> tuple[int, dict[str, list[tuple[Path, int, float]]]]:
        total = 0
        blocks: dict[str, list[tuple[Path, int, float]]] = {}
        if not self.dir.is_dir():
            return 0, blocks
        stale = time.time() - 3600
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):  # a crashed writer's, an hour old
                    if st.st_mtime < stale:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                if entry.name.endswith(SUFFIX):
                    total += st.st_size
                    blocks.setdefault(entry.name.split(".")[0], []).append(
                        (Path(entry.path), st.st_size, st.st_mtime))
        return total, blocks

    def evict_to(self, max_bytes: int) -> int:
        """Delete least recently used blocks (every rank's file of each) until the files
        fit in max_bytes; returns the bytes left."""
        total, blocks = self._scan()
        order = sorted(blocks.values(), key=lambda files: max(f[2] for f in files))
        for files in order:
            if total <= max_bytes:
                break
            for path, size, _ in files:
                try:
                    path.unlink()
                    total -= size
                except FileNotFoundError:
                    pass
        return total
