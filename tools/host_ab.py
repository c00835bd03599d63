"""A/B of a decode step's host work from a cold cache: named functions of a git revision
against the working tree's, swapped in turn step by step in one process (old, new, new, old,
...), on a 125M-shaped bf16 checkpoint at batch 1.

    .venv/bin/python tools/host_ab.py fleetllm.worker.model_runner:ModelRunner._sample
    .venv/bin/python tools/host_ab.py --base HEAD~2 --forward-python \\
        fleetllm.worker.model_runner:ModelRunner.execute_model,ModelRunner._sample

Why: after a step streams its weights, host code runs from memory and costs tens of
microseconds, below what two processes can resolve on a machine whose bandwidth drifts. Each
step streams 200 MB through the kernels' pool in place of the model (the same evictions), its
time subtracted; --forward-python runs the real forward's Python with its two streaming ops
stubbed the same way.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def old_module(name: str, rev: str) -> types.ModuleType:
    """Module `name` as it is at git revision `rev`, loaded under another name beside it."""
    path = name.replace(".", "/") + ".py"
    src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    module = types.ModuleType("old_" + name)
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def swaps(specs: list[str], rev: str) -> list[tuple[object, str, object, object]]:
    """(owner, attribute, old, new) for each module:Name[.attr] of specs."""
    out = []
    for spec in specs:
        name, quals = spec.split(":")
        new, old = importlib.import_module(name), old_module(name, rev)
        for qual in quals.split(","):
            *owner_path, attr = qual.split(".")
            owner_new, owner_old = new, old
            for part in owner_path:
                owner_new, owner_old = getattr(owner_new, part), getattr(owner_old, part)
            new_value = (owner_new.__dict__[attr] if isinstance(owner_new, type)
                         else getattr(owner_new, attr))
            out.append((owner_new, attr, getattr(owner_old, attr), new_value))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("functions", nargs="+", help="module:Name[.attr][,Name...] to swap")
    parser.add_argument("--base", default="HEAD", help="the old version's git revision")
    parser.add_argument("--rounds", type=int, default=8, help="128-token decodes (default 8)")
    parser.add_argument("--forward-python", action="store_true",
                        help="run the forward's Python too (its streaming ops stubbed)")
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory (default: a 125M-shaped bf16 one, made)")
    parser.add_argument("--stream-mib", type=int, default=200,
                        help="what a step streams in place of the model (default 200 MiB)")
    args = parser.parse_args(argv)

    from fleetllm import LLM, SamplingParams
    from fleetllm.benchmarks.checkpoint import write_dummy_checkpoint, write_word_tokenizer
    from fleetllm.benchmarks.presets import preset_dir
    from fleetllm.kernels import cpu_kernels

    table = swaps(args.functions, args.base)
    tmp = tempfile.mkdtemp(prefix="host_ab_")
    model = args.model
    if model is None:
        model = f"{tmp}/ck"
        write_dummy_checkpoint(preset_dir("llama-125m", tmp), model, 0, torch.bfloat16)
        write_word_tokenizer(model, 32000)
    llm = LLM(model, dtype="bfloat16", kv_cache_memory=64 << 20)
    engine = llm.llm_engine
    runner = engine.model_executor.driver_worker.worker.model_runner
    if not cpu_kernels.available():
        raise SystemExit("fleetllm's CPU kernels are not available here")
    weight = torch.randn(args.stream_mib * (1 << 20) // 1536, 768).to(torch.bfloat16)
    x = torch.randn(1, 768).to(torch.bfloat16)
    streamed = [0.0]  # this step's stream, subtracted from its time

    def stream() -> None:
        start = time.perf_counter()
        cpu_kernels.gemv(x, weight, None)
        streamed[0] = time.perf_counter() - start

    kept: dict[str, torch.Tensor] = {}
    if args.forward_python:
        real_layers, real_gemm = cpu_kernels.decoder_layers, cpu_kernels.gemm_pairs

        def layers(ids, residual, *rest, **kw):
            if ids.shape[0] != 1:
                return real_layers(ids, residual, *rest, **kw)
            if "hidden" not in kept:
                kept["hidden"] = real_layers(ids, residual, *rest, **kw).clone()
            stream()
            return kept["hidden"].clone()

        def gemm(h, packed, bias, n):
            if h.shape[0] != 1:
                return real_gemm(h, packed, bias, n)
            if "logits" not in kept:
                kept["logits"] = real_gemm(h, packed, bias, n)
            return kept["logits"].clone()

        cpu_kernels.decoder_layers, cpu_kernels.gemm_pairs = layers, gemm
    else:
        real_forward = runner._forward

        def forward(batch, kv_caches):
            if batch.input_ids.shape[0] != 1 or "logits" not in kept:
                out = real_forward(batch, kv_caches)
                if batch.input_ids.shape[0] == 1:
                    kept["logits"] = out.clone()
                return out
            stream()
            return kept["logits"].clone()

        runner._forward = forward

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    times: dict[str, list[float]] = {"old": [], "new": []}
    k = 0
    try:
        for r in range(args.rounds):
            engine.add_request(f"r{r}", {"prompt_token_ids": list(range(5, 133))}, params)
            engine.step()  # the prompt
            engine.step()  # the first decode keeps the logits
            while engine.has_unfinished_requests():
                which = ("old", "new")[(k + k // 2) % 2]
                k += 1
                for owner, attr, old, new in table:
                    setattr(owner, attr, old if which == "old" else new)
                start = time.perf_counter()
                engine.step()
                times[which].append(time.perf_counter() - start - streamed[0])
    finally:  # this process's modules as they were (a test runs the tool in its own)
        for owner, attr, _, new in table:
            setattr(owner, attr, new)
        if args.forward_python:
            cpu_kernels.decoder_layers, cpu_kernels.gemm_pairs = real_layers, real_gemm
        llm.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    old, new = (statistics.median(times[w]) * 1e3 for w in ("old", "new"))
    what = "host work and forward Python" if args.forward_python else "host work"
    print(f"{what} per decode step, median of {len(times['new'])} steps each: "
          f"{args.base} {old:.3f} ms, working tree {new:.3f} ms ({new - old:+.3f} ms)")

if __name__ == "__main__":
    main()
