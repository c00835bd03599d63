"""Where a throughput workload's time goes, op by op: the preset's requests through
LLM.generate (as `fleetllm bench throughput --preset P --compare none` runs them), then one
more round under torch's profiler, printing each op's own time (oneDNN's projections,
fleetllm's kernels: prompt attention, the one-call decoder layer of decode steps, ...).

    .venv/bin/python tools/op_profile.py --preset qwen2-0.5b --num-prompts 16
    .venv/bin/python tools/op_profile.py --preset llama-125m --shapes   # per input shape
    .venv/bin/python tools/op_profile.py --model DIR     # a checkpoint directory instead

Timing is the profiler's, so compare trees by running this on each in turn (PYTHONPATH) and
reading one op's row, not by the total: this machine's speed moves between runs.
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from fleetllm import LLM, SamplingParams
from fleetllm.benchmarks import workload
from fleetllm.benchmarks.presets import PRESETS, preset_dir
from fleetllm.benchmarks.throughput import PRESET_MAX_MODEL_LEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-125m", choices=sorted(PRESETS))
    parser.add_argument("--model", default=None, help="a checkpoint directory (its weights) "
                        "instead of the preset's dummy ones")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", type=float, default=None)
    parser.add_argument("--shapes", action="store_true", help="one row per op and input shape")
    parser.add_argument("--rows", type=int, default=25, help="rows of the table")
    args = parser.parse_args()
    extra = {} if args.kv_cache_memory is None else {"kv_cache_memory": args.kv_cache_memory}
    if args.model:
        llm = LLM(args.model, dtype=args.dtype, seed=0, **extra)
    else:
        max_len = min(PRESET_MAX_MODEL_LEN, PRESETS[args.preset]["max_position_embeddings"])
        llm = LLM(preset_dir(args.preset), load_format="dummy", dtype=args.dtype, seed=0,
                  max_model_len=max_len, **extra)
    try:
        vocab = llm.llm_engine.model_config.arch.vocab_size
        tokenizer = llm.get_tokenizer()
        if tokenizer is not None:  # as bench throughput draws them
            vocab = min(vocab, len(tokenizer))
        requests = workload.make_requests(
            argparse.Namespace(dataset=None, bench_seed=0, num_prompts=args.num_prompts,
                               input_len=(16, 256), output_len=(16, 64)), vocab)

        def run() -> float:
            llm.llm_engine.scheduler.block_manager.reset_prefix_cache()
            params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                      for r in requests]
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": r.prompt} for r in requests], params,
                         use_tqdm=False)
            return time.perf_counter() - start

        run()  # warm-up: shapes, caches, first-call costs
        print(f"unprofiled round: {run():.2f} s")
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
            seconds = run()
        print(f"profiled round: {seconds:.2f} s")
        table = prof.key_averages(group_by_input_shape=args.shapes)
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
