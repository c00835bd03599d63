"""Executor lifecycle (issue: fault tolerance and executor lifecycle): sleep / wake, sharded
state, performance metrics, on the uni and mp (TP=2) backends."""

from __future__ import annotations

import json
import os

import pytest
from conftest import make_checkpoint

from fleetllm import LLM, SamplingParams
from fleetllm.engine.llm_engine import LLMEngine
from fleetllm.errors import ConfigurationError, EngineSleepingError
from fleetllm.model import sharded_state
from fleetllm.model.sharded_state import METADATA_FILE

KV = 256 << 20  # per worker: big enough that freeing it is unambiguous in RSS
SWAP = 16 << 20
SMALL_KV = 32 << 20
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 99, 300 + 7 * i, 42, 8 + i]} for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy(llm: LLM, prompts: list[dict] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def rss(executor) -> int:
    """VmRSS summed over the processes that hold the workers (uni: this one)."""
    total = 0
    for pid in getattr(executor, "worker_pids", None) or [os.getpid()]:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f
                          if line.startswith("VmRSS:"))
    return total


def kv_and_weight_bytes(executor) -> tuple[int, int]:
    kv = executor.collective_rpc(lambda w: w.cache_engine.nbytes())
    weights = executor.collective_rpc(lambda w: sum(  # parameters and the kernels' copies
        t.nbytes for t in w.model_runner.model.parameters()) + sum(
        m.kernel.nbytes for m in w.model_runner.model.modules()
        if getattr(m, "kernel", None) is not None))
    return sum(kv), sum(weights)


def buffer_sums(executor) -> list[dict[str, float]]:
    """A checksum of every model buffer (RoPE cos/sin tables) on every rank."""
    return executor.collective_rpc(lambda w: {
        name: float(b.double().abs().sum()) for name, b in
        w.model_runner.model.named_buffers()})


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """~100 MB of float32 weights (embedding and LM head 32 MiB each, 4 layers of 9 MiB)."""
    return make_checkpoint(tmp_path_factory.mktemp("big") / "m", "LlamaForCausalLM", seed=3,
                           hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                           vocab_size=16384)


@pytest.mark.parametrize("tp", [1, 2], ids=["uni", "mp-tp2"])
def test_sleep_frees_memory_and_wake_up_restores_the_same_outputs(big_model, tp):
    with LLM(big_model, kv_cache_memory=KV, swap_space=SWAP, tensor_parallel_size=tp) as llm:
        ex = llm.llm_engine.model_executor
        reference = greedy(llm)
        kv, weights = kv_and_weight_bytes(ex)
        assert kv >= tp * KV and weights >= 90 << 20
        buffers = buffer_sums(ex)
        assert all(buffers) and all(v > 0 for b in buffers for v in b.values())

        # level 1: the KV cache goes (on CPU the weights have nowhere better to be)
        before = rss(ex)
        llm.sleep(1)
        dropped = before - rss(ex)
        print(f"tp={tp} level 1: RSS -{dropped / 2**20:.0f} MiB, KV {kv / 2**20:.0f} MiB")
        assert dropped >= 0.8 * kv
        assert ex.is_sleeping and ex.sleeping_tags == {"weights", "kv_cache"}
        llm.sleep(1)  # harmless, and a deeper sleep while asleep changes nothing either
        llm.sleep(2)
        assert ex.collective_rpc(lambda w: w.cache_engine) == [None] * tp
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        llm.wake_up()
        llm.wake_up()  # harmless
        assert not ex.is_sleeping and ex.sleeping_tags == set()
        assert kv_and_weight_bytes(ex) == (kv, weights)  # the same number of blocks
        assert greedy(llm) == reference

        # level 2: the weights go too; woken in two steps, weights first (as for RLHF)
        before = rss(ex)
        llm.sleep(2)
        dropped = before - rss(ex)
        print(f"tp={tp} level 2: RSS -{dropped / 2**20:.0f} MiB, KV + weights "
              f"{(kv + weights) / 2**20:.0f} MiB")
        assert dropped >= 0.8 * (kv + weights)
        llm.wake_up(["weights"])
        assert ex.is_sleeping and ex.sleeping_tags == {"kv_cache"}
        with pytest.raises(EngineSleepingError, match="kv_cache"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        llm.wake_up(["kv_cache"])
        assert not ex.is_sleeping
        assert buffer_sums(ex) == buffers  # RoPE tables survived (vLLM #16889)
        assert greedy(llm) == reference

        metrics = ex.get_performance_metrics()
        assert [w["pid"] for w in metrics["resources"]["workers"]] == \
            (ex.worker_pids if tp > 1 else [os.getpid()])
        assert metrics["requests"] == {"total": 12, "completed": 12, "failed": 0}


def test_a_step_while_asleep_is_refused_and_its_request_runs_after_wake_up(tiny_models):
    # dummy weights: a level-2 wake-up draws them again from the seed, the same ones
    engine = LLMEngine.from_engine_args(str(tiny_models["llama_gqa"]),
                                        kv_cache_memory=SMALL_KV, load_format="dummy")
    try:
        def run(request_id: str) -> list[int]:
            engine.add_request(request_id, PROMPTS[1], GREEDY)
            while True:
                for out in engine.step():
                    if out.finished:
                        return out.outputs[0].token_ids

        reference = run("a")
        engine.sleep(2)
        engine.add_request("b", PROMPTS[1], GREEDY)
        with pytest.raises(EngineSleepingError):
            engine.step()
        assert engine.has_unfinished_requests()  # still queued
        engine.wake_up()
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == "b"
                if out.finished:
                    assert out.outputs[0].token_ids == reference
        # A request in flight holds KV blocks that sleeping would wipe: refused.
        engine.add_request("c", PROMPTS[1], GREEDY)
        engine.step()
        with pytest.raises(EngineSleepingError, match="in flight"):
            engine.sleep()
        assert not engine.model_executor.is_sleeping
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sleep_level_2_frees_the_packed_weights_the_one_call_layers_gathered(tiny_models,
                                                                             dtype):
    """Decode steps past the GEMV's rows gather every projection's packed copy once for the
    one-call layers (fused._Stack.packed) instead of at each step; sleep level 2 must still
    free those copies (the emptied model is kept while asleep), and after wake-up the new
    copies are the ones read."""
    import gc
    import weakref

    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 300 + 7 * i, 42]} for i in range(20)]
    with LLM(str(tiny_models["llama_gqa"]), dtype=dtype, kv_cache_memory=SMALL_KV) as llm:
        reference = greedy(llm, prompts)  # decode steps of 20 rows: past any GEMV limit
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        stack = model.__dict__.get("_fused_stack")
        assert stack is not None and stack.packed, "the one-call layers gathered no weights"
        alive = [weakref.ref(t) for got in stack.packed.values() if got for t in got[1]]
        del stack, model
        llm.sleep(2)
        gc.collect()
        assert not [r for r in alive if r() is not None], "sleep kept packed weights alive"
        llm.wake_up()
        assert greedy(llm, prompts) == reference


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory):
    """509 tokens: with TP=2 the second vocabulary shard is zero-padded."""
    return make_checkpoint(tmp_path_factory.mktemp("odd") / "m", "LlamaForCausalLM", seed=7,
                           vocab_size=509)


@pytest.mark.parametrize("name", ["odd_vocab", "llama_tied"])
def test_sharded_state_round_trip_tp2(tiny_models, odd_vocab_model, tmp_path, name):
    src = odd_vocab_model if name == "odd_vocab" else tiny_models[name]
    out = tmp_path / "sharded"
    with LLM(src, kv_cache_memory=SMALL_KV, tensor_parallel_size=2) as llm:
        reference = greedy(llm)
        text = llm.generate("def fibonacci(n):", GREEDY, use_tqdm=False)[0].outputs[0].text
        llm.llm_engine.model_executor.save_sharded_state(out, max_size=40 << 10)

    meta = json.loads((out / METADATA_FILE).read_text())
    assert (meta["tensor_parallel_size"], meta["pipeline_parallel_size"],
            meta["world_size"], meta["dtype"]) == (2, 1, 2, "float32")
    files = [meta["files"]["0"], meta["files"]["1"]]
    for rank, names in enumerate(files):
        assert len(names) >= 3, names  # max_size forced several parts per rank
        assert names == [f"model-rank-{rank}-part-{i}.safetensors" for i in range(len(names))]
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / f).exists(), f
    assert not (out / "model.safetensors").exists()
    if name == "llama_tied":  # one tensor, saved once per rank, tied again on load
        from safetensors import safe_open

        keys = [k for n in files[0] for k in safe_open(str(out / n), framework="pt").keys()]
        assert "embed_tokens.weight" in keys and "lm_head.weight" not in keys

    with LLM(out, load_format="sharded_state", kv_cache_memory=SMALL_KV,
             tensor_parallel_size=2) as llm:
        opened = llm.llm_engine.model_executor.collective_rpc(
            lambda w: [os.path.basename(f) for f in sharded_state.OPENED_FILES])
        assert opened == files  # each rank read its own files, and only those
        assert greedy(llm) == reference
        assert llm.generate("def fibonacci(n):", GREEDY,  # the tokenizer came along
                            use_tqdm=False)[0].outputs[0].text == text

    with pytest.raises(ConfigurationError, match="tensor_parallel_size=2, "
                                                 "pipeline_parallel_size=1"):
        LLM(out, load_format="sharded_state", kv_cache_memory=SMALL_KV)


def test_save_sharded_state_checks_its_arguments(tiny_models, tmp_path):
    path = tiny_models["llama_gqa"]
    with LLM(path, kv_cache_memory=SMALL_KV) as llm:
        ex = llm.llm_engine.model_executor
        with pytest.raises(ConfigurationError, match="pattern"):
            ex.save_sharded_state(tmp_path / "a", pattern="weights.safetensors")
        with pytest.raises(ConfigurationError, match="max_size"):
            ex.save_sharded_state(tmp_path / "b", max_size=0)
        with pytest.raises(ConfigurationError, match="own directory"):
            ex.save_sharded_state(path)
        llm.sleep(2)
        with pytest.raises(EngineSleepingError):
            ex.save_sharded_state(tmp_path / "c")


def test_performance_metrics_follow_a_known_load(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=SMALL_KV) as llm:
        ex = llm.llm_engine.model_executor
        m = ex.get_performance_metrics()
        assert m["requests"] == {"total": 0, "completed": 0, "failed": 0}
        assert m["execute_model"]["calls"] == 0 and m["execute_model"]["latency_ms"]["p50"] is None

        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate(PROMPTS, params, use_tqdm=False)
        m = ex.get_performance_metrics()
        assert m["requests"] == {"total": 4, "completed": 4, "failed": 0}
        # one step prefills all four prompts and samples their first token, five decode
        assert m["execute_model"]["calls"] == 6 and m["execute_model"]["errors"] == 0
        assert m["throughput"]["tokens_total"] == 24
        lat = m["execute_model"]["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] and lat["avg"] > 0
        assert m["execute_model"]["window"] == 6
        assert m["throughput"]["tokens_per_s"] > 0 and m["throughput"]["requests_per_s"] > 0
        [w] = m["resources"]["workers"]
        assert w["pid"] == os.getpid() and w["rss_bytes"] > SMALL_KV and w["error"] is None
        assert w["cpu_percent"] is not None and w["cpu_percent"] >= 0
        assert w["kv_cache_bytes"] == kv_and_weight_bytes(ex)[0]
        assert m["resources"]["kv_cache"]["blocks_total"] == ex.cache_config.num_gpu_blocks
        assert m["resources"]["kv_cache"]["blocks_used"] == 0  # nothing in flight
        assert m["workers"] == {"world_size": 1, "active": 1, "failed": 0, "restarts": 0}

        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
        ex.metrics.record_restart()  # what the restart code will do
        llm.sleep(1)
        m = ex.get_performance_metrics()
        assert m["requests"] == {"total": 6, "completed": 6, "failed": 0}
        assert m["execute_model"]["calls"] == 9 and m["throughput"]["tokens_total"] == 30
        assert m["workers"]["restarts"] == 1
        assert m["resources"]["kv_cache"]["bytes"] == 0
        assert m["sleep"] == {"is_sleeping": True, "tags": ["kv_cache", "weights"]}
    m = ex.get_performance_metrics()  # after shutdown: counts kept, nobody running
    assert m["workers"]["active"] == 0 and m["workers"]["failed"] == 0
    assert m["requests"]["total"] == 6


def test_a_request_that_cannot_be_scheduled_counts_as_failed(tiny_models):
    # Two samples of a 30-token prompt fit a pool of 4 blocks when admitted, then outgrow
    # it: preempted, then ignored. (The stop string never matches: a request certain to
    # outgrow the pool is refused at admission instead.)
    with LLM(tiny_models["llama_gqa"], num_gpu_blocks_override=4, block_size=16) as llm:
        [out] = llm.generate({"prompt_token_ids": list(range(3, 33))},
                             SamplingParams(n=2, max_tokens=40, ignore_eos=True,
                                            stop=["\x00" * 4]),
                             use_tqdm=False)
        assert out.outputs[0].finish_reason == "error"
        m = llm.llm_engine.model_executor.get_performance_metrics()
        assert m["requests"] == {"total": 1, "completed": 0, "failed": 1}
