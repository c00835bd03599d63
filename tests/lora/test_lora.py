"""LoRA adapters (#22): greedy tokens equal HF transformers + peft (PeftModel and
merge_and_unload) for one batch mixing 4 adapters and the base model, on uni, mp (TP=2, PP=2,
with a worker crash) and ray; adapters that cannot be served are refused naming why; prefix
caching never shares KV across adapters; the scheduler keeps max_loras per step; add / remove /
pin / list_loras and the LRU; adapters come back on new workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_checkpoint
from helpers import ray_pythonpath
from lora_helpers import ATTN, MLP, hf_lora_greedy, lora_request, make_adapter

from fleetllm import LLM, LoRARequest, SamplingParams
from fleetllm.errors import ConfigurationError, InvalidRequestError, LoRAAdapterError
from fleetllm.lora import layers as lora_layers
from fleetllm.worker.faults import inject_fault

KV = 16 << 20
TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 33, 99, 100, 7, 250, 31, 64, 2, 77], [8, 9, 10], list(range(40, 75))]
# (rank, alpha, targets, rsLoRA): attention only, everything with rsLoRA, a subset of the
# fused q/k/v (so one part of a merged projection is zero), the MLP only
SPECS = [(8, 16, ATTN, False), (16, 8, ATTN + MLP, True), (8, 32, ["q_proj", "v_proj"], False),
         (16, 16, MLP, False)]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def setups(tiny_models, tmp_path_factory):
    """Per base model: (path, [adapter dirs], {adapter id or None: reference tokens})."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for name in ("llama_gqa", "qwen2_bias"):
        base = tiny_models[name]
        adapters = [make_adapter(base, root / f"{name}-{i}", r=r, alpha=alpha, targets=t,
                                 rslora=rs, seed=10 + i)
                    for i, (r, alpha, t, rs) in enumerate(SPECS)]
        refs = {None: hf_lora_greedy(base, None, PROMPTS, TOKENS)}
        for i, adapter in enumerate(adapters):
            refs[i + 1] = hf_lora_greedy(base, adapter, PROMPTS, TOKENS)
        out[name] = (base, adapters, refs)
    return out


def mixed_batch(adapters: list[Path]) -> tuple[list[dict], list[LoRARequest | None], list]:
    """Every prompt under every adapter and the base, interleaved in one batch."""
    prompts, loras, keys = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for lora_id in [None, 1, 2, 3, 4]:
            prompts.append({"prompt_token_ids": prompt})
            loras.append(None if lora_id is None else lora_request(adapters[lora_id - 1],
                                                                    lora_id))
            keys.append((lora_id, i))
    return prompts, loras, keys


def check_mixed(llm: LLM, adapters: list[Path], refs: dict) -> None:
    prompts, loras, keys = mixed_batch(adapters)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for (lora_id, i), out in zip(keys, outputs, strict=True):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == refs[lora_id][i], (lora_id, i)


def lora_llm(base: Path, **kwargs) -> LLM:
    kwargs = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
              "kv_cache_memory": KV, **kwargs}
    return LLM(base, **kwargs)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_mixed_batch_matches_peft_uni(setups, name):
    base, adapters, refs = setups[name]
    # The references differ: each adapter changes the tokens (else the test proves nothing).
    assert len({tuple(refs[k][0]) for k in refs}) == len(refs)
    with lora_llm(base) as llm:
        check_mixed(llm, adapters, refs)
        assert llm.list_loras() == {1, 2, 3, 4}


def test_merge_and_unload_gives_the_same_tokens(setups):
    base, adapters, refs = setups["llama_gqa"]
    assert hf_lora_greedy(base, adapters[1], PROMPTS, TOKENS, merge=True) == refs[2]


def test_mixed_batch_matches_peft_mp_tp2_with_a_crash(setups):
    """TP=2: A of a column-parallel projection whole, B's rows split; a row-parallel one's A
    split by input columns. A rank crashing mid-run: new workers get the adapters back."""
    base, adapters, refs = setups["llama_gqa"]
    with lora_llm(base, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        llm.add_lora(lora_request(adapters[0], 1))
        assert llm.pin_lora(1)
        check_mixed(llm, adapters, refs)
        executor = llm.llm_engine.model_executor
        inject_fault(executor, rank=1, kind="crash", at_call=3)
        check_mixed(llm, adapters, refs)
        assert executor.get_performance_metrics()["workers"]["restarts"] == 1
        assert llm.list_loras() == {1, 2, 3, 4}
        assert executor.loras.pinned == {1}


def test_mixed_batch_matches_peft_mp_pp2(setups):
    base, adapters, refs = setups["llama_gqa"]
    with lora_llm(base, pipeline_parallel_size=2, distributed_executor_backend="mp") as llm:
        check_mixed(llm, adapters, refs)


def test_mixed_batch_matches_peft_ray_tp2(setups):
    ray = pytest.importorskip("ray")
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath(__file__)}},
             log_to_driver=False)
    try:
        base, adapters, refs = setups["llama_gqa"]
        with lora_llm(base, tensor_parallel_size=2, distributed_executor_backend="ray",
                      ray_cpus_per_worker=0.5) as llm:
            check_mixed(llm, adapters, refs)
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- what is refused


@pytest.fixture(scope="module")
def base(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def llm(base):
    with lora_llm(base, max_loras=2, max_cpu_loras=3) as llm:
        yield llm


@pytest.mark.parametrize("kwargs, why", [
    (dict(use_dora=True), "DoRA"),
    (dict(targets=ATTN + ["lm_head"]), "lm_head"),
    (dict(targets=ATTN + ["embed_tokens"]), "embed_tokens"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(r=32, alpha=32), "max_lora_rank=16"),
])
def test_unsupported_adapters_are_refused_naming_why(base, llm, tmp_path, kwargs, why):
    adapter = make_adapter(base, tmp_path / "a", **kwargs)
    request = LoRARequest("bad", 77, str(adapter))
    with pytest.raises(ConfigurationError, match=why):
        llm.add_lora(request)
    with pytest.raises(InvalidRequestError, match=why):
        llm.llm_engine.add_request("bad", {"prompt_token_ids": [5, 6]}, GREEDY,
                                   lora_request=request)
    # LLM.generate: that request fails with the reason, the others run.
    good, bad = llm.generate([{"prompt_token_ids": [5, 6]}] * 2, GREEDY, use_tqdm=False,
                             lora_request=[None, request])
    assert good.error is None and len(good.outputs[0].token_ids) == TOKENS
    assert why in bad.error
    assert 77 not in llm.list_loras()


def test_pickled_adapters_and_other_models_adapters_are_refused(base, llm, tmp_path):
    adapter = make_adapter(base, tmp_path / "pickled")
    (adapter / "adapter_model.safetensors").unlink()
    from helpers import load_hf
    from peft import LoraConfig, get_peft_model

    get_peft_model(load_hf(base), LoraConfig(r=8, target_modules=ATTN)).save_pretrained(
        tmp_path / "pickled", safe_serialization=False)
    with pytest.raises(LoRAAdapterError, match="pickle"):
        llm.add_lora(LoRARequest("pickled", 78, str(adapter)))
    other = make_checkpoint(tmp_path / "other", "LlamaForCausalLM", hidden_size=32,
                            intermediate_size=64, head_dim=8)
    with pytest.raises(LoRAAdapterError, match="another model"):
        llm.add_lora(LoRARequest("other", 79, str(make_adapter(other, tmp_path / "o"))))
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        llm.add_lora(LoRARequest("missing", 80, str(tmp_path / "nowhere")))


def test_lora_request_without_enable_lora_and_bad_ids(base, tmp_path):
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with LLM(base, kv_cache_memory=KV) as plain:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            plain.llm_engine.add_request("r", {"prompt_token_ids": [5]}, GREEDY,
                                         lora_request=LoRARequest("a", 1, str(tmp_path)))
        with pytest.raises(ConfigurationError, match="enable_lora"):
            plain.add_lora(LoRARequest("a", 1, str(tmp_path)))
    with pytest.raises(ConfigurationError, match="max_cpu_loras"):
        LLM(base, enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_one_id_is_one_adapter(setups, llm):
    _, adapters, _ = setups["llama_gqa"]
    llm.add_lora(lora_request(adapters[0], 5))
    with pytest.raises(InvalidRequestError, match="one id is one adapter"):
        llm.llm_engine.add_request("x", {"prompt_token_ids": [5]}, GREEDY,
                                   lora_request=lora_request(adapters[1], 5))
    assert llm.remove_lora(5) and not llm.remove_lora(5)
    llm.add_lora(lora_request(adapters[1], 5))  # after remove_lora the id is free
    llm.remove_lora(5)


# ---------------------------------------------------------------- management, scheduling


def test_add_pin_remove_and_the_lru(setups, llm):
    _, adapters, refs = setups["llama_gqa"]
    for lora_id in sorted(llm.list_loras()):
        llm.remove_lora(lora_id)
    assert llm.add_lora(lora_request(adapters[0], 1)) and llm.pin_lora(1)
    assert not llm.pin_lora(9)  # not loaded
    for lora_id in (2, 3, 4):  # max_cpu_loras=3: the least recently used unpinned one goes
        llm.add_lora(lora_request(adapters[lora_id - 1], lora_id))
    assert llm.list_loras() == {1, 3, 4}
    # An evicted adapter named by a request is loaded again; the tokens are its own.
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                         lora_request=lora_request(adapters[1], 2))
    assert out.outputs[0].token_ids == refs[2][0]
    assert llm.list_loras() == {1, 2, 4}
    # Restarted workers come back with the resident adapters, the pinned one pinned.
    executor = llm.llm_engine.model_executor
    executor.restart_failed_workers()
    assert llm.list_loras() == {1, 2, 4}
    assert executor.collective_rpc(lambda w: w.model_runner.lora_manager.pinned) == [{1}]


def test_a_step_never_holds_more_than_max_loras_adapters(setups, llm):
    _, adapters, refs = setups["llama_gqa"]
    executor = llm.llm_engine.model_executor
    seen: list[set] = []
    original = executor.execute_model

    def spy(request):
        seen.append({g.lora_request.lora_int_id for g in request.seq_group_metadata_list
                     if g.lora_request is not None})
        return original(request)

    executor.execute_model = spy
    try:
        check_mixed(llm, adapters, refs)  # 4 adapters, max_loras=2
    finally:
        del executor.execute_model
    assert max(len(s) for s in seen) == 2
    assert set().union(*seen) == {1, 2, 3, 4}


def test_prefix_cache_never_shares_kv_across_adapters(setups, llm):
    _, adapters, refs = setups["llama_gqa"]
    bm = llm.llm_engine.scheduler.block_manager
    bm.reset_prefix_cache()
    prompt = {"prompt_token_ids": PROMPTS[2]}  # 35 tokens: two full blocks to share
    order = [(1, adapters[0]), (2, adapters[1]), (None, None), (1, adapters[0])]
    hits = []
    for lora_id, adapter in order:
        before = bm.prefix_cache.hit_tokens
        [out] = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=None if adapter is None
                             else lora_request(adapter, lora_id))
        assert out.outputs[0].token_ids == refs[lora_id][2], lora_id
        hits.append(bm.prefix_cache.hit_tokens - before)
    assert hits == [0, 0, 0, 32]  # only the same adapter finds its blocks


@pytest.mark.parametrize("index", [
    [2, -1, 0, 1, 1, -1, 2],  # even groups: padded bmm
    [-1, 2, 1, 2, -1],  # slots 1 and 2 only: their weights gathered
    [0, 0, 0, 0, 1, -1, 2, 0, 0],  # uneven groups: per-group GEMMs
    [1, 1, 1],  # one adapter, no base rows: straight GEMMs
])
def test_slot_deltas_equal_a_per_row_loop(index):
    """LoRASlots.apply on a batch mixing slots and base rows equals x @ A_s @ B_s row by row;
    base rows get exactly nothing added."""
    gen = torch.Generator().manual_seed(0)
    slots = lora_layers.LoRASlots(24, [16, 8], slots=3, rank=4, dtype=torch.float32,
                                  device=torch.device("cpu"))
    weights = {}
    for s in range(3):
        parts = [(torch.randn(24, 4 - s % 2, generator=gen), torch.randn(4 - s % 2, n,
                                                                         generator=gen))
                 for n in (16, 8)]
        parts[s % 2] = None if s == 1 else parts[s % 2]
        slots.set(s, parts)
        weights[s] = parts
    x = torch.randn(len(index), 24, generator=gen)
    y = torch.randn(len(index), 24, generator=gen)
    lora_layers.set_step(lora_layers.LoRAStep.build(index, torch.float32, torch.device("cpu")))
    try:
        got = slots.apply(x, y.clone())
    finally:
        lora_layers.set_step(None)
    want = y.clone()
    for row, s in enumerate(index):
        if s < 0:
            continue
        for part, off in zip(weights[s], (0, 16), strict=True):
            if part is None:
                continue
            a, b = part
            want[row, off:off + b.shape[1]] += x[row] @ a @ b
    torch.testing.assert_close(got, want)
    base_rows = [i for i, s in enumerate(index) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])


def test_adapters_survive_sleep_level_2(setups, llm):
    """Level 2 discards the weights and reloads the model on wake_up: the projections get
    their slots again and the loaded adapters are still there."""
    _, adapters, refs = setups["llama_gqa"]
    llm.add_lora(lora_request(adapters[2], 3))
    llm.llm_engine.sleep(level=2)
    llm.llm_engine.wake_up()
    assert 3 in llm.list_loras()
    [out] = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False,
                         lora_request=lora_request(adapters[2], 3))
    assert out.outputs[0].token_ids == refs[3][1]


def test_base_only_steps_keep_the_fused_layer(setups, llm, monkeypatch):
    """With enable_lora, a small decode batch of base-model requests still runs the fused
    decoder layer (its speed is kept); one with an adapter row runs module by module."""
    from fleetllm.model import fused

    _, adapters, refs = setups["llama_gqa"]
    calls = []
    original = fused.run_layers
    monkeypatch.setattr(fused, "run_layers", lambda *a: calls.append(1) or original(*a))
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == refs[None][0]
    if not fused.cpu_kernels.available():
        pytest.skip("no CPU kernels: no fused layer to keep")
    assert calls  # decode steps of the base-only request
    calls.clear()
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                         lora_request=lora_request(adapters[0], 1))
    assert out.outputs[0].token_ids == refs[1][0] and not calls


def test_a_grammar_and_an_adapter_on_the_same_request(base, llm, tmp_path):
    """Structured outputs and LoRA compose: the adapter changes what the model prefers, the
    grammar what it may say; a request with both follows its grammar, beside one without."""
    import re

    from fleetllm import StructuredOutputsParams

    adapter = lora_request(make_adapter(base, tmp_path / "a", targets=ATTN + MLP), 41)
    so = StructuredOutputsParams(regex="[a-f]{2,5}-(left|right)")
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=8)]
    outs = llm.generate(["x = ", "x = "], params, lora_request=[adapter, adapter],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch(so.regex, outs[0].outputs[0].text)
    assert len(outs[1].outputs[0].token_ids) == 8
