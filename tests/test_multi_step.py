"""Multi-step decoding (num_scheduler_steps=k): a decode-only batch runs k passes per call to
the workers and gives the same tokens as one pass per call (greedy, seeded sampling with
penalties and n > 1, stop strings and max_tokens ending sequences mid-call), on uni, mp (TP=2,
PP=2) and ray; prompts, waiting requests and grammars still go one pass at a time; every
block comes back. The randomized differential test with multi-step on is in
test_random_workloads.py."""

from __future__ import annotations

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.engine.arg_utils import DEMO_MODEL
from fleetllm.errors import ConfigurationError
from fleetllm.sampling_params import StructuredOutputsParams

PROMPTS = ["def add(a, b):\n", "The cat sat on the", "import os\n", "class Engine:\n"]
PARAMS = [SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=30, stop=["\n"]),
          SamplingParams(temperature=0.6, seed=1, presence_penalty=0.5,
                         repetition_penalty=1.1, max_tokens=50, logprobs=2)]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


class StepLog:
    """Wraps the executor's execute_model: each call's num_steps and whether it held a
    prompt chunk."""

    def __init__(self, llm: LLM):
        executor = llm.llm_engine.model_executor
        self.inner, self.calls = executor.execute_model, []

        def execute_model(request):
            self.calls.append((request.num_steps,
                               any(g.is_prompt for g in request.seq_group_metadata_list)))
            return self.inner(request)

        executor.execute_model = execute_model


@pytest.fixture(scope="module")
def reference():
    with LLM(str(DEMO_MODEL), kv_cache_memory=64 << 20) as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.mark.parametrize("steps", [2, 8])
def test_same_tokens_in_fewer_calls(reference, steps):
    with LLM(str(DEMO_MODEL), kv_cache_memory=64 << 20, num_scheduler_steps=steps) as llm:
        log = StepLog(llm)
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        bm = llm.llm_engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks and not bm.block_tables
    assert tokens(got) == tokens(reference)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in reference]
    assert [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in reference]
    for a, b in zip(got[3].outputs[0].logprobs, reference[3].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert all(n == 1 for n, prompt in log.calls if prompt)  # prompts go one pass at a time
    assert any(n == steps for n, _ in log.calls)
    # 50 tokens at most: the prefill, then ceil(49 / steps) calls
    assert len(log.calls) <= 1 + -(-49 // steps)


def test_waiting_requests_and_grammars_go_one_pass_at_a_time(tiny_models):
    """max_num_seqs=2 with 4 requests: while two wait, the running ones decode one pass per
    call (a waiting request is admitted as soon as a slot frees); a request with a grammar
    keeps the whole batch at one pass."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 17]} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 10 * i, ignore_eos=True)
              for i in range(4)]
    with LLM(tiny_models["llama_gqa"]) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], num_scheduler_steps=4, max_num_seqs=2) as llm:
        log = StepLog(llm)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(got) == tokens(want)
        assert log.calls[:3] == [(1, True), (1, False), (1, False)]  # two wait meanwhile
        assert (4, False) in log.calls  # the last ones, alone, run 4 passes per call
        log.calls.clear()
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        grammar = SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(json=schema))
        llm.generate(["x", "y"], [grammar, SamplingParams(max_tokens=20)], use_tqdm=False)
        assert all(n == 1 for n, _ in log.calls[:3])


def test_distributed_backends_same_tokens(tiny_models, distributed):
    """Each rank feeds the output rank's tokens (broadcast) back into its own copy."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33] * (1 + i)} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=19, ignore_eos=True,
                             presence_penalty=0.4)] * 2
    params.append(SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=16,
                                 ignore_eos=True))
    with LLM(tiny_models["llama_gqa"]) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], num_scheduler_steps=8, **distributed) as llm:
        log = StepLog(llm)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert len(log.calls) <= 4  # the prefill, then 8 + 8 + 4 passes


def test_sequences_near_max_model_len_stop_there(tiny_models):
    """A pass never goes past max_model_len (no position beyond the model's), whatever k."""
    prompts = [{"prompt_token_ids": [7] * n} for n in (50, 58, 60)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], max_model_len=64) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], max_model_len=64, num_scheduler_steps=8) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [14, 6, 4]


def test_configuration_is_checked(tiny_models):
    model = tiny_models["llama_gqa"]
    with pytest.raises(ConfigurationError, match="num_scheduler_steps: must be an int >= 1"):
        LLM(model, num_scheduler_steps=0)
    with pytest.raises(ConfigurationError, match="cannot be combined"):
        LLM(model, num_scheduler_steps=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
