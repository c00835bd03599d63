"""Micro-benchmark of the LoRA delta (fleetllm/lora/layers.py) on one decoder layer's attention
projections of the 125M preset, 8 adapters of rank 16 on q/k/v/o, tokens spread evenly over
them: the base projections alone (oneDNN-packed, as the model runs them) against the base plus
each way to add the deltas.

    python -m fleetllm.benchmarks.lora_layer [--tokens 1 8 64 256 1024] [--adapters 8]
        [--threads 1] [--prefill]

Ways: grouped (ours: rows grouped by slot, two bmm and an index_add), masked (one GEMM over
every slot, a one-hot zeroing the others), loop (a Python loop over adapter groups: SGMV's
shape), gather (each token's A and B gathered: BGMV's shape). Prints milliseconds per layer's
q/k/v/o projections and each way's overhead on the base (the tables in docs/lora.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fleetllm.lora import layers as lora_layers
from fleetllm.model.linear_kernels import OneDnn

HIDDEN, QKV_PARTS, RANK = 768, [768, 256, 256], 16
METHODS = ("grouped", "masked", "loop", "gather")


def _packed(out: int, inp: int, gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """The projection as fleetllm runs it past a few rows: oneDNN's packed copy (or F.linear)."""
    weight = torch.randn(out, inp, generator=gen) * 0.02
    if torch.backends.mkldnn.is_available():
        return OneDnn(weight)
    return lambda x: torch.nn.functional.linear(x, weight)


def _timed(fns: dict, repeat: int, rounds: int = 7) -> dict[str, float]:
    """Best milliseconds per call of each function, the functions interleaved round by round
    (so a burst of load elsewhere on the machine hits them alike)."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / repeat * 1e3)
    return best


def run(tokens: list[int], adapters: int, repeat: int, prefill: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    qkv, o = _packed(sum(QKV_PARTS), HIDDEN, gen), _packed(HIDDEN, HIDDEN, gen)
    cpu = torch.device("cpu")
    slots = {"qkv": lora_layers.LoRASlots(HIDDEN, QKV_PARTS, adapters, RANK, torch.float32, cpu),
             "o": lora_layers.LoRASlots(HIDDEN, [HIDDEN], adapters, RANK, torch.float32, cpu)}
    for s in range(adapters):
        for sl in slots.values():
            sl.set(s, [(torch.randn(sl.in_size, RANK, generator=gen) * 0.05,
                        torch.randn(RANK, n, generator=gen) * 0.05) for n in sl.part_sizes])
    flat = {k: (sl.a.permute(1, 0, 2).reshape(sl.in_size, -1), _block_diagonal(sl))
            for k, sl in slots.items()}
    pairs = ((qkv, "qkv"), (o, "o"))
    return [_case(t, gen, slots, flat, pairs, adapters, repeat, prefill) for t in tokens]


def _block_diagonal(sl: lora_layers.LoRASlots) -> torch.Tensor:
    """Every slot's parts' B as one [slots * parts * R, out] matrix (for masked and gather)."""
    n, r = len(sl.b), sl.rank
    out = torch.zeros(sl.a.shape[0], n * r, sum(sl.part_sizes))
    for p, (b, off, size) in enumerate(zip(sl.b, sl.offsets, sl.part_sizes, strict=True)):
        out[:, p * r:(p + 1) * r, off:off + size] = b
    return out


def _case(t: int, gen: torch.Generator, slots: dict, flat: dict, pairs: tuple, adapters: int,
          repeat: int, prefill: bool) -> dict:
    """One batch size: every method checked against ours, then timed."""
    cpu = torch.device("cpu")
    x = torch.randn(t, HIDDEN, generator=gen)
    if prefill:  # prompts of 18-255 tokens, adapters round-robin: uneven groups
        spans, total = [], 0
        while total < t:
            spans.append(min(t - total, int(torch.randint(18, 256, (1,), generator=gen))))
            total += spans[-1]
        index = torch.cat([torch.full((n,), i % adapters) for i, n in enumerate(spans)])
    else:  # one token per sequence, adapters round-robin: even groups
        index = torch.arange(t) % adapters
    step = lora_layers.LoRAStep.build(index.tolist(), torch.float32, cpu)
    m = int(index.max()) + 1
    onehot = (index[:, None] == torch.arange(m)[None, :]).float()

    def base():
        return [layer(x) for layer, _ in pairs]

    def grouped():
        lora_layers.set_step(step)
        try:
            return [slots[k].apply(x, layer(x)) for layer, k in pairs]
        finally:
            lora_layers.set_step(None)

    def masked():
        out = []
        for layer, k in pairs:
            a, b = flat[k]
            b = b.view(-1, b.shape[-1])
            width = a.shape[1] // adapters * m
            xa = (x @ a[:, :width]).view(t, m, -1).mul_(onehot[:, :, None])
            out.append(layer(x).addmm_(xa.view(t, width), b[:width]))
        return out

    def loop():
        order = torch.argsort(index, stable=True)
        counts = torch.bincount(index, minlength=adapters).tolist()
        out = []
        for layer, k in pairs:
            y, sl, start = layer(x), slots[k], 0
            for s, n in enumerate(counts):
                if n:
                    rows_s = order[start:start + n]
                    start += n
                    y.index_add_(0, rows_s,
                                 x.index_select(0, rows_s) @ sl.a[s] @ flat[k][1][s])
            out.append(y)
        return out

    def gather():
        out = []
        for layer, k in pairs:
            sl = slots[k]
            xa = torch.bmm(x.unsqueeze(1), sl.a[index])
            out.append(layer(x) + torch.bmm(xa, flat[k][1][index]).squeeze(1))
        return out

    ref = grouped()
    for fn in (masked, loop, gather):
        for got, want in zip(fn(), ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    n = max(3, repeat * 64 // max(t, 64))
    fns = {fn.__name__: fn for fn in (base, grouped, masked, loop, gather)}
    return {"tokens": t, **_timed(fns, n)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--prefill", action="store_true",
                        help="tokens in prompts of 18-255 (uneven groups) instead of one per "
                             "sequence")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; {args.adapters} adapters, rank {RANK}, "
          "ms per layer's q/k/v/o projections (overhead on base)")
    print(f"{'tokens':>7} {'base':>8} " + " ".join(f"{k:>16}" for k in METHODS))
    for row in run(args.tokens, args.adapters, args.repeat, args.prefill):
        cells = [f"{row[k]:8.3f} ({row[k] / row['base'] - 1:+5.0%})"
                 for k in METHODS]
        print(f"{row['tokens']:>7} {row['base']:8.3f} " + " ".join(cells))


if __name__ == "__main__":
    main()
