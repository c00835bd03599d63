"""Perplexity on held-out text: what a format (GGUF Q4_K_M, Q8_0, ...) costs on a model.

    fleetllm bench perplexity --model M [--text FILE ...] [--window 512] [--compare llamacpp]

The text (default: the demo model's held-out files, from this Python's standard library) is
tokenized by the model's tokenizer and cut into windows of --window tokens; as llama.cpp's
llama-perplexity does, each window is one prompt and only its second half is scored, so every
scored token sees at least window / 2 tokens before it. The log-probabilities are the engine's
prompt_logprobs. --compare llamacpp runs llama-perplexity (`make llamacpp`) on the same GGUF
file and text with the same window (its own tokenizer, from the file's metadata).
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sysconfig
from pathlib import Path

from fleetllm.engine.arg_utils import add_engine_args, engine_kwargs_from, resolve_model

DEMO = Path(__file__).resolve().parents[1] / "demo_model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", nargs="*", default=None,
                        help="text files (default: the demo model's held-out stdlib files)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--max-windows", type=int, default=None, help="score at most this many")
    parser.add_argument("--compare", default="none", choices=["none", "llamacpp"],
                        help="llamacpp: llama-perplexity on the same GGUF file and text")
    add_engine_args(parser)


def default_text() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = (DEMO / "heldout_files.txt").read_text().split()
    return [stdlib / n for n in names if (stdlib / n).is_file()]


def perplexity(llm, text: str, window: int, max_windows: int | None) -> tuple[float, int]:
    """(perplexity, scored tokens) of text through llm, as the module docstring says."""
    from fleetllm import SamplingParams

    ids = llm.get_tokenizer()(text, add_special_tokens=False, verbose=False)["input_ids"]
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    if max_windows:
        windows = windows[:max_windows]
    if not windows:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than one window of {window}")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=True)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs, strict=True):
        for pos in range(window // 2, window):
            nll -= out.prompt_logprobs[pos][w[pos]].logprob
            count += 1
    return math.exp(nll / count), count


def llamacpp_perplexity(path: str, text_file: Path, window: int, max_windows: int | None,
                        threads: int) -> float:
    from fleetllm.benchmarks.llamacpp_peer import llamacpp_tool
    from fleetllm.errors import PeerError

    binary = llamacpp_tool("llama-perplexity")
    # --no-repack: this build's repacked (AMX) prompt path dies here (SIGILL / SIGSEGV).
    cmd = [str(binary), "-m", path, "-f", str(text_file), "-c", str(window), "-b",
           str(window), "-t", str(threads), "--no-repack"]
    if max_windows:
        cmd += ["--chunks", str(max_windows)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    found = re.findall(r"\[\d+\]([\d.]+)", run.stderr + run.stdout)
    if run.returncode != 0 or not found:
        raise PeerError(f"llama-perplexity failed ({run.returncode}): {run.stderr[-2000:]}")
    return float(found[-1])  # the running estimate after the last chunk


def run(args: argparse.Namespace) -> dict:
    import tempfile

    import torch

    from fleetllm import LLM

    model = resolve_model(args.model)
    files = [Path(f) for f in args.text] if args.text else default_text()
    text = "".join(f.read_text() for f in files)
    kwargs = {"max_model_len": max(args.window, 16),
              **engine_kwargs_from(args, args.engine_actions)}
    with LLM(model, **kwargs) as llm:
        ppl, count = perplexity(llm, text, args.window, args.max_windows)
    print(f"{model}: perplexity {ppl:.4f} over {count} tokens ({len(files)} files, windows of "
          f"{args.window}, the second half of each scored)")
    figures = {"model": model, "perplexity": ppl, "tokens": count, "window": args.window}
    if args.compare == "llamacpp":
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(text)
            f.flush()
            theirs = llamacpp_perplexity(model, Path(f.name), args.window, args.max_windows,
                                         torch.get_num_threads())
        figures["llamacpp_perplexity"] = theirs
        print(f"llama.cpp llama-perplexity: {theirs:.4f} ({ppl / theirs - 1:+.2%} fleetllm's "
              "relative to it; its own tokenizer)")
    return figures
