"""Wrong types in SamplingParams and engine arguments are ConfigurationErrors naming the field,
never a raw TypeError from deep inside a comparison."""

from __future__ import annotations

import math

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.config import EngineConfig
from fleetllm.errors import ConfigurationError


@pytest.mark.parametrize("field, value", [
    ("n", 2.0), ("n", True), ("n", "2"),
    ("temperature", "0.5"), ("temperature", True), ("temperature", None),
    ("top_p", "1"), ("top_k", 1.5), ("top_k", "5"), ("top_k", True), ("min_p", None),
    ("seed", 1.5), ("seed", "1"), ("seed", False),
    ("presence_penalty", "0"), ("frequency_penalty", [0]), ("repetition_penalty", None),
    ("max_tokens", 16.0), ("max_tokens", "16"), ("min_tokens", 1.0), ("min_tokens", None),
    ("stop", 5), ("stop", ["a", 1]), ("stop", [None]), ("stop", b"x"),
    ("stop_token_ids", 5), ("stop_token_ids", "12"), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]), ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"), ("ignore_eos", 1), ("include_stop_str_in_output", None),
    ("skip_special_tokens", 0), ("logprobs", True), ("logprobs", 1.5),
    ("prompt_logprobs", "1"), ("eos_token_ids", [1.5]), ("eos_token_ids", 2),
])
def test_sampling_params_type_errors_name_the_field(field, value):
    with pytest.raises(ConfigurationError, match=f"^\\[E005\\] {field}:") as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)


def test_sampling_params_accept_what_vllm_accepts():
    p = SamplingParams(temperature=1, top_p=1, min_p=0, presence_penalty=1,
                       repetition_penalty=2, stop=("a", "b"), stop_token_ids=(3, 4), seed=0)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(max_tokens=None)


@pytest.mark.parametrize("kwargs", [
    dict(block_size="16"), dict(block_size=True), dict(max_num_seqs=1.5),
    dict(swap_space="x"), dict(swap_space=1.5e9), dict(kv_cache_memory="1GiB"),
    dict(gpu_memory_utilization="0.9"), dict(startup_timeout="60"),
    dict(num_gpu_blocks_override="3"), dict(tensor_parallel_size=True), dict(seed="0"),
    dict(max_model_len=64.0), dict(max_num_batched_tokens="2048"), dict(dtype=5),
    dict(worker_cls=5), dict(tokenizer=5), dict(preemption_mode=1), dict(device=None),
    dict(load_format=None), dict(distributed_executor_backend=5),
])
def test_engine_argument_type_errors_name_the_field(tiny_models, kwargs):
    [(field, value)] = kwargs.items()
    with pytest.raises(ConfigurationError, match=f"^\\[E005\\] {field}:") as info:
        EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]), **kwargs)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(block_size="16"), dict(max_num_seqs=1.5),
                                    dict(swap_space="x")])
def test_llm_reports_engine_argument_type_errors(tiny_models, kwargs):
    [field] = kwargs
    with pytest.raises(ConfigurationError, match=field):
        LLM(tiny_models["llama_gqa"], **kwargs)


def test_engine_arguments_of_the_right_type_still_work(tiny_models):
    import torch

    cfg = EngineConfig.from_kwargs(model=tiny_models["llama_gqa"],
                                   tokenizer=tiny_models["llama_gqa"], dtype=torch.float32,
                                   kv_cache_memory=1 << 25, startup_timeout=5,
                                   gpu_memory_utilization=1)
    assert cfg.model_config.tokenizer == str(tiny_models["llama_gqa"])


@pytest.mark.parametrize("kwargs", [dict(top_k=1 << 40), dict(seed=1 << 70),
                                    dict(temperature=math.inf),
                                    dict(repetition_penalty=math.inf)])
def test_values_no_worker_can_hold_are_refused_up_front(kwargs):
    """Such a value used to reach the workers (a tensor overflow there fails the executor,
    and every request with it); now it is the request's own ConfigurationError."""
    [field] = kwargs
    with pytest.raises(ConfigurationError, match=f"^\\[E005\\] {field}:"):
        SamplingParams(**kwargs)


def test_extreme_but_valid_values_run(tiny_models):
    params = SamplingParams(temperature=1.0, seed=(1 << 64) - 1, top_k=(1 << 31) - 1,
                            max_tokens=3, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=1 << 25) as llm:
        [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
