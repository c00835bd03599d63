"""Time to first token of a repeated long prompt on a freshly started instance: cold (no KV
connector) against a restarted instance reading SharedStorageConnector's store (the figure in
docs/kv_transfer.md).

    python tools/kv_transfer_ttft.py [--preset llama-125m] [--input-len 1000] [--repeat 3]

Each timed request is the first of a new LLM (its local prefix cache is empty), after one
short warm-up request with other tokens; the store is filled once in between by an instance
that answers the same prompt. Dummy weights (seeded): the store's key holds the seed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from fleetllm import LLM, SamplingParams
from fleetllm.benchmarks.presets import PRESETS, preset_dir

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def first_token_seconds(model: str, prompt: list[int], kv_transfer_config: dict | None
                        ) -> tuple[float, dict]:
    with LLM(model, load_format="dummy", max_model_len=2048,
             kv_transfer_config=kv_transfer_config) as llm:
        engine = llm.llm_engine
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 8}], FIRST, use_tqdm=False)
        start = time.perf_counter()
        engine.add_request("timed", {"prompt_token_ids": prompt}, FIRST)
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        return time.perf_counter() - start, engine.kv_transfer_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-125m")
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="kv-ttft-")
    model = preset_dir(args.preset, root + "/model")
    rng = random.Random(0)
    prompt = [rng.randrange(3, 30000) for _ in range(args.input_len)]
    kt = {"kv_connector": "SharedStorageConnector",
          "kv_connector_extra_config": {"shared_storage_path": root + "/store"}}
    cold = [first_token_seconds(model, prompt, None)[0] for _ in range(args.repeat)]
    fill, _ = first_token_seconds(model, prompt, kt)  # computes, and fills the store
    warm = [first_token_seconds(model, prompt, kt) for _ in range(args.repeat)]
    print(f"{args.preset}, {args.input_len}-token prompt, time to first token on a new "
          f"instance (median of {args.repeat}, min-max):")
    print(f"  cold (no connector):      {statistics.median(cold) * 1e3:7.1f} ms "
          f"({min(cold) * 1e3:.1f}-{max(cold) * 1e3:.1f})")
    print(f"  first, filling the store: {fill * 1e3:7.1f} ms")
    times = [t for t, _ in warm]
    print(f"  restarted, store hit:     {statistics.median(times) * 1e3:7.1f} ms "
          f"({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}); {warm[0][1]}")


if __name__ == "__main__":
    main()
