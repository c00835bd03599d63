"""Helpers of the KV transfer tests (tests/kv_transfer/): the store's config, prompts that
share prefixes, an engine run that counts terminal outputs, and store damage."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from fleetllm import LLM, SamplingParams

KV = 32 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def store_config(path: Path, policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def prompts_sharing_prefixes(count: int, seed: int, prefixes: int = 3, low: int = 20,
                             high: int = 90) -> list[list[int]]:
    """`count` prompts, each one of `prefixes` random prefixes (up to 64 tokens) and a random
    tail: whole stored blocks are shared between them, partial ones too."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 64))]
             for _ in range(prefixes)]
    return [rng.choice(heads)[:rng.randint(0, 64)] +
            [rng.randrange(3, 500) for _ in range(rng.randint(low, high) // 4)]
            for _ in range(count)]


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int] | None]:
    """Each prompt's greedy tokens via LLMEngine.step, checking that every request gets
    exactly one terminal output; None for a request that ended with an error."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
    finals: dict[str, Any] = {}
    for _ in range(10_000):  # bounded: a stuck engine fails the test, never hangs it
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id}: two final outputs"
                finals[out.request_id] = out
    assert sorted(finals) == sorted(f"r{i}" for i in range(len(prompts)))
    result = []
    for i in range(len(prompts)):
        [completion] = finals[f"r{i}"].outputs
        if completion.finish_reason == "error":
            result.append(None)
        else:
            assert completion.finish_reason == "length"
            result.append(list(completion.token_ids))
    return result


def assert_no_leak(llm: LLM) -> None:
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks


def block_files(store: Path, rank: int | None = None) -> list[Path]:
    pattern = "*.kv" if rank is None else f"*.r{rank}.kv"
    return sorted(store.rglob(pattern))


def damage(path: Path, how: str) -> None:
    """truncate: half the file; flip: one payload byte changed; delete."""
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x5A
        path.write_bytes(bytes(data))
