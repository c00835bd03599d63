#!/usr/bin/env python3
"""Speculative decoding's speed-up prompt by prompt, on copy-edit prompts.

`fleetllm bench latency --workload copy` at batch 1 measures one prompt; how much n-gram
drafting gains depends on what the model writes there (a copy, a loop, new text). This runs
every distinct copy-edit prompt alone (greedy, --output-len tokens, ignore_eos), the engine
with and without --speculative-config in one process taking turns, best of --repeat each, and
prints per prompt: decode steps with speculation, the speed-up, and the first tokens written;
then the speed-up over all prompts together (their decode times summed). Decode time: every
step after the prompt's.

    python tools/spec_per_prompt.py [--model DIR] [--source fleetllm|stdlib-heldout]
        [--output-len 128] [--repeat 3] [--speculative-config JSON]

--source fleetllm: the functions of `--workload copy` (fleetllm's own); stdlib-heldout: the
functions of the standard-library files the demo model was not trained on (its
heldout_files.txt), asked for again in the same words.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fleetllm import LLM, SamplingParams
from fleetllm.benchmarks import workload

DEMO = Path(__file__).resolve().parents[1] / "fleetllm" / "demo_model"


def stdlib_heldout_sources(model: Path) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import copy_windows

    return copy_windows.heldout_functions(model)


def decode_time(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, int, list]:
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt
    start, steps, last = time.perf_counter(), 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
        steps += 1
    return time.perf_counter() - start, steps, last.outputs[0].token_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO)
    parser.add_argument("--source", choices=["fleetllm", "stdlib-heldout"], default="fleetllm")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-prompts", type=int, default=12)
    parser.add_argument("--speculative-config", type=json.loads,
                        default={"method": "ngram", "num_speculative_tokens": 4})
    args = parser.parse_args(argv)
    on = LLM(str(args.model), enable_prefix_caching=False,
             speculative_config=args.speculative_config)
    off = LLM(str(args.model), enable_prefix_caching=False)
    try:
        tokenizer = on.llm_engine.get_tokenizer()
        room = on.llm_engine.model_config.max_model_len - args.output_len
        sources = None if args.source == "fleetllm" else stdlib_heldout_sources(args.model)
        prompts: list[list[int]] = []
        # the first max_prompts after the shuffle; fewer candidates come back cycled
        for p in workload.copy_edit_prompts(tokenizer, args.max_prompts, room, 0, sources):
            if p not in prompts:
                prompts.append(p)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        decode_time(on, prompts[0], params)  # warm-up
        decode_time(off, prompts[0], params)
        total_on = total_off = 0.0
        for i, prompt in enumerate(prompts):
            t_on = t_off = float("inf")
            for _ in range(max(1, args.repeat)):  # taking turns
                t, steps, ids = decode_time(on, prompt, params)
                t_on = min(t_on, t)
                t_off = min(t_off, decode_time(off, prompt, params)[0])
            total_on, total_off = total_on + t_on, total_off + t_off
            print(f"prompt {i}: {len(prompt)} tokens; {steps} decode steps with speculation; "
                  f"{t_off / t_on:.2f}x; writes {tokenizer.decode(ids[:24])!r}", flush=True)
        print(f"{len(prompts)} prompts ({args.source}): {total_off / total_on:.2f}x the decode "
              "speed without speculation, their decode times summed")
    finally:
        on.shutdown()
        off.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
