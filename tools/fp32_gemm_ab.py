"""float32 projections: oneDNN's packed weights (what fleetllm runs: `mkldnn::_linear_pointwise`
on `_reorder_linear_weight(w, None)`) against MKL's packed sgemm (`cblas_sgemm_pack` once,
`cblas_sgemm_compute` at any row count), in one process, taking turns shape by shape.

    .venv/bin/python tools/fp32_gemm_ab.py [--rows 16,64,256,512,1024,2048] [--rounds 6]

Why in one process: the machine's speed drifts between runs more than the difference measured.
torch's own `mkl::_mkl_linear` uses its packing only at the row count it was packed for, so
MKL's packed B is called directly. Prints, per row count, each of the 125M preset's shapes'
GFLOP/s both ways, the ratio of the totals (oneDNN / MKL: above 1, MKL is faster), and for
how many shapes MKL's product was F.linear's bit for bit (always within float32 rounding).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

# (N, K) of the 125M preset's projections: q/o, qkv, gate/up, down, and the LM head.
SHAPES = [(768, 768), (2304, 768), (3072, 768), (768, 3072), (32000, 768)]
# MKL's CBLAS enum values (mkl_cblas.h): row-major, no transpose, transpose, matrix B, packed.
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151


def _mkl() -> ctypes.CDLL | None:
    """libtorch_cpu with MKL's packed-sgemm entry points typed, or None without them (or
    where the library has another name than Linux's)."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None
    if not hasattr(lib, "cblas_sgemm_compute"):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    return lib


def mkl_packed(lib: ctypes.CDLL, w: torch.Tensor):
    """x -> x @ w.T by MKL's packed sgemm: w packed once (for 256 rows; the packing serves
    any row count)."""
    n, k = w.shape
    buf = torch.empty((lib.cblas_sgemm_pack_get_size(_B_MATRIX, 256, n, k) + 3) // 4)
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 256, n, k, 1.0, w.data_ptr(), k,
                         buf.data_ptr())

    def linear(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], n)
        lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, x.shape[0], n, k, x.data_ptr(),
                                k, buf.data_ptr(), k, 0.0, out.data_ptr(), n)
        return out

    return linear


def _seconds(f, x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        f(x)
    return (time.perf_counter() - start) / reps


def compare(lib: ctypes.CDLL, rows: int, rounds: int, reps: int
            ) -> tuple[list[tuple[float, float]], float, int]:
    """[(oneDNN GFLOP/s, MKL GFLOP/s)] per shape, oneDNN's total time over MKL's (the best
    of `rounds` for each call), and how many shapes' MKL products were F.linear's bits."""
    calls, same = [], 0
    for n, k in SHAPES:
        w, x = torch.randn(n, k), torch.randn(rows, k)
        dnnl_w = torch.ops.mkldnn._reorder_linear_weight(w, None)

        def dnnl(x, pw=dnnl_w):
            return torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")

        mkl = mkl_packed(lib, w)
        got, want = mkl(x), torch.nn.functional.linear(x, w)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # the same product
        same += torch.equal(got, want)
        calls.append((dnnl, mkl, x, 2.0 * rows * n * k))
    best = [[float("inf"), float("inf")] for _ in calls]
    for _ in range(rounds):
        for i, (dnnl, mkl, x, _flops) in enumerate(calls):
            best[i][0] = min(best[i][0], _seconds(dnnl, x, reps))
            best[i][1] = min(best[i][1], _seconds(mkl, x, reps))
    rates = [(c[3] / b[0] / 1e9, c[3] / b[1] / 1e9) for c, b in zip(calls, best, strict=True)]
    return rates, sum(b[0] for b in best) / sum(b[1] for b in best), same


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=10, help="calls per timing")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    lib = _mkl() if torch.backends.mkl.is_available() else None
    if lib is None:
        raise SystemExit("this torch exports no MKL packed sgemm")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    for rows in (int(r) for r in args.rows.split(",")):
        rates, ratio, same = compare(lib, rows, args.rounds, args.reps)
        shapes = "  ".join(f"{n}x{k}: {d:.0f} / {m:.0f}"
                           for (n, k), (d, m) in zip(SHAPES, rates, strict=True))
        print(f"rows {rows}: GFLOP/s oneDNN / MKL  {shapes}  | MKL = F.linear bit for bit "
              f"{same}/{len(SHAPES)}  | oneDNN time / MKL time {ratio:.2f}")


if __name__ == "__main__":
    main()
