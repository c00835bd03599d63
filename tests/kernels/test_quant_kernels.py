"""The quantized projections' C ops (csrc/quant*.cpp) against gguf's reference dequantization:
every block type fleetllm reads, at the row counts of each path (the VNNI GEMV with its two
int8 planes of x up to 8 rows, float32 unpacking, chunks dequantized for a GEMM past 16), a
packed copy of parts of mixed types, a column permutation (act-order), an embedding's rows,
and the header's checks; fleetllm's zero-point types (Q4_ZP, Q8_ZP) against their exact
dequantization; the AVX-512 dequantizer (csrc/quant_dequant.cpp, in every x86 variant where the
CPU has AVX-512) against the generic unpacking. Run natively, with FLEETLLM_CPU_ISA=avx2 and
portable, and with FLEETLLM_QUANT_VNNI=0 for every path."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fleetllm.kernels import cpu_kernels
from fleetllm.quant.blocks import quantize
from fleetllm.quant.packed import (
    ZERO_POINT,
    QType,
    QuantTensor,
    dequantize_packed,
    pack,
    unpack,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="kernels not built")
TYPES = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K,
         QType.Q6_K, QType.F16, QType.BF16, QType.F32, QType.Q4_ZP, QType.Q8_ZP]


REPO = Path(__file__).resolve().parents[2]


def tensor(qtype: QType, rows: int, cols: int, seed: int,
           perm: np.ndarray | None = None) -> QuantTensor:
    if qtype in ZERO_POINT:
        return zero_point_tensor(qtype, rows, cols, seed, perm)[0]
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, int(qtype)).reshape(rows, -1)
    return QuantTensor(raw.view(np.uint8), qtype, (rows, cols), perm)


def zero_point_tensor(qtype: QType, rows: int, cols: int, seed: int,
                      perm: np.ndarray | None = None) -> tuple[QuantTensor, torch.Tensor]:
    """Random Q4_ZP / Q8_ZP blocks (gguf cannot quantize to them): every q and z of the type
    (Q4_ZP's z 0..16, 16 included; Q8_ZP's 0..255), scales of either sign; with the weight
    d * (q - z) in the stored column order, computed apart from the code under test."""
    rng = np.random.default_rng(seed)
    nb, top = rows * cols // 32, (16 if qtype == QType.Q4_ZP else 256)
    q = rng.integers(0, top, (nb, 32))
    z = rng.integers(0, top + (qtype == QType.Q4_ZP), nb)
    z[:2] = 0, top - (qtype == QType.Q8_ZP)  # both ends
    d = (rng.uniform(0.5, 2, nb) * rng.choice([-1, 1], nb) / top).astype(np.float16)
    body = q[:, :16] | (q[:, 16:] << 4) if qtype == QType.Q4_ZP else q
    raw = np.concatenate([d.view(np.uint8).reshape(nb, 2), z[:, None], np.zeros((nb, 1)), body],
                         axis=1).astype(np.uint8).reshape(rows, -1)
    weight = torch.from_numpy(d.astype(np.float32)[:, None] * (q - z[:, None]))
    return QuantTensor(raw, qtype, (rows, cols), perm), weight.float().reshape(rows, cols)


def set_word(packed: torch.Tensor, word: int, value: int) -> torch.Tensor:
    """A copy of packed with int64 word `word` (from the start) set to value."""
    bad = packed.clone()
    bad[8 * word:8 * word + 8] = torch.tensor(list(struct.pack("<q", value)), dtype=torch.uint8)
    return bad


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_at_every_row_count(qtype):
    parts = [tensor(qtype, 40, 512, 0), tensor(qtype, 24, 512, 1)]
    packed = pack(parts)
    ref = dequantize_packed(packed).double()
    assert torch.equal(ref, torch.cat([p.dequantize() for p in parts]).double())
    bias = torch.randn(64)
    for rows in (1, 2, 3, 5, 8, 11, 27, 40):  # 27: 8-row VNNI passes; 40: the GEMM
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ ref.T + bias.double()
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
            got = cpu_kernels.gguf_linear(x.to(dtype), packed, bias.to(dtype)).double()
            assert got.dtype == torch.float64 and got.shape == (rows, 64)
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, (qtype.name, rows, dtype, err)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_an_output_does_not_depend_on_the_rows_beside_it(qtype):
    """The decode GEMV reads weight rows in pairs for 1-2 rows of x (quant_vnni.cpp): each
    output of an odd number of rows, in parts of odd sizes, is bit for bit the output of its
    weight row alone."""
    parts = [tensor(qtype, 13, 512, 2), tensor(qtype, 6, 512, 3)]
    packed = pack(parts)
    alone = [pack([QuantTensor(p.raw[r:r + 1], p.qtype, (1, 512))]) for p in parts
             for r in range(p.shape[0])]
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        got = cpu_kernels.gguf_linear(x, packed, None)
        each = torch.cat([cpu_kernels.gguf_linear(x, a, None) for a in alone], dim=1)
        assert torch.equal(got, each), (qtype.name, rows)


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


@pytest.mark.parametrize("qtype", sorted(ZERO_POINT), ids=lambda t: t.name)
def test_zero_point_types_are_exact_at_every_path(qtype):
    """Q4_ZP / Q8_ZP: dequantize_packed and gguf_rows give d * (q - z) exactly, and gguf_linear
    is F.linear with it for float32 and bf16 x through every path (the GEMV, VNNI where the CPU
    has it, the GEMM of dequantized chunks), alone and merged with another type, with a column
    permutation and without; K = 96 (not a multiple of 64) takes the float32 unpacking."""
    for k, perm in ((512, None), (512, np.random.default_rng(3).permutation(512)), (96, None)):
        t, stored = zero_point_tensor(qtype, 40, k, 20, perm)
        weight = stored if perm is None else stored[:, torch.from_numpy(np.argsort(perm))]
        assert torch.equal(t.dequantize(), weight)
        if perm is None:  # tensor parallelism's columns, in whole blocks
            assert torch.equal(t.narrow(1, 32, 64).dequantize(), weight[:, 32:96])
        other = tensor(QType.Q4_K if k % 256 == 0 else QType.Q8_0, 24, k, 21, perm)
        for parts in ([t], [t, other], [other, t]):
            packed = pack(parts)
            ref = dequantize_packed(packed)
            assert torch.equal(ref, torch.cat([weight if p is t else p.dequantize()
                                               for p in parts]))
            bias = torch.randn(ref.shape[0])
            for rows in (1, 3, 8, 40):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                want = torch.nn.functional.linear(x.double(), ref.double(), bias.double())
                for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
                    got = cpu_kernels.gguf_linear(x.to(dtype), packed, bias.to(dtype)).double()
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < tol, (k, perm is not None, len(parts), rows, dtype, err)
            if perm is None:  # an embedding's rows: the C unpacking, exact
                ids = torch.tensor([0, 1, 39, 23, 63][:3 if len(parts) == 1 else 5])
                for dtype in (torch.float32, torch.bfloat16):
                    assert torch.equal(cpu_kernels.gguf_rows(packed, ids, dtype),
                                       ref[ids].to(dtype))


def test_a_corrupted_header_is_an_error_never_a_wild_read():
    packed = pack([tensor(QType.Q8_0, 4, 64, 6)])
    x = torch.randn(1, 64)
    # words: magic, K, parts, perm offset, then the part's type, rows, row bytes, offset
    cases = [(0, 7, "magic"), (0, 0x314B4341505146, "magic"), (1, 96, "row bytes"),
             (2, 9, "parts"), (4, 11, "block type"), (4, 202, "block type"),
             (4, 199, "block type"), (7, 1 << 40, "outside"),
             (5, 1 << 40, "outside"), (3, 1 << 40, "permutation that lies outside"),
             (3, 8, "permutation that lies outside"), (3, packed.numel() - 8, "permutation")]
    for word, value, needle in cases:
        with pytest.raises(RuntimeError, match=needle):
            cpu_kernels.gguf_linear(x, set_word(packed, word, value), None)
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels.gguf_linear(torch.randn(1, 32), packed, None)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_kernels.gguf_linear(x, packed.view(torch.int8), None)


PERM_CASES = [[QType.Q4_0], [QType.Q4_1], [QType.Q8_0], [QType.Q4_K], [QType.Q6_K],
              [QType.Q8_0, QType.Q4_1], [QType.Q4_K, QType.F16], [QType.Q4_ZP, QType.Q6_K],
              [QType.Q8_ZP, QType.Q4_0]]


@pytest.mark.parametrize("types", PERM_CASES, ids=lambda ts: "+".join(t.name for t in ts))
def test_a_column_permutation_at_every_path(types):
    """x's columns gathered by perm (act-order) before every path: the result is F.linear with
    the dequantization in x's order, for float32 and bf16 x, through the GEMV (VNNI where the
    CPU has it) and the GEMM of dequantized chunks (40 rows)."""
    k = 512
    perm = np.random.default_rng(9).permutation(k)
    parts = [tensor(t, 24 + 8 * i, k, 10 + i, perm) for i, t in enumerate(types)]
    packed = pack(parts)
    ref = dequantize_packed(packed)
    stored = torch.cat([QuantTensor(p.raw, p.qtype, p.shape).dequantize() for p in parts])
    assert torch.equal(ref[:, torch.from_numpy(perm)], stored)
    bias = torch.randn(ref.shape[0])
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = torch.nn.functional.linear(x.double(), ref.double(), bias.double())
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
            got = cpu_kernels.gguf_linear(x.to(dtype), packed, bias.to(dtype)).double()
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, (types, rows, dtype, err)


def test_a_bad_permutation_is_an_error_and_embeddings_refuse_one():
    perm = np.arange(64)[::-1].copy()
    packed = pack([tensor(QType.Q8_0, 4, 64, 6, perm)])
    assert [p.perm.tolist() for p in unpack(packed)] == [perm.tolist()]
    offset = struct.unpack("<q", bytes(packed[24:32].tolist()))[0]
    assert offset % 64 == 0 and offset >= 64
    x = torch.randn(1, 64)
    for value in (64, -1):  # one entry outside [0, K)
        with pytest.raises(RuntimeError, match=r"outside \[0, K\)"):
            cpu_kernels.gguf_linear(x, set_word(packed, offset // 8 + 5, value), None)
    with pytest.raises(RuntimeError, match="permutes its columns"):
        cpu_kernels.gguf_rows(packed, torch.tensor([0]), torch.float32)


def test_quant_tensor_permutation():
    """dequantize() is in x's column order; rows keep the perm, columns cannot be split; a
    packed copy's parts share one perm."""
    perm = np.random.default_rng(1).permutation(64)
    t = tensor(QType.Q4_1, 8, 64, 7, perm)
    plain = QuantTensor(t.raw, t.qtype, t.shape)
    out = t.dequantize()
    assert torch.equal(out[:, torch.from_numpy(perm)], plain.dequantize())
    assert torch.equal(out, plain.dequantize()[:, torch.from_numpy(np.argsort(perm))])
    rows = t.narrow(0, 2, 4)
    assert np.array_equal(rows.perm, perm) and torch.equal(rows.dequantize(), out[2:6])
    with pytest.raises(ValueError, match="permutation"):
        t.narrow(1, 0, 32)
    with pytest.raises(ValueError, match="permutation"):
        QuantTensor(t.raw, t.qtype, t.shape, np.zeros(64, np.int64))
    other = tensor(QType.Q8_0, 4, 64, 8, np.roll(perm, 1))
    for bad in ([t, other], [t, tensor(QType.Q8_0, 4, 64, 8)]):
        with pytest.raises(ValueError, match="permutation"):
            pack(bad)
    both = pack([t, tensor(QType.Q8_0, 4, 64, 8, perm.copy())])
    assert torch.equal(dequantize_packed(both)[:8], out)


_FLOAT_PATH = """
import sys, torch
from fleetllm.kernels import cpu_kernels
assert cpu_kernels.available(), "the kernels did not load"
packs, xs = torch.load(sys.argv[1])
torch.save([[cpu_kernels.gguf_linear(x, p, None) for x in xs] for p in packs], sys.argv[2])
"""


def test_vnni_agrees_with_the_float_path(tmp_path):
    """Q4_1 and the zero-point types (whose VNNI lanes subtract each block's own z) on the VNNI
    GEMV (this process, where the CPU has VNNI) against the float32 unpacking (another
    process, FLEETLLM_QUANT_VNNI=0), with and without a permutation, alone and merged."""
    perm = np.random.default_rng(2).permutation(512)
    cases = [pack([tensor(QType.Q4_1, 48, 512, 3)]),
             pack([tensor(QType.Q4_1, 32, 512, 4, perm), tensor(QType.Q4_0, 16, 512, 5, perm)]),
             pack([tensor(QType.Q4_ZP, 48, 512, 6)]), pack([tensor(QType.Q8_ZP, 48, 512, 7)]),
             pack([tensor(QType.Q4_ZP, 32, 512, 8, perm), tensor(QType.Q8_ZP, 16, 512, 9, perm),
                   tensor(QType.Q8_0, 16, 512, 10, perm)])]
    xs = [torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
          for rows in (1, 3, 8)]
    torch.save([cases, xs], tmp_path / "in.pt")
    env = {**os.environ, "FLEETLLM_QUANT_VNNI": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _FLOAT_PATH, str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    for i, (packed, floats) in enumerate(zip(cases, torch.load(tmp_path / "out.pt"),
                                             strict=True)):
        for x, want in zip(xs, floats, strict=True):
            got = cpu_kernels.gguf_linear(x, packed, None)
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert err < 1e-4, (i, x.shape[0], err)


FAST_TYPES = [QType.Q8_0, QType.Q8_ZP, QType.Q4_0, QType.Q4_1, QType.Q4_ZP, QType.Q5_0,
              QType.Q5_1, QType.Q4_K, QType.Q5_K, QType.Q6_K]
_GENERIC = """
import sys, torch
from fleetllm.kernels import cpu_kernels
assert cpu_kernels.available(), "the kernels did not load"
packs, ids, xs = torch.load(sys.argv[1])
torch.save([[cpu_kernels.gguf_rows(p, ids, d) for d in (torch.float32, torch.bfloat16)] +
            [cpu_kernels.gguf_linear(x, p, None) for x in xs] for p in packs], sys.argv[2])
"""


def test_fast_dequantizer_gives_the_generic_bits(tmp_path):
    """Every type the AVX-512 dequantizer reads (where the CPU has it; else both sides are the
    generic path), alone and merged with a type it does not read (F16: the float32 chunks),
    against the generic unpacking (another process, FLEETLLM_QUANT_FAST_DEQUANT=0): an
    embedding's rows in float32 and bf16, and the GEMM path (40 rows; bf16 x: chunks written as
    bf16 directly) bit for bit; the rows also equal dequantize_packed's."""
    cases = [pack([tensor(t, 24, 512, 30 + i), tensor(t, 16, 512, 50 + i)])
             for i, t in enumerate(FAST_TYPES)]
    cases.append(pack([tensor(QType.Q4_ZP, 24, 512, 70), tensor(QType.F16, 16, 512, 71)]))
    ids = torch.arange(40)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4))
    xs = [x, x.bfloat16()]
    torch.save([cases, ids, xs], tmp_path / "in.pt")
    env = {**os.environ, "FLEETLLM_QUANT_FAST_DEQUANT": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _GENERIC, str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    names = [t.name for t in FAST_TYPES] + ["Q4_ZP+F16"]
    for name, packed, want in zip(names, cases, torch.load(tmp_path / "out.pt"), strict=True):
        rows32 = cpu_kernels.gguf_rows(packed, ids, torch.float32)
        assert torch.equal(rows32, dequantize_packed(packed)), name
        got = [rows32, cpu_kernels.gguf_rows(packed, ids, torch.bfloat16)]
        got += [cpu_kernels.gguf_linear(x, packed, None) for x in xs]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype and torch.equal(bits(g), bits(w)), (name, i)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers (tells -0.0 from 0.0)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def w8a8_tensor(rows: int, cols: int, seed: int) -> tuple[QuantTensor, torch.Tensor]:
    """W8A8 (quant/groups.py): Q8_0 blocks of one fp16 scale a row, flagged for int8
    activations; with the weight, computed apart from the code under test."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
    d = (rng.uniform(0.5, 2, rows) / 127).astype(np.float16)
    blocks = np.concatenate([np.repeat(d.view(np.uint8).reshape(rows, 1, 2), cols // 32, 1),
                             q.view(np.uint8).reshape(rows, cols // 32, 32)], axis=2)
    w = torch.from_numpy(d.astype(np.float32))[:, None] * torch.from_numpy(q.astype(np.float32))
    return QuantTensor(blocks.reshape(rows, -1), QType.Q8_0, (rows, cols), None, True), w


def int8_per_row(x: torch.Tensor) -> torch.Tensor:
    scale = x.float().abs().amax(1, keepdim=True) / 127
    return torch.round(x.float() / scale.clamp_min(torch.finfo(torch.float32).tiny)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_rounds_x_to_int8_per_row_at_every_path(dtype):
    """A W8A8 copy's x is rounded to int8 per row (scale max |x| / 127), as the format does, on
    the GEMV (VNNI: one int8 plane, integer sums; elsewhere float) and the int8 GEMM past it
    (at::_int_mm), merged parts included; a zero row stays zero. The flag survives
    pack/unpack; on a part that is not Q8_0 it is an error."""
    (a, wa), (b, wb) = w8a8_tensor(96, 512, 1), w8a8_tensor(32, 512, 2)
    packed, w = pack([a, b]), torch.cat([wa, wb])
    assert all(p.int8_activations for p in unpack(packed))
    assert not any(p.int8_activations for p in unpack(pack([a, tensor(QType.Q8_0, 8, 512, 3)])))
    for rows in (1, 3, 8, 12, 13, 33, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
        x[-1] = 0 if rows > 1 else x[-1]
        got = cpu_kernels.gguf_linear(x, packed, None).double()
        want = int8_per_row(x).double() @ w.double().T
        err = ((got - want).norm() / want.norm()).item()
        assert err < (4e-3 if dtype == torch.bfloat16 else 1e-6), (rows, err)
        assert rows == 1 or torch.all(got[-1] == 0)
    words = bytearray(packed.numpy().tobytes())
    struct.pack_into("<q", words, 32, int(QType.Q4_0))  # part 0's type, the flag still set
    with pytest.raises(RuntimeError, match="W8A8"):
        cpu_kernels.gguf_linear(torch.ones(1, 512),
                                torch.frombuffer(words, dtype=torch.uint8).clone(), None)
