"""Offline throughput: N random requests through LLM.generate, next to HF `generate` on the
same requests in the same run.

    fleetllm bench throughput [--model DIR] [--num-prompts 64] [--input-len 128]
                              [--output-len 64] [--hf-batch-size 8]
                              [--compare-backend uni] [engine flags]
    python -m fleetllm.benchmarks.throughput ...   (the same)

Prints requests/s and output tokens/s for fleetllm and HF (each the best of --repeat runs),
and their ratio; with --compare-backend, also fleetllm on that executor backend (e.g. `mp`
against `uni`; both engines stay up and take turns). Without --model it uses the bundled
demo model. Every request generates exactly --output-len tokens
(ignore_eos), so both sides do the same work.
"""

from __future__ import annotations

import argparse
import random
import time

from fleetllm.cli import HelpFormatter, add_engine_args, engine_kwargs_from, resolve_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="requests")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64,
                        help="generated tokens per request")
    parser.add_argument("--hf-batch-size", type=int, default=8,
                        help="HF generate batch size (left-padded); 0 skips the HF peer")
    parser.add_argument("--compare-backend", default=None,
                        help="also run fleetllm with this distributed_executor_backend "
                             "(same requests, same run) and print the ratio (default: none)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per engine; the fastest counts (this 2-core machine's "
                             "run-to-run noise is larger than the differences measured)")
    parser.add_argument("--data-seed", dest="bench_seed", type=int, default=0,
                        help="seed for the random prompts")
    add_engine_args(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.benchmarks.throughput",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    import torch

    kwargs = engine_kwargs_from(args, args.engine_actions)
    variants = [kwargs]
    if args.compare_backend:
        variants.append({**kwargs, "distributed_executor_backend": args.compare_backend})
    times, outputs, prompts = _run_fleetllm(model, variants, args)
    ours = times[0]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"model: {model}")
    print(f"requests: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), "
          f"torch threads: {torch.get_num_threads()}, fleetllm: best of {args.repeat} runs")
    print(f"fleetllm: {args.num_prompts / ours:8.2f} requests/s  {out_tokens / ours:9.1f} "
          f"output tokens/s  ({ours:.2f} s)")
    if args.compare_backend:
        peer = times[1]
        backend = kwargs.get("distributed_executor_backend", "default")
        print(f"fleetllm ({args.compare_backend}): {args.num_prompts / peer:8.2f} requests/s  "
              f"{out_tokens / peer:9.1f} output tokens/s  ({peer:.2f} s)")
        print(f"ratio {backend} / {args.compare_backend}: {peer / ours:.3f}x")
    if args.hf_batch_size:
        hf = _hf_generate(model, prompts, args.output_len, args.hf_batch_size, args.repeat)
        print(f"HF generate (batch {args.hf_batch_size}, best of {args.repeat}): "
              f"{args.num_prompts / hf:8.2f} "
              f"requests/s  {out_tokens / hf:9.1f} output tokens/s  ({hf:.2f} s)")
        print(f"ratio fleetllm / HF: {hf / ours:.2f}x")
    return 0


def _run_fleetllm(model: str, variants: list[dict], args: argparse.Namespace):
    """Best time of each engine variant over the same random requests, plus the first one's
    outputs and the prompts. All engines stay up and take turns, so neither gains from
    running second (measured here: whichever ran second in a process was ~20% faster)."""
    from fleetllm import LLM, SamplingParams

    engines = []
    try:
        for kwargs in variants:
            engines.append(LLM(model, **kwargs))
        tokenizer = engines[0].get_tokenizer()
        vocab = min(engines[0].llm_engine.model_config.arch.vocab_size,
                    len(tokenizer) if tokenizer else 10**9)
        rng = random.Random(args.bench_seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)]
                   for _ in range(args.num_prompts)]
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for llm in engines:  # warm-up
            llm.generate(requests[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        best = [float("inf")] * len(engines)
        outputs = None
        for _ in range(max(1, args.repeat)):
            for i, llm in enumerate(engines):
                start = time.perf_counter()
                result = llm.generate(requests, params, use_tqdm=False)
                best[i] = min(best[i], time.perf_counter() - start)
                outputs = outputs or result
        return best, outputs, prompts
    finally:
        for llm in engines:
            llm.shutdown()


def _hf_generate(model: str, prompts: list[list[int]], output_len: int,
                 batch_size: int, repeat: int) -> float:
    """Best time of `repeat` runs of HF generate over the prompts, batch_size at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    best = float("inf")
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i: i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                            min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    raise SystemExit(main())
