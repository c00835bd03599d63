"""First end-to-end check of the executor path (the fuller suite is in test_executor.py)."""

import random

from helpers import check_close, greedy_run, hf_greedy, load_hf

from fleetllm.config import EngineConfig
from fleetllm.executor import Executor


def test_uni_executor_matches_hf_greedy(tiny_models):
    path = tiny_models["llama_gqa"]
    cfg = EngineConfig.from_kwargs(model=str(path), kv_cache_memory=64 << 20)
    with Executor.get_class(cfg)(cfg) as ex:
        ex.initialize_cache(*ex.determine_num_available_blocks())
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40, 1)]
        results = greedy_run(ex, prompts, 8)
    hf = load_hf(path)
    for prompt, ours in zip(prompts, results, strict=True):
        check_close(ours, hf_greedy(hf, prompt, 8))
