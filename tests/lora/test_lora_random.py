"""Randomized differential test of LoRA serving: requests draw their adapter (or the base
model) at random from more adapters than max_loras (device slots) and max_cpu_loras (the
workers' LRU), arrive while the engine steps, share prompt prefixes (prefix caching), are
chunked and preempted (a small KV pool), while adapters are removed and pinned at random
under them. Every request must get its own adapter's greedy tokens, as HF + peft computes
them, and no step may hold more than max_loras adapters. `make test` runs 2 seeded series,
`make soak` (--soak) 16."""

from __future__ import annotations

import random

import pytest
from lora_helpers import ATTN, MLP, hf_lora_greedy, lora_request, make_adapter

from fleetllm import LLMEngine, SamplingParams

NUM_ADAPTERS = 6
pytestmark = [pytest.mark.soak, pytest.mark.timeout(600)]


def pytest_generate_tests(metafunc):
    if metafunc.function is test_every_request_gets_its_own_adapters_tokens:
        metafunc.parametrize("seed", range(16 if metafunc.config.getoption("soak") else 2))


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    base = tiny_models["llama_gqa"]
    root = tmp_path_factory.mktemp("lora_random")
    rng = random.Random(7)
    made = []
    for i in range(NUM_ADAPTERS):
        targets = rng.sample(ATTN + MLP, rng.randint(1, 7))
        made.append(make_adapter(base, root / f"a{i}", r=rng.choice([4, 8, 16]),
                                 alpha=rng.choice([8, 16, 32]), targets=targets,
                                 rslora=rng.random() < 0.5, seed=100 + i))
    return base, made


def test_every_request_gets_its_own_adapters_tokens(adapters, seed):
    base, paths = adapters
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 40))] for _ in range(3)]
    requests = []
    for i in range(28):
        prompt = (rng.choice(shared) if rng.random() < 0.6 else []) + \
            [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        lora_id = rng.choice([None, *range(1, NUM_ADAPTERS + 1)])
        requests.append((f"r{i}", prompt, lora_id, rng.randint(1, 16)))

    engine = LLMEngine.from_engine_args(
        str(base), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16,
        max_num_seqs=6, max_num_batched_tokens=40, num_gpu_blocks_override=8,
        swap_space=0)
    executor = engine.model_executor
    per_step: list[int] = []
    original = executor.execute_model

    def spy(request):
        per_step.append(len({g.lora_request.lora_int_id for g in request.seq_group_metadata_list
                             if g.lora_request is not None}))
        return original(request)

    executor.execute_model = spy
    results: dict[str, list[int]] = {}
    pending = list(requests)
    try:
        while pending or engine.has_unfinished_requests():
            action = rng.random()
            if pending and action < 0.5:
                for _ in range(rng.randint(1, 3)):
                    if pending:
                        rid, prompt, lora_id, max_tokens = pending.pop(0)
                        engine.add_request(
                            rid, {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True),
                            lora_request=None if lora_id is None else
                            lora_request(paths[lora_id - 1], lora_id))
            elif action < 0.58:  # under running requests: they load it again when next run
                engine.remove_lora(rng.randint(1, NUM_ADAPTERS))
            elif action < 0.62:
                engine.pin_lora(rng.randint(1, NUM_ADAPTERS))
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    results[out.request_id] = out.outputs[0].token_ids
    finally:
        del executor.execute_model
        engine.shutdown()

    assert max(per_step) <= 2 and len(results) == len(requests)
    assert engine.scheduler.num_preemptions > 0  # the small pool preempted some
    assert engine.scheduler.block_manager.prefix_cache.hit_tokens > 0
    by_adapter: dict[int | None, list] = {}
    for rid, prompt, lora_id, max_tokens in requests:
        by_adapter.setdefault(lora_id, []).append((rid, prompt, max_tokens))
    for lora_id, items in by_adapter.items():
        adapter = None if lora_id is None else paths[lora_id - 1]
        refs = hf_lora_greedy(base, adapter, [p for _, p, _ in items], 16)
        for (rid, _, max_tokens), ref in zip(items, refs, strict=True):
            assert results[rid] == ref[:max_tokens], (rid, lora_id)
