"""The executor contract, in one process (issue: executor contract)."""

from __future__ import annotations

import random
import time

import pytest
import torch
from helpers import BlockAllocator, check_close, greedy_run, hf_greedy, load_hf

from fleetllm.config import EngineConfig
from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    FleetLLMError,
    ModelLoadError,
    RemoteWorkerError,
)
from fleetllm.executor import Executor
from fleetllm.executor.uniproc import UniProcExecutor
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata


def make_executor(path, **kwargs) -> Executor:
    cfg = EngineConfig.from_kwargs(model=str(path), kv_cache_memory=32 << 20, **kwargs)
    executor = Executor.get_class(cfg)(cfg)
    executor.initialize_cache(*executor.determine_num_available_blocks())
    return executor


@pytest.fixture(scope="module")
def llama_executor(tiny_models):
    with make_executor(tiny_models["llama_gqa"]) as executor:
        yield executor


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "llama_tied", "qwen3_qknorm",
                                  "llama3_rope"])
def test_batched_prefill_then_decode_matches_hf(tiny_models, name):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 33, 70)]
    with make_executor(tiny_models[name]) as executor:
        assert isinstance(executor, UniProcExecutor)
        ours = greedy_run(executor, prompts, max_tokens=10)
    hf = load_hf(tiny_models[name])
    for prompt, result in zip(prompts, ours, strict=True):
        check_close(result, hf_greedy(hf, prompt, 10), top=5, atol=1e-3)


def _prompt_request(seq_id, data, table, chunk, do_sample, n_logprobs=5):
    params = SamplingParams(temperature=0.0, logprobs=20, prompt_logprobs=n_logprobs)
    return SequenceGroupMetadata(f"req{seq_id}", True, {seq_id: data}, params,
                                 {seq_id: table}, chunk, do_sample)


def _run_prefill(executor, seq_id, prompt, table, chunks, computed=0):
    """Prefill `prompt` from `computed` on in the given chunk sizes; returns the collected
    prompt logprobs and the final sampled token's logprobs."""
    data = SequenceData(list(prompt), num_computed_tokens=computed)
    prompt_lps, sample = [], None
    for size in chunks:
        done = data.num_computed_tokens + size == len(prompt)
        [out] = executor.execute_model(ExecuteModelRequest(
            [_prompt_request(seq_id, data, table, size, done)]))
        group = out.outputs[0]
        prompt_lps += group.prompt_logprobs
        if done:
            [sample] = group.samples
        else:
            assert group.samples == []
        data.num_computed_tokens += size
    return prompt_lps, sample


def _assert_same(lps_a, lps_b, atol=1e-4):
    assert len(lps_a) == len(lps_b)
    for a, b in zip(lps_a, lps_b, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k].logprob - b[k].logprob) < atol


def test_chunked_prefill_and_cached_prefix_match_full_prefill(llama_executor):
    rng = random.Random(2)
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    alloc = BlockAllocator(16)
    full_lps, full_sample = _run_prefill(llama_executor, 0, prompt, alloc.ensure(0, 300), [300])
    assert len(full_lps) == 300 and full_lps[0] is None
    chunked_lps, chunked_sample = _run_prefill(llama_executor, 1, prompt, alloc.ensure(1, 300),
                                               [64, 64, 64, 64, 44])
    _assert_same(full_lps, chunked_lps)
    _assert_same([full_sample.logprobs], [chunked_sample.logprobs])
    assert full_sample.output_token == chunked_sample.output_token

    # A second sequence that shares seq 0's first 128 tokens reuses its cached blocks and
    # computes only the rest: same logits as a full prefill of it.
    other = prompt[:128] + [rng.randrange(3, 500) for _ in range(90)]
    table = alloc.tables[0][:8] + alloc.ensure(2, 218)[8:]
    prefix_lps, prefix_sample = _run_prefill(llama_executor, 2, other, table, [90],
                                             computed=128)
    ref_lps, ref_sample = _run_prefill(llama_executor, 3, other, alloc.ensure(3, 218), [218])
    # Token 128's logprob comes from position 127, inside the cached prefix: not recomputed.
    _assert_same(ref_lps[129:], prefix_lps)
    _assert_same([ref_sample.logprobs], [prefix_sample.logprobs])


def _decode_steps(executor, data, table, steps, seq_id=0):
    params = SamplingParams(temperature=0.0, logprobs=3)
    tokens = []
    for _ in range(steps):
        [out] = executor.execute_model(ExecuteModelRequest([SequenceGroupMetadata(
            "r", False, {seq_id: data}, params, {seq_id: table}, 1, True)]))
        token = out.outputs[0].samples[0].output_token
        data.output_token_ids.append(token)
        data.num_computed_tokens += 1
        tokens.append(token)
    return tokens


def test_swap_out_swap_in_and_copy_leave_outputs_unchanged(llama_executor):
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    base_table = [1, 2, 3, 4]  # room for 64 tokens
    _, first = _run_prefill(llama_executor, 0, prompt, base_table, [40])
    data = SequenceData(list(prompt), [first.output_token], 40)
    reference = _decode_steps(llama_executor, data, base_table, 8)

    _, first = _run_prefill(llama_executor, 0, prompt, base_table, [40])
    data = SequenceData(list(prompt), [first.output_token], 40)
    head = _decode_steps(llama_executor, data, base_table, 3)
    # Swap the blocks out, clobber the device blocks, swap back in elsewhere.
    llama_executor.execute_model(ExecuteModelRequest(
        [], blocks_to_swap_out={1: 0, 2: 1, 3: 2, 4: 3}))
    llama_executor.collective_rpc(lambda w: [c.zero_() for c in w.cache_engine.gpu_cache])
    llama_executor.execute_model(ExecuteModelRequest(
        [], blocks_to_swap_in={0: 11, 1: 12, 2: 13, 3: 14}))
    swapped_table = [11, 12, 13, 14]
    middle = _decode_steps(llama_executor, data, swapped_table, 2)
    # Copy the blocks (copy-on-write style) and continue from the copies.
    llama_executor.execute_model(ExecuteModelRequest(
        [], blocks_to_copy={11: [21], 12: [22], 13: [23], 14: [24]}))
    llama_executor.collective_rpc(lambda w: [c[:, 11:15].zero_()
                                             for c in w.cache_engine.gpu_cache])
    tail = _decode_steps(llama_executor, data, [21, 22, 23, 24], 3)
    assert head + middle + tail == reference


def test_collective_rpc(llama_executor):
    ex = llama_executor
    assert ex.collective_rpc("check_health") == [None]
    assert ex.collective_rpc(lambda w: w.rank) == [0]
    assert ex.collective_rpc(lambda w, a, b=0: a + b, args=(2,), kwargs={"b": 3}) == [5]
    offset = 10
    assert ex.collective_rpc(lambda w: w.rank + offset) == [10]  # closures too

    def boom(worker):
        raise ValueError("boom from the worker")

    with pytest.raises(ValueError) as info:
        ex.collective_rpc(boom)
    assert isinstance(info.value, RemoteWorkerError)
    assert "rank 0" in str(info.value) and "boom from the worker" in str(info.value)
    assert "Traceback" in str(info.value) and "in boom" in str(info.value)
    [err] = ex.collective_rpc(boom, return_exceptions=True)
    assert isinstance(err, ValueError) and "boom" in str(err)

    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError):
        ex.collective_rpc(lambda w: time.sleep(3), timeout=0.3)
    assert time.monotonic() - start < 1.5
    assert ex.collective_rpc(lambda w: "still usable") == ["still usable"]


def test_executor_get_class(tiny_models):
    base = EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]))
    assert Executor.get_class(base) is UniProcExecutor
    base.parallel_config.distributed_executor_backend = "fleetllm.executor.uniproc:UniProcExecutor"
    assert Executor.get_class(base) is UniProcExecutor
    base.parallel_config.distributed_executor_backend = UniProcExecutor
    assert Executor.get_class(base) is UniProcExecutor
    for bad in ("fleetllm.sequence:SequenceData", "no.such.module:Thing", int):
        base.parallel_config.distributed_executor_backend = bad
        with pytest.raises(ConfigurationError, match="distributed_executor_backend|import"):
            Executor.get_class(base)


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size": 3}, "block_size"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size"),  # 4 heads not divisible by 3
    ({"pipeline_parallel_size": 5}, "pipeline_parallel_size"),  # 2 layers
    ({"dtype": "int7"}, "dtype"),
    ({"max_model_len": 10**6}, "max_model_len"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"preemption_mode": "pause"}, "preemption_mode"),
    ({"distributed_executor_backend": "bogus"}, "distributed_executor_backend"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
     "distributed_executor_backend"),
    ({"load_format": "pickle"}, "load_format"),
    ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ({"swap_space": 4}, "swap_space"),  # bytes, not vLLM's GiB: a clear hint instead of 0
    ({"no_such_option": 1}, "no_such_option"),
])
def test_bad_config_values_raise_configuration_error(tiny_models, kwargs, field):
    with pytest.raises(ConfigurationError, match=field) as info:
        EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]), **kwargs)
    assert info.value.code == "E005" and isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5),
                                    dict(n=0), dict(max_tokens=0), dict(min_p=2),
                                    dict(logprobs=-1), dict(stop=[""]),
                                    dict(min_tokens=5, max_tokens=2)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ConfigurationError):
        SamplingParams(**kwargs)


def test_missing_and_corrupt_checkpoints(tiny_models, tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        EngineConfig.from_kwargs(model=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        EngineConfig.from_kwargs(model=str(tmp_path / "empty"))

    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["llama_gqa"], broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors") as info:
        make_executor(broken)
    assert info.value.code == "E004" and isinstance(info.value, FleetLLMError)

    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        make_executor(broken)

    (broken / "config.json").write_text("{ truncated")
    with pytest.raises(ModelLoadError, match="config.json"):
        EngineConfig.from_kwargs(model=str(broken))


def test_dummy_weights_and_out_of_memory(tiny_models):
    from fleetllm.errors import OutOfMemoryError

    with make_executor(tiny_models["llama_gqa"], load_format="dummy") as ex:
        norms = ex.collective_rpc(lambda w: float(next(iter(
            w.model_runner.model.parameters())).abs().mean()))
        assert 0 < norms[0] < 1
    cfg = EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]), kv_cache_memory=4096)
    with Executor.get_class(cfg)(cfg) as ex, pytest.raises(OutOfMemoryError,
                                                           match="max_model_len"):
        ex.determine_num_available_blocks()
    assert torch.get_num_threads() >= 1


def test_sharded_checkpoint_with_index_loads_the_same_weights(tiny_models, tmp_path):
    import shutil

    import transformers

    src = tiny_models["llama_gqa"]
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="60KB")
    shutil.copy(src / "tokenizer.json", sharded / "tokenizer.json")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompts = [[5, 6, 7, 8], [9] * 20]
    with make_executor(src) as a, make_executor(sharded) as b:
        assert greedy_run(a, prompts, 6) == greedy_run(b, prompts, 6)
    # A shard listed in the index but missing is named in the error.
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        make_executor(sharded)
