"""LoRA through AsyncLLMEngine and EngineCoreClient (issue #22): generate(lora_request=...)
gives offline LLM.generate's tokens, and add_lora / list_loras / pin_lora / remove_lora work
the same on the engine in this process and in the engine-core process (where a LoRARequest
crosses the wire as three plain fields)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from serving_helpers import KV

from fleetllm import LLM, SamplingParams
from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.engine.core_client import EngineCoreClient
from fleetllm.errors import InvalidRequestError
from fleetllm.lora.request import LoRARequest

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=KV,
            max_model_len=256)
PROMPTS = [[1, 5, 9, 200, 37, 11], [1, 40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    """The checkpoint, two PEFT adapters, and offline tokens per adapter (None: base)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = tiny_models["llama_gqa"]
    root = tmp_path_factory.mktemp("async-adapters")
    loras = []
    for i, targets in enumerate((["q_proj", "v_proj"], ["o_proj", "up_proj"])):
        torch.manual_seed(10 + i)
        peft = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(model),
                              LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                         init_lora_weights=False))
        peft.save_pretrained(root / f"l{i}")
        loras.append(LoRARequest(f"l{i}", i + 1, str(root / f"l{i}")))
    with LLM(str(model), **LORA) as llm:
        expected = {lora: [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
            lora_request=lora)] for lora in (None, *loras)}
    return model, loras, expected


async def tokens(engine, lora: LoRARequest | None, tag: str) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, f"{tag}-{i}",
                                         lora_request=lora):
            final = out
        return final.outputs[0].token_ids
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


@pytest.mark.parametrize("kind", ["in-process", "engine-core"])
def test_generate_and_manage_adapters(setup, kind):
    model, (l0, l1), expected = setup
    start = AsyncLLMEngine.from_engine_args if kind == "in-process" else EngineCoreClient
    engine = start(str(model), **LORA)

    async def scenario() -> None:
        assert await engine.list_loras() == set()
        assert await engine.add_lora(l0) is True
        assert await engine.list_loras() == {1}
        assert await engine.pin_lora(1) is True
        for lora in (l0, l1, None):  # l1 is loaded on first use
            assert await tokens(engine, lora, f"{kind}-{lora}") == expected[lora]
        assert await engine.list_loras() == {1, 2}
        assert await engine.remove_lora(2) is True
        assert await engine.list_loras() == {1}
        bad = LoRARequest("bad", 3, str(model))  # a checkpoint, not an adapter
        with pytest.raises(InvalidRequestError):
            await engine.add_lora(bad)
        with pytest.raises(InvalidRequestError):
            await tokens(engine, bad, "bad")
        assert await tokens(engine, l1, "again") == expected[l1]  # loaded again
        # Removed while a request runs with it: the request finishes with the adapter.
        long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        stream = engine.generate({"prompt_token_ids": PROMPTS[0]}, long, f"{kind}-rm",
                                 lora_request=l0)
        first = await anext(stream)
        assert await engine.remove_lora(1) is True
        final = [first, *[out async for out in stream]][-1]
        assert not first.finished and final.outputs[0].token_ids[:6] == expected[l0][0]
        assert len(final.outputs[0].token_ids) == 24

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_lora_request_without_enable_lora_is_refused(setup):
    model, (l0, _), _ = setup
    engine = AsyncLLMEngine.from_engine_args(str(model), kv_cache_memory=KV, max_model_len=256)
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            asyncio.run(tokens(engine, l0, "off"))
    finally:
        engine.shutdown()


def test_a_new_engine_core_has_the_adapters_loaded_and_pinned(setup):
    """The core process dies (SIGKILL): the new one loads what add_lora loaded and pins what
    was pinned, before any request (core_client's restart)."""
    import os
    import signal
    import time

    model, (l0, _), expected = setup
    engine = EngineCoreClient(str(model), **LORA)
    try:
        asyncio.run(engine.add_lora(l0))
        assert asyncio.run(engine.pin_lora(1)) is True
        pid = engine._core.proc.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine._core.proc.pid == pid or engine._restarting:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert asyncio.run(engine.list_loras()) == {1}
        assert asyncio.run(tokens(engine, l0, "restarted")) == expected[l0]
        assert engine.core_restarts.total == 1
    finally:
        engine.shutdown()
