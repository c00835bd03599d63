"""How each projection computes x @ W^T (+ bias) here: one LinearKernel per projection and LM
head, chosen once after loading by `select_kernels` (as vLLM's dispatch_cpu_unquantized_gemm).

Kinds: TorchLinear (F.linear: CUDA, other dtypes, no packing), Gemv (the dense weight through
the kernels' GEMV for a few rows, then another kernel), OneDnn (oneDNN's packed copy; float32
for bf16 where oneDNN packs no bf16), Mkl (MKL's packed sgemm: float32 on Intel), Pairs and
Amx (bf16 packed for the kernels' GEMMs: csrc/gemm.cpp, gemm_amx.cpp), SmallBatches (Pairs
or Amx for a few rows beside oneDNN on AMX CPUs) and Gguf (a GGUF file's blocks, set by the
loader). Modules call `kernel(x, bias)`; the one-call decode paths (fused.py) read
`for_rows(rows)`'s `tensor` and `kind` (cpu_kernels.LinearKind). Every packed copy is checked
against F.linear when chosen; a failed packing leaves F.linear (one warning). A new weight
format is one class here and its C op. Measured reasons for each choice: docs/performance.md.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn.functional as F

from fleetllm import envs
from fleetllm.kernels import cpu_kernels
from fleetllm.kernels.cpu_kernels import LinearKind

GEMV_ROWS = 4  # module calls up to this many rows read the dense weight (see gemv_limits)


class LinearKernel:
    """x @ W^T (+ bias) for one projection. `kind`/`tensor`: what the C ops read of this copy
    (kind None: not one they read); gemv_rows / decode_rows: up to how many rows module calls /
    decode steps' one call and the LM head read the dense weight instead (Gemv only)."""

    kind: ClassVar[LinearKind | None] = None
    gemv_rows = 0
    decode_rows = 0

    def __init__(self, tensor: torch.Tensor, out_features: int):
        self.tensor = tensor
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = self.matmul(x if x.dim() == 2 else x.reshape(-1, shape[-1]), bias)
        return y if len(shape) == 2 else y.view(*shape[:-1], y.shape[-1])

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias): the same as calling the kernel."""
        return self(x, bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias)."""
        raise NotImplementedError

    def for_rows(self, rows: int) -> LinearKernel:
        """The copy that computes `rows` rows (past the dense weight's rows)."""
        return self

    def copies(self) -> list[LinearKernel]:
        """The packed copies this kernel holds (each checked against F.linear)."""
        return [self]

    @property
    def nbytes(self) -> int:
        """The memory of the copies held beside the module's parameters."""
        return self.tensor.numel() * self.tensor.element_size()

    def to_dense(self) -> torch.Tensor:
        """The [N, K] weight, in the checkpoint's dtype (sharded_state saves it)."""
        raise NotImplementedError


class TorchLinear(LinearKernel):
    """F.linear on the module's weight as it is at the call (CUDA, dtypes the kernels lack,
    nothing packed; a module's kernel until select_kernels, which may follow a re-tied
    weight)."""

    def __init__(self, module: torch.nn.Module):  # (no packed tensor of its own)
        self.module = module

    @property
    def tensor(self) -> torch.Tensor:
        return self.module.weight

    @property
    def out_features(self) -> int:
        return self.module.weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.module.weight, bias)

    def copies(self) -> list[LinearKernel]:
        return []

    @property
    def nbytes(self) -> int:
        return 0

    def to_dense(self) -> torch.Tensor:
        return self.module.weight


class Gemv(LinearKernel):
    """The kernels' GEMV on the dense weight up to `rows` rows (float32 sums, rows
    independent), `rest` past them."""

    kind = LinearKind.GEMV

    def __init__(self, weight: torch.Tensor, rest: LinearKernel, rows: int, decode_rows: int):
        super().__init__(weight, weight.shape[0])
        self.rest, self.gemv_rows, self.decode_rows = rest, rows, decode_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.gemv_rows and x.is_contiguous() and \
                cpu_kernels.usable(x, self.tensor):
            return cpu_kernels.gemv(x, self.tensor, bias)
        return self.rest(x, bias)

    def for_rows(self, rows: int) -> LinearKernel:
        return self.rest.for_rows(rows)

    def copies(self) -> list[LinearKernel]:
        return self.rest.copies()

    @property
    def nbytes(self) -> int:
        return self.rest.nbytes

    def to_dense(self) -> torch.Tensor:
        return self.tensor


class OneDnn(LinearKernel):
    """oneDNN's packed copy (an opaque MkldnnCPU tensor). A bf16 weight on a CPU where oneDNN
    packs no bf16 (AVX2) gets a float32 copy: rows widened, the result rounded once."""

    kind = LinearKind.ONEDNN

    def __init__(self, weight: torch.Tensor):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        except RuntimeError:
            if weight.dtype != torch.bfloat16:
                raise
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), None)
        super().__init__(packed, weight.shape[0])
        self.dtype = weight.dtype

    @property
    def widened(self) -> bool:
        return self.tensor.dtype != self.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.widened:
            return torch.ops.mkldnn._linear_pointwise(
                x.float().contiguous(), self.tensor, None if bias is None else bias.float(),
                "none", [None], "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.tensor, bias, "none",
                                                  [None], "")

    def to_dense(self) -> torch.Tensor:
        return self.tensor.to_dense().to(self.dtype)


class Mkl(LinearKernel):
    """A float32 weight in MKL's packed layout (cblas_sgemm_pack; csrc/mkl_sgemm.cpp): faster
    than oneDNN on Intel CPUs, F.linear's bits for most shapes. MKL cannot unpack: chosen only
    where the dense weight stays (Gemv's)."""

    kind = LinearKind.MKL

    def __init__(self, weight: torch.Tensor):
        super().__init__(cpu_kernels.mkl_pack(weight.contiguous()), weight.shape[0])
        self.in_features = weight.shape[1]

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return (weight.dtype == torch.float32 and weight.device.type == "cpu"
                and weight.dim() == 2 and cpu_kernels.mkl_available())

    @property
    def nbytes(self) -> int:
        # What MKL touches of its buffer: the weight's float32 bytes (it reserves more).
        return self.out_features * self.in_features * 4

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_kernels.mkl_linear(x.contiguous(), self.tensor, bias, self.out_features)


class Pairs(LinearKernel):
    """bf16 [N, K] packed by pairs, [ceil(N/48), K/2, 48, 2] (zero rows past N): panels of 48
    outputs with k-pairs in the order csrc/gemm.cpp reads them, one stream a thread. Each
    output is one lane summed in k order: a row's bits do not depend on its batch."""

    kind = LinearKind.PAIRS
    PANEL = 48  # csrc/kernels.h PAIR_PANEL
    SMALL_ROWS = 4  # as SmallBatches' copy beside oneDNN: up to this many rows

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.shape[1] % 2 == 0
                and cpu_kernels.gemm_pairs_available())

    @staticmethod
    def size(weight: torch.Tensor) -> int:
        """The bytes of weight's packed copy."""
        n, k = weight.shape
        return -(-n // Pairs.PANEL) * Pairs.PANEL * k * weight.element_size()

    @classmethod
    def pack(cls, weight: torch.Tensor, out: torch.Tensor | None = None) -> Pairs:
        """Into `out` (size(weight) uint8: a slice of the huge-page arena) or new memory."""
        n, k = weight.shape
        padded = -(-n // cls.PANEL) * cls.PANEL
        panels = F.pad(weight, (0, 0, 0, padded - n)).view(padded // cls.PANEL, cls.PANEL,
                                                           k // 2, 2)
        shape = (padded // cls.PANEL, k // 2, cls.PANEL, 2)
        data = torch.empty(shape, dtype=weight.dtype) if out is None else \
            out.view(weight.dtype).view(shape)
        data.copy_(panels.permute(0, 2, 1, 3))
        return cls(data, n)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_kernels.gemm_pairs(x.contiguous(), self.tensor, bias, self.out_features)

    def to_dense(self) -> torch.Tensor:
        panels, pairs = self.tensor.shape[:2]
        dense = self.tensor.permute(0, 2, 1, 3).reshape(panels * self.PANEL, pairs * 2)
        return dense[:self.out_features].contiguous()


class Amx(LinearKernel):
    """bf16 [N, K] packed for AMX tiles, [N/32, K/32, 2, 16, 32]: per 32 outputs and 32 k, two
    B tiles in the VNNI layout TDPBF16PS reads (csrc/gemm_amx.cpp). Faster than oneDNN's AMX
    matmul on decode batches, with the same sums; oneDNN's cache blocking wins from ~128 rows."""

    kind = LinearKind.AMX
    MAX_ROWS = 64  # as SmallBatches' copy beside oneDNN: up to this many rows

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.shape[0] % 32 == 0
                and weight.shape[1] % 32 == 0 and cpu_kernels.amx_available())

    @classmethod
    def pack(cls, weight: torch.Tensor, out: torch.Tensor | None = None) -> Amx:
        """Element (n, k) at [n // 32, k // 32, n % 32 // 16, k % 32 // 2, (n % 16) * 2 + k % 2];
        into `out` (at least N * K * 2 uint8) or new memory."""
        n, k = weight.shape
        shape = (n // 32, k // 32, 2, 16, 32)
        data = torch.empty(shape, dtype=weight.dtype) if out is None else \
            out[:n * k * weight.element_size()].view(weight.dtype).view(shape)
        data.view(n // 32, k // 32, 2, 16, 16, 2).copy_(
            weight.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5))
        return cls(data, n)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_kernels.gemm_amx(x.contiguous(), self.tensor, bias, self.out_features)

    def to_dense(self) -> torch.Tensor:
        p, kb = self.tensor.shape[:2]
        return (self.tensor.view(p, kb, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5)
                .reshape(p * 32, kb * 32).contiguous())


class SmallBatches(LinearKernel):
    """On CPUs where oneDNN runs on AMX: batches of up to `rows` rows read `small` (Amx, or
    Pairs where the sizes do not suit the tiles), larger ones oneDNN's copy."""

    def __init__(self, small: Pairs | Amx, large: OneDnn):
        super().__init__(small.tensor, small.out_features)
        self.small, self.large = small, large
        self.rows = Amx.MAX_ROWS if isinstance(small, Amx) else Pairs.SMALL_ROWS

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return (self.small if x.numel() <= self.rows * x.shape[-1] else self.large)(x, bias)

    def for_rows(self, rows: int) -> LinearKernel:
        return self.small if rows <= self.rows else self.large

    def copies(self) -> list[LinearKernel]:
        return [self.small, self.large]

    @property
    def nbytes(self) -> int:
        return self.small.nbytes + self.large.nbytes

    def to_dense(self) -> torch.Tensor:
        return self.large.to_dense()


class Gguf(LinearKernel):
    """A quantized weight as GGUF's blocks behind a header (fleetllm/quant/packed.py): the
    kernels' gguf_linear (csrc/quant.cpp: the blocks unpacked in registers, float32 sums; a
    prompt's rows through chunks dequantized for a GEMM). Where the kernels do not run (no
    build, CUDA), each call dequantizes it (gguf's numpy) and runs F.linear: nothing
    dequantized is kept."""

    kind = LinearKind.GGUF

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.gguf_linear(x.contiguous(), self.tensor, bias)
        from fleetllm.quant.packed import dequantize_packed, int8_activations, int8_rounded
        w = dequantize_packed(self.tensor).to(device=x.device, dtype=x.dtype)
        if int8_activations(self.tensor):  # W8A8: x as the format quantizes it
            x = int8_rounded(x).to(x.dtype)
        return F.linear(x, w, bias)

    def to_dense(self) -> torch.Tensor:
        from fleetllm.quant.packed import dequantize_packed
        return dequantize_packed(self.tensor)


def gemv_limits(rest: LinearKernel, head: bool) -> tuple[int, int]:
    """(module calls', decode steps') row limits of the GEMV beside `rest`. The decode limit is
    where the GEMV beats oneDNN's packed copy (8 rows; 16 where the copy is a float32 one of a
    bf16 weight: the GEMV reads half the bytes). Module calls stop at GEMV_ROWS, so that a
    5-8 token prompt gives the same bits alone in its step or beside others (embeddings); the
    LM head takes the decode limit everywhere."""
    decode = 16 if isinstance(rest, OneDnn) and rest.widened else 8
    return (decode if head else GEMV_ROWS), decode


def batch_invariant() -> bool:
    """FLEETLLM_BATCH_INVARIANT=1: bf16 projections read only the kernels' own copy (Pairs or
    Amx) at every number of rows, so a row's bits do not depend on its batch (vLLM's
    VLLM_BATCH_INVARIANT; docs/spec_decode.md, "bf16")."""
    return envs.get("FLEETLLM_BATCH_INVARIANT")


@functools.cache
def onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 weights on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); else a bf16
    weight's OneDnn copy is float32."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except (RuntimeError, AttributeError):
        return False
    return True


@functools.cache
def onednn_amx() -> bool:
    """oneDNN's bf16 matmul runs on AMX tiles on this CPU (torch enables them at start)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init is not None and init() and torch.backends.mkldnn.is_available())
