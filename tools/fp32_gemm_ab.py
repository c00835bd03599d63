"""float32 projections: oneDNN's packed weights (what fleetllm runs, `mkldnn::_linear_pointwise`)
against MKL's packed sgemm (`mkl::_mkl_linear`), in one process, taking turns shape by shape.

Why: on the 2-core AMX Xeon (2026-11-29) vLLM's CPU build ran the float32 125M round 1.2x
faster than fleetllm, whose round is ~78% oneDNN float32 GEMMs; vLLM's own oneDNN matmul
(`onednn_mm`, float32: errors of 8e-7 against float64, as torch's) measured 233-262 GFLOP/s
on these shapes where torch's packed oneDNN measured 185-229. This tool measures the one
alternative inside torch. Two processes a minute apart cannot compare them on this machine
(the same code moved 200 -> 290 GFLOP/s between runs), so each shape's two calls alternate.

    .venv/bin/python tools/fp32_gemm_ab.py [--rows 16,64,256,512,1024,2048] [--rounds 6]

Prints, per row count, each shape's GFLOP/s both ways and the ratio of the totals' times
(oneDNN / MKL: above 1, MKL's packed sgemm is faster). The 125M preset's layer shapes and
its LM head; weights packed for the row count, as fleetllm packs them for the step's size.
"""

from __future__ import annotations

import argparse
import time

import torch

# (N, K) of the 125M preset's projections: q/o, qkv, gate/up, down, and the LM head.
SHAPES = [(768, 768), (2304, 768), (3072, 768), (768, 3072), (32000, 768)]


def _seconds(f, x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        f(x)
    return (time.perf_counter() - start) / reps


def compare(rows: int, rounds: int, reps: int) -> tuple[list[tuple[float, float]], float]:
    """[(oneDNN GFLOP/s, MKL GFLOP/s)] per shape, and oneDNN's total time over MKL's (the
    best of `rounds` for each call)."""
    calls = []
    for n, k in SHAPES:
        w, x = torch.randn(n, k), torch.randn(rows, k)
        dnnl_w = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)

        def dnnl(x, pw=dnnl_w):
            return torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")

        def mkl(x, pw=mkl_w, w=w):
            return torch.ops.mkl._mkl_linear(x, pw, w, None, rows)

        torch.testing.assert_close(mkl(x), dnnl(x), rtol=1e-4, atol=1e-3)  # the same product
        calls.append((dnnl, mkl, x, 2.0 * rows * n * k))
    best = [[float("inf"), float("inf")] for _ in calls]
    for _ in range(rounds):
        for i, (dnnl, mkl, x, _flops) in enumerate(calls):
            best[i][0] = min(best[i][0], _seconds(dnnl, x, reps))
            best[i][1] = min(best[i][1], _seconds(mkl, x, reps))
    rates = [(c[3] / b[0] / 1e9, c[3] / b[1] / 1e9) for c, b in zip(calls, best, strict=True)]
    return rates, sum(b[0] for b in best) / sum(b[1] for b in best)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=10, help="calls per timing")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not hasattr(torch.ops.mkl, "_mkl_linear") or not torch.backends.mkl.is_available():
        raise SystemExit("this torch has no MKL packed sgemm")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    for rows in (int(r) for r in args.rows.split(",")):
        rates, ratio = compare(rows, args.rounds, args.reps)
        shapes = "  ".join(f"{n}x{k}: {d:.0f} / {m:.0f}"
                           for (n, k), (d, m) in zip(SHAPES, rates, strict=True))
        print(f"rows {rows}: GFLOP/s oneDNN / MKL  {shapes}  | oneDNN time / MKL time {ratio:.2f}")


if __name__ == "__main__":
    main()
