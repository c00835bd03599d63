"""The GGUF header reader the configuration uses (fleetllm/config_gguf_reader.py): every value
type, both byte orders and a custom alignment read as gguf's GGUFReader reads them; arrays (a
tokenizer's) left in the file until asked for, so that validating a config reads none; bad
headers one ModelLoadError saying what is wrong."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from fleetllm.config_gguf import GgufFile
from fleetllm.config_gguf_reader import ArrayValue, GgufHeader
from fleetllm.config_model import ModelConfig
from fleetllm.errors import ModelLoadError
from fleetllm.quant.gguf_export import export_gguf

DEMO = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
V = gguf.GGUFValueType


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return export_gguf(DEMO, tmp_path_factory.mktemp("gguf") / "demo-Q8_0.gguf", "Q8_0",
                       progress=False)


def _every_type(path: Path, endian: gguf.GGUFEndian) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_custom_alignment(64)
    for i, (kind, value) in enumerate([
            (V.UINT8, 200), (V.INT8, -5), (V.UINT16, 60000), (V.INT16, -300),
            (V.UINT32, 4_000_000_000), (V.INT32, -70000), (V.FLOAT32, 0.1), (V.BOOL, True),
            (V.STRING, "Grüße, 世界"), (V.UINT64, 2**63 + 5), (V.INT64, -(2**40)),
            (V.FLOAT64, 1e-300)]):
        w.add_key_value(f"t.scalar{i}", value, kind)
    w.add_key_value("t.ints", [3, -1, 7], V.ARRAY)
    w.add_key_value("t.floats", [0.5, 1.25], V.ARRAY)
    w.add_key_value("t.strings", ["a", "", "ü b"], V.ARRAY)
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY)
    w.add_tensor("one", np.arange(5, dtype=np.float32))
    w.add_tensor("two", np.ones((3, 32), np.float16))
    w.add_tensor("q", np.zeros((2, 34), np.uint8), raw_shape=(2, 34),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG],
                         ids=["little", "big"])
def test_reads_what_gguf_reads(tmp_path, demo, endian):
    for path in (_every_type(tmp_path / "types.gguf", endian), demo):
        ours, theirs = GgufHeader(str(path)), gguf.GGUFReader(str(path))
        keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
        assert list(ours.fields) == keys
        for k in keys:
            assert ours.get(k) == theirs.fields[k].contents(), k
        assert [(t.name, t.shape, t.tensor_type, t.data_offset, t.n_elements, t.n_bytes)
                for t in ours.tensors] == \
            [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset,
              t.n_elements, t.n_bytes) for t in theirs.tensors]
        assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert ours.get("missing", 3) == 3
    assert GgufHeader(str(tmp_path / "types.gguf")).alignment == 64


def test_arrays_stay_in_the_file_until_asked_for(demo, monkeypatch):
    """The header holds where each array lies and its count, not its items; a config is
    validated (metadata, every tensor's shape) without reading one."""
    header = GgufHeader(str(demo))
    tokens = header.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, ArrayValue) and len(tokens) == 4096
    assert {k for k, v in header.fields.items() if isinstance(v, ArrayValue)} == \
        {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    held = [*vars(header).values(), *header.fields.values()]
    assert not any(isinstance(v, list | tuple | np.ndarray) and len(v) >= 4096 for v in held)
    assert header.get("tokenizer.ggml.tokens") == \
        gguf.GGUFReader(str(demo)).fields["tokenizer.ggml.tokens"].contents()

    def read(self):
        raise AssertionError(f"array of {self.count} read")

    monkeypatch.setattr(ArrayValue, "read", read)
    config = ModelConfig(model=str(demo))
    assert config.arch.vocab_size == 4096 and config.is_gguf
    assert "reader" not in vars(GgufFile(str(demo)))  # gguf's reader: the loader's only


def _patched(src: Path, dst: Path, offset: int, new: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[offset:offset + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def test_bad_headers_are_one_clear_error(demo, tmp_path):
    data = demo.read_bytes()
    arch = data.index(b"general.architecture") + len("general.architecture")  # its type u32
    norm = data.index(b"output_norm.weight") + len("output_norm.weight")  # n_dims u32, dim u64
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:2000])
    half = tmp_path / "half.gguf"
    half.write_bytes(data[:len(data) // 2])
    cases = {
        short: "not a readable GGUF file: the file ends inside its header \\(truncated\\)",
        half: "tensor 'blk.*' runs past the end of the file \\(truncated\\)",
        _patched(demo, tmp_path / "v4.gguf", 4, struct.pack("<I", 4)): "version 4",
        _patched(demo, tmp_path / "magic.gguf", 0, b"GGML"): "GGUF magic invalid",
        _patched(demo, tmp_path / "qtype.gguf", norm + 12, struct.pack("<I", 99)):
            "99 is not a valid GGMLQuantizationType",
        # fleetllm's own zero-point block types (quant/packed.py QType.Q4_ZP): never a file's
        _patched(demo, tmp_path / "zp.gguf", norm + 12, struct.pack("<I", 200)):
            "200 is not a valid GGMLQuantizationType",
        _patched(demo, tmp_path / "vtype.gguf", arch, struct.pack("<I", 99)):
            "99 is not a valid GGUFValueType",
        _patched(demo, tmp_path / "utf8.gguf", arch + 12, b"\xff"):
            "metadata 'general.architecture' is unreadable",
    }
    for path, needle in cases.items():
        with pytest.raises(ModelLoadError, match=f"{path.name}.*{needle}"):
            ModelConfig(model=str(path))
