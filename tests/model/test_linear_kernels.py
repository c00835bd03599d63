"""Each projection's kernel (fleetllm/model/linear_kernels.py), chosen once after loading by
kernel_choice.select_kernels: every kind computes F.linear and gives its weight back, the
step path never decides again, and no other module decides it (tests/kernels/test_kernels.py checks
that the C ops read each copy by the kind it names)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fleetllm.kernels import cpu_kernels
from fleetllm.model import kernel_choice, layers
from fleetllm.model import linear_kernels as lk

BF16 = torch.bfloat16


def _kernels(weight: torch.Tensor) -> dict[str, lk.LinearKernel]:
    """Every kernel this CPU can build for `weight`, as select_kernels builds them."""
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    out: dict[str, lk.LinearKernel] = {"torch": lk.TorchLinear(module)}
    if not torch.backends.mkldnn.is_available():
        return out
    onednn = out["onednn"] = lk.OneDnn(weight)
    if cpu_kernels.usable(weight):
        out["gemv"] = lk.Gemv(weight, onednn, *lk.gemv_limits(onednn, head=False))
    if lk.Mkl.applies(weight):
        out["mkl"] = lk.Mkl(weight)
    if lk.Pairs.applies(weight):
        out["pairs"] = lk.Pairs.pack(weight)
        out["small-pairs"] = lk.SmallBatches(out["pairs"], onednn)
    if lk.Amx.applies(weight):
        out["amx"] = lk.Amx.pack(weight)
        out["small-amx"] = lk.SmallBatches(out["amx"], onednn)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_every_kernel_computes_f_linear_and_gives_its_weight_back(dtype):
    """Each kind this CPU has: x @ W^T + b within the dtype's rounding at the GEMV's rows, the
    small batches' and past them (2-D and 3-D x), the dense weight back (not MKL's: it cannot
    unpack, so it is chosen only where the dense weight stays), its own bytes counted, and
    for_rows naming a copy the C ops read (TorchLinear: none)."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 128, generator=g) * 0.1).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    kernels = _kernels(weight)
    for name, kernel in kernels.items():
        for rows in (1, 5, 70):
            x = torch.randn(rows, 128, generator=g).to(dtype)
            want = F.linear(x.float(), weight.float(), bias.float())
            torch.testing.assert_close(kernel(x, bias).float(), want, rtol=tol, atol=tol,
                                       msg=lambda m, name=name, rows=rows: f"{name} {rows}: {m}")
            assert torch.equal(kernel.apply(x, bias), kernel(x, bias)), name
            # (3-D x: the GEMV takes 2-D rows only, so a Gemv hands it to its rest)
            torch.testing.assert_close(kernel(x.view(1, rows, 128), bias)[0].float(), want,
                                       rtol=tol, atol=tol)
            copy = kernel.for_rows(rows)
            assert (copy.kind is None) == (name == "torch"), name
        if name == "mkl":
            with pytest.raises(NotImplementedError):
                kernel.to_dense()
        else:
            assert torch.equal(kernel.to_dense(), weight), name
        assert (kernel.nbytes > 0) == (name != "torch"), name
    assert {"torch", "onednn"} <= set(kernels) or not torch.backends.mkldnn.is_available()


def test_the_kernel_is_chosen_once_not_per_call(monkeypatch):
    """After select_kernels nothing on the step path decides a projection's route again: with
    every input of the choice broken, the projections still compute."""
    g = torch.Generator().manual_seed(1)
    model = nn.ModuleList([layers.ColumnParallelLinear(64, [(96, 96, 0)], bias=True),
                           layers.RowParallelLinear(96, 64, bias=False)])
    for m in model:
        m.weight.data = torch.randn(m.weight.shape, generator=g)
        if m.bias is not None:
            m.bias.data = torch.randn(m.bias.shape, generator=g)
    want = model[1](model[0](torch.ones(3, 64)))
    kernel_choice.select_kernels(model)
    kinds = [type(m.kernel) for m in model]

    def broken(*args, **kwargs):
        raise AssertionError("a projection's kernel was chosen again")

    for name in ("_plan", "_pack", "_can_pack"):
        monkeypatch.setattr(kernel_choice, name, broken)
    for name in ("onednn_amx", "onednn_packs_bf16", "batch_invariant", "gemv_limits"):
        monkeypatch.setattr(lk, name, broken)
    for cls in (lk.Pairs, lk.Amx, lk.Mkl):
        monkeypatch.setattr(cls, "applies", broken)
    for rows in (1, 3, 40):
        x = torch.ones(rows, 64)
        torch.testing.assert_close(model[1](model[0](x)), want[:1].expand(rows, -1),
                                   rtol=1e-4, atol=1e-4)
    assert [type(m.kernel) for m in model] == kinds


def test_only_the_choice_builds_kernels():
    """A projection's route is decided in one place: no module of the package but
    linear_kernels.py and kernel_choice.py packs a weight or tests a kernel's class."""
    from pathlib import Path

    import fleetllm

    root = Path(fleetllm.__file__).parent
    allowed = {root / "model" / "linear_kernels.py", root / "model" / "kernel_choice.py",
               root / "benchmarks" / "workload.py", root / "benchmarks" / "lora_layer.py"}
    needles = ("_reorder_linear_weight", "isinstance(kernel", "Pairs.pack(", "Amx.pack(",
               "Mkl(", "OneDnn(", "_linear_pointwise")
    found = [f"{p.relative_to(root)}: {n}" for p in root.rglob("*.py") if p not in allowed
             for n in needles if n in p.read_text()]
    assert not found, found
