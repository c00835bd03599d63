"""A GGUF file's header without its tensors' data or its arrays: what the configuration needs
(config_gguf.py) in processes that never load the weights (the API server's, the engine-core
client's). gguf's GGUFReader turns every metadata value into numpy views at open, a
tokenizer's arrays included (a 128K-token vocabulary and its merges: seconds, hundreds of MB,
held as long as the reader); this keeps the scalars and strings, and of each array only where
it lies (ArrayValue, read when asked).

The format (GGUF versions 2 and 3, as gguf's gguf_reader.py reads it): magic "GGUF", version
u32, tensor count u64, key/value count u64; each key/value: key (string), value type u32,
value; each tensor info: name (string), n_dims u32, dims u64 x n_dims (columns first), ggml
type u32, offset u64 into the data section, which starts at the next multiple of
general.alignment (u32, default 32) after the infos. A string: length u64, UTF-8 bytes; an
array: item type u32, count u64, items. Little-endian, or byte-swapped throughout (read as
gguf does: the version's low 16 bits are 0). Errors: ValueError (config_gguf.py makes it a
ModelLoadError) or OSError.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9  # GGUFValueType
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}  # GGUFValueType -> struct code


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array left in the file: `count` items of GGUFValueType `item_type` in bytes
    [start, end); read() reads them as gguf's contents() gives them (strings as str, nested
    arrays flattened)."""

    path: str
    item_type: int
    count: int
    start: int
    end: int
    order: str  # "<" or ">"

    def __len__(self) -> int:
        return self.count

    def read(self) -> list[Any]:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            data = f.read(self.end - self.start)
        if len(data) != self.end - self.start:
            raise ValueError("the file ends inside an array (truncated)")
        values, _ = _Cursor(data, self.order, self.path).items(self.item_type, self.count, 0)
        return _decoded(values)


def _decoded(value: Any) -> Any:
    """Strings (bytes as read) as str, UnicodeDecodeError if not UTF-8; an array's items,
    its nested arrays' flattened into it (as gguf's contents())."""
    if isinstance(value, bytes):
        return value.decode()
    if not isinstance(value, list):
        return value
    out: list[Any] = []
    for v in value:
        if isinstance(v, list):
            out += _decoded(v)
        else:
            out.append(_decoded(v))
    return out


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header (gguf's ReaderTensor without `data`): shape in ggml
    order (columns first), data_offset from the file's start, n_bytes as stored."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int
    n_elements: int
    n_bytes: int


class _Cursor:
    """Reads values from a buffer (the file's mapping, or an array's bytes); struct.error
    (past the end) is the caller's to turn into 'truncated'."""

    def __init__(self, buf: Any, order: str, path: str):
        self.buf, self.order, self.path = buf, order, path
        self.u64 = struct.Struct(order + "Q")

    def scalar(self, code: str, pos: int) -> tuple[Any, int]:
        s = struct.Struct(self.order + code)
        return s.unpack_from(self.buf, pos)[0], pos + s.size

    def string(self, pos: int) -> tuple[bytes, int]:
        n = self.u64.unpack_from(self.buf, pos)[0]
        pos += 8
        if pos + n > len(self.buf):
            raise struct.error("string past the end")
        return bytes(self.buf[pos:pos + n]), pos + n

    def value(self, kind: int, pos: int, lazy: bool) -> tuple[Any, int]:
        """One value of GGUFValueType `kind` at pos: a scalar, bytes (a string), or for an
        array an ArrayValue (lazy) or its items' list."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], pos)
        if kind == _STRING:
            return self.string(pos)
        if kind != _ARRAY:
            raise ValueError(f"{kind} is not a valid GGUFValueType")
        item_type, pos = self.scalar("I", pos)
        count, pos = self.scalar("Q", pos)
        if not lazy:
            return self.items(item_type, count, pos)
        end = self.skip(item_type, count, pos)
        return ArrayValue(self.path, item_type, count, pos, end, self.order), end

    def items(self, kind: int, count: int, pos: int) -> tuple[list[Any], int]:
        if kind in _SCALARS:  # fixed size: one unpack
            s = struct.Struct(f"{self.order}{count}{_SCALARS[kind]}")
            return list(s.unpack_from(self.buf, pos)), pos + s.size
        out = []
        for _ in range(count):
            v, pos = self.value(kind, pos, lazy=False)
            out.append(v)
        return out, pos

    def skip(self, kind: int, count: int, pos: int) -> int:
        """The end of `count` items of `kind` from pos, without decoding them."""
        if kind in _SCALARS:
            pos += count * struct.calcsize(self.order + _SCALARS[kind])
        elif kind == _STRING:
            unpack = self.u64.unpack_from
            buf = self.buf
            for _ in range(count):  # the lengths only: ~0.1 s for Llama 3's 400K strings
                pos += 8 + unpack(buf, pos)[0]
        else:
            for _ in range(count):
                pos = self.value(kind, pos, lazy=True)[1]
        if pos > len(self.buf):
            raise struct.error("array past the end")
        return pos


class GgufHeader:
    """The header of the GGUF file at `path`. fields: key -> int | float | bool | bytes (a
    string, decoded by get()) | ArrayValue; tensors: TensorInfo in the file's order;
    data_offset and size in bytes. The file is mapped while it is read, and not kept."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                try:
                    self._parse(buf)
                except struct.error:
                    raise ValueError("the file ends inside its header (truncated)") from None

    def _parse(self, buf: Any) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if buf[:4] != _MAGIC:
            raise ValueError("GGUF magic invalid")
        version = struct.unpack_from("<I", buf, 4)[0]
        order = "<"
        if version & 0xFFFF == 0:  # written for the other byte order
            order, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"Sorry, file appears to be version {version} which we cannot "
                             "handle")
        self.version, self.byte_order = version, order
        cur = _Cursor(buf, order, self.path)
        tensor_count, kv_count = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24
        self.fields: dict[str, Any] = {}
        self._types: dict[str, int] = {}
        for _ in range(kv_count):
            key, pos = cur.string(pos)
            name = key.decode()
            kind, pos = cur.scalar("I", pos)
            if name in self.fields:
                raise ValueError(f"Duplicate {name} in the metadata")
            self.fields[name], pos = cur.value(kind, pos, lazy=True)
            self._types[name] = kind
        infos = []
        for _ in range(tensor_count):
            name, pos = cur.string(pos)
            n_dims, pos = cur.scalar("I", pos)
            dims, pos = cur.items(10, n_dims, pos)  # u64 each
            kind, pos = cur.scalar("I", pos)
            offset, pos = cur.scalar("Q", pos)
            infos.append((name.decode(), tuple(dims), kind, offset))
        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            if self._types["general.alignment"] != 4:  # UINT32
                raise ValueError("Bad type for general.alignment field")
            self.alignment = self.fields["general.alignment"]
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        self.data_offset = -(-pos // self.alignment) * self.alignment
        self.tensors: list[TensorInfo] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"Found duplicated tensor with name {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = math.prod(dims)
            self.tensors.append(TensorInfo(name, dims, qtype, self.data_offset + offset, n,
                                           n * type_size // block))

    def get(self, key: str, default: Any = None) -> Any:
        """key's value as gguf's contents() gives it (an array read now), or default.
        Raises ValueError (UnicodeDecodeError) for a value that does not decode."""
        value = self.fields.get(key)
        if value is None:
            return default
        return value.read() if isinstance(value, ArrayValue) else _decoded(value)

    def read(self, info: TensorInfo) -> bytes:
        """A tensor's bytes as stored (for the few small ones the config reads)."""
        if info.data_offset + info.n_bytes > self.size:
            raise ValueError(f"tensor {info.name!r} runs past the end of the file (truncated)")
        with open(self.path, "rb") as f:
            f.seek(info.data_offset)
            return f.read(info.n_bytes)
