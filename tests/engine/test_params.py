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


# One value per SamplingParams field that differs from a plain greedy request's (the fast
# paths' classification is checked against what each does to SamplingParams.fast_paths).
FIELD_EXAMPLES = {
    "n": 2, "temperature": 0.7, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 7,
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
    "max_tokens": 3, "min_tokens": 2, "stop": ["x"], "stop_token_ids": [5],
    "ignore_eos": True, "eos_token_ids": [2], "logprobs": 1, "prompt_logprobs": 1,
    "include_stop_str_in_output": True, "skip_special_tokens": False,
    "structured_outputs": {"regex": "[ab]+"}, "guided_decoding": {"choice": ["a", "b"]},
    "kv_transfer_params": {"do_remote_decode": True},
}


def test_every_sampling_params_field_is_classified_for_the_fast_paths():
    """A new SamplingParams field fails here until FAST_PATH_FIELDS says what it rules out of
    multi-step calls, drafts and the greedy passes (fleetllm/fast_paths.py), and it has an
    example value below, against which the classification is checked."""
    from dataclasses import fields

    from fleetllm.sampling_params import ARGMAX, EVERY, FAST_PATH_FIELDS, NOTHING

    names = {f.name for f in fields(SamplingParams)}
    assert set(FAST_PATH_FIELDS) == names, "classify the new field in FAST_PATH_FIELDS"
    assert set(FAST_PATH_FIELDS.values()) <= {NOTHING, ARGMAX, EVERY}
    assert set(FIELD_EXAMPLES) == names


@pytest.mark.parametrize("name", sorted(FIELD_EXAMPLES))
def test_the_fast_path_classification_is_what_the_fast_paths_read(name):
    """Each field changes a greedy request's SamplingParams.fast_paths as FAST_PATH_FIELDS
    says: not at all, only the greedy passes' plain argmax, or every fast path."""
    from fleetllm.sampling_params import ARGMAX, EVERY, FAST_PATH_FIELDS, FastPaths

    plain = SamplingParams(temperature=0).fast_paths
    assert plain == FastPaths(runs_ahead=True, argmax_from=0)
    got = SamplingParams(**{"temperature": 0, name: FIELD_EXAMPLES[name]}).fast_paths
    kind = FAST_PATH_FIELDS[name]
    if kind == EVERY:
        assert got == FastPaths(runs_ahead=False, argmax_from=None)
    elif kind == ARGMAX:
        assert got.runs_ahead and got.argmax_from != 0, got
    else:
        assert got == plain


def test_the_fast_path_predicates_add_the_steps_state():
    """fast_paths: which requests multi-step calls, drafts and the greedy passes take (the
    engine's _num_steps, SpecDecodeWorker and MultiStepWorker all ask it)."""
    from fleetllm import fast_paths
    from fleetllm.lora.request import LoRARequest
    from fleetllm.sequence import SequenceData, SequenceGroupMetadata

    def group(outputs=0, is_prompt=False, do_sample=True, lora=None, **params):
        data = SequenceData([1, 2, 3], list(range(10, 10 + outputs)))
        return SequenceGroupMetadata("r", is_prompt, {0: data},
                                     SamplingParams(**{"temperature": 0, **params}), {0: [0]},
                                     do_sample=do_sample, lora_request=lora)

    def paths(g):
        return (fast_paths.multi_step([g]), fast_paths.may_draft(g), fast_paths.plain_argmax([g]))

    assert paths(group()) == (True, True, True)
    assert paths(group(is_prompt=True)) == (False, False, False)
    assert paths(group(do_sample=False))[1:] == (False, False)
    assert paths(group(structured_outputs={"regex": "a+"})) == (False, False, False)
    for knob in ({"presence_penalty": 0.5}, {"logprobs": 0}, {"temperature": 0.5, "seed": 1}):
        assert paths(group(**knob)) == (True, True, False), knob
    assert paths(group(lora=LoRARequest("a", 1, "/nowhere"))) == (True, True, False)
    # min_tokens holds a stop token back until that many outputs exist: the sampler's work.
    assert paths(group(outputs=1, min_tokens=2)) == (True, True, False)
    assert paths(group(outputs=2, min_tokens=2)) == (True, True, True)
    # One group off the plain argmax takes its batch off the greedy passes.
    assert not fast_paths.plain_argmax([group(), group(logprobs=1)])
    assert not fast_paths.multi_step([group(), group(is_prompt=True)])
