"""The quantized projections' C ops (csrc/quant*.cpp) against gguf's reference dequantization:
every block type fleetllm reads, at the row counts of each path (the VNNI GEMV with its two
int8 planes of x up to 8 rows, float32 unpacking, chunks dequantized for a GEMM past 16), a
packed copy of parts of mixed types, an embedding's rows, and the header's checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from fleetllm.kernels import cpu_kernels
from fleetllm.quant.blocks import quantize
from fleetllm.quant.packed import QType, QuantTensor, dequantize_packed, pack

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="kernels not built")
TYPES = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K,
         QType.Q6_K, QType.F16, QType.BF16, QType.F32]


def tensor(qtype: QType, rows: int, cols: int, seed: int) -> QuantTensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, int(qtype)).reshape(rows, -1)
    return QuantTensor(raw.view(np.uint8), qtype, (rows, cols))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_at_every_row_count(qtype):
    parts = [tensor(qtype, 40, 512, 0), tensor(qtype, 24, 512, 1)]
    packed = pack(parts)
    ref = dequantize_packed(packed).double()
    assert torch.equal(ref, torch.cat([p.dequantize() for p in parts]).double())
    bias = torch.randn(64)
    for rows in (1, 2, 3, 5, 8, 11, 40):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ ref.T + bias.double()
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
            got = cpu_kernels.gguf_linear(x.to(dtype), packed, bias.to(dtype)).double()
            assert got.dtype == torch.float64 and got.shape == (rows, 64)
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, (qtype.name, rows, dtype, err)


def test_parts_of_mixed_types_and_embedding_rows():
    parts = [tensor(QType.Q4_K, 32, 256, 2), tensor(QType.Q6_K, 16, 256, 3),
             tensor(QType.Q8_0, 8, 256, 4), tensor(QType.F16, 8, 256, 5)]
    packed = pack(parts)
    ref = dequantize_packed(packed)
    x = torch.randn(3, 256)
    got = cpu_kernels.gguf_linear(x, packed, None)
    assert ((got.double() - x.double() @ ref.double().T).norm() / got.norm()) < 1e-4
    ids = torch.tensor([0, 33, 50, 63, 7])
    assert torch.equal(cpu_kernels.gguf_rows(packed, ids, torch.float32), ref[ids])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu_kernels.gguf_rows(packed, torch.tensor([64]), torch.float32)


def test_a_corrupted_header_is_an_error_never_a_wild_read():
    packed = pack([tensor(QType.Q8_0, 4, 64, 6)])
    x = torch.randn(1, 64)
    cases = [(0, 7, "magic"), (1, 96, "row bytes"), (2, 9, "parts"), (3, 11, "block type"),
             (6, 1 << 40, "outside"), (4, 1 << 40, "outside")]
    for word, value, needle in cases:
        bad = packed.clone()
        bad[8 * word:8 * word + 8] = torch.tensor(list(struct.pack("<q", value)),
                                                  dtype=torch.uint8)
        with pytest.raises(RuntimeError, match=needle):
            cpu_kernels.gguf_linear(x, bad, None)
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels.gguf_linear(torch.randn(1, 32), packed, None)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_kernels.gguf_linear(x, packed.view(torch.int8), None)
