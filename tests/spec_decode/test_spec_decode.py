"""Speculative decoding (n-gram drafts) end to end: the same tokens as without it (greedy,
seeded sampling with penalties and n > 1, stop strings, structured outputs), on uni, mp
(TP=2, PP=2) and ray; drafts really accepted (metrics); the lookahead slots freed with the
sequence; vLLM's speculative_config checked. The randomized differential test with
speculation on is in test_random_workloads.py, the n-gram proposer alone in
test_spec_decode_units.py."""

from __future__ import annotations

import json

import pytest
from helpers import load_tool

from fleetllm import LLM, SamplingParams
from fleetllm.config import EngineConfig
from fleetllm.config_speculative import SpeculativeConfig
from fleetllm.engine.arg_utils import DEMO_MODEL
from fleetllm.errors import ConfigurationError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# Copy-heavy: the continuation repeats what the prompt holds, so n-gram drafts are accepted.
COPY_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "one two three four five, one two three four five, one two three",
    "import os\nimport sys\nimport os\nimport",
]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def demo_pair():
    base = LLM(str(DEMO_MODEL), kv_cache_memory=64 << 20)
    spec = LLM(str(DEMO_MODEL), kv_cache_memory=64 << 20, speculative_config=NGRAM)
    yield base, spec
    base.shutdown()
    spec.shutdown()


def test_greedy_demo_model_same_tokens_and_drafts_accepted(demo_pair):
    base, spec = demo_pair
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = base.generate(COPY_PROMPTS, params, use_tqdm=False)
    before = spec.llm_engine.spec_decode_metrics
    accepted_before = before.accepted_tokens if before else 0
    got = spec.generate(COPY_PROMPTS, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    m = spec.llm_engine.spec_decode_metrics
    assert m.accepted_tokens - accepted_before > 32, m  # most of the output was drafted
    assert m.emitted_tokens == m.accepted_tokens + m.spec_sequences
    assert 0 < m.draft_acceptance_rate <= 1 and 0 < m.system_efficiency <= 1
    # every block back in the pool: the lookahead slots went with their sequences
    bm = spec.llm_engine.scheduler.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks and not bm.block_tables


def test_seeded_sampling_penalties_and_n_same_tokens(demo_pair):
    """A seeded draw at a position is the same with or without drafts before it: sampled
    outputs are not only distributed as without speculation, they are the same tokens."""
    base, spec = demo_pair
    params = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, n=3, max_tokens=40,
                       ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, presence_penalty=0.6,
                       repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=40,
                       ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=20, max_tokens=30, logprobs=3),
    ]
    want = base.generate(COPY_PROMPTS, params, use_tqdm=False)
    got = spec.generate(COPY_PROMPTS, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    for a, b in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_stops_inside_an_accepted_run_discard_the_rest(demo_pair):
    """Stop strings, stop tokens and max_tokens that land in the middle of a step's accepted
    drafts end the sequence there, as without speculation."""
    base, spec = demo_pair
    want_full = base.generate(COPY_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40,
                                                               ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    stop_token = want_full.token_ids[9]
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 7)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop=[want_full.text[12:15]]),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token],
                             ignore_eos=True)]
    for params in cases:
        want = base.generate(COPY_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate(COPY_PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), params


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "qwen3_qknorm"])
def test_random_checkpoints_greedy_same_tokens(tiny_models, name):
    prompts = [{"prompt_token_ids": ([5, 9, 17, 33, 2 + i] * 8)[:30 + i]} for i in range(6)]
    prompts.append({"prompt_token_ids": list(range(3, 200))})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(tiny_models[name], block_size=4) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models[name], block_size=4, speculative_config=NGRAM) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        assert spec.llm_engine.spec_decode_metrics.accepted_tokens > 0
    assert tokens(got) == tokens(want)


def test_preemption_and_prefix_caching_keep_tokens(tiny_models):
    """A pool too small for the batch (sequences are preempted and recomputed, their blocks
    and lookahead slots given back) and prefix caching (accepted drafts' blocks become
    findable): the same tokens as a roomy engine without speculation."""
    prompts = [{"prompt_token_ids": ([7, 8, 9, 10] * 12)[:40] + [i + 3] * 3} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], block_size=4) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], block_size=4, num_gpu_blocks_override=60,
             enable_prefix_caching=True, speculative_config=NGRAM) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        again = spec.generate(prompts, params, use_tqdm=False)  # from the prefix cache
        engine = spec.llm_engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.block_manager.prefix_cache.hit_tokens > 0
    assert tokens(got) == tokens(want) == tokens(again)


def test_distributed_backends_same_tokens(tiny_models, distributed):
    prompts = [{"prompt_token_ids": ([5, 9, 17, 33] * 10)[:20 + 3 * i]} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)] * 2
    params.append(SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=16,
                                 ignore_eos=True))
    with LLM(tiny_models["llama_gqa"]) as base:
        want = base.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], speculative_config=NGRAM, **distributed) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        assert spec.llm_engine.spec_decode_metrics.accepted_tokens > 0
        metrics = spec.llm_engine.model_executor.get_performance_metrics()
    assert tokens(got) == tokens(want)
    assert metrics["spec_decode"]["accepted_tokens"] > 0


def test_structured_outputs_are_not_drafted_and_still_parse(tiny_models):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    from fleetllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))
    with LLM(tiny_models["llama_gqa"]) as base:
        want = base.generate(["Hello"], params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], speculative_config=NGRAM) as spec:
        got = spec.generate(["Hello"], params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert isinstance(json.loads(got[0].outputs[0].text)["a"], int)


# ------------------------------------------------------------------------ configuration


def test_speculative_config_is_checked(tiny_models):
    model = str(tiny_models["llama_gqa"])
    make = EngineConfig.from_kwargs
    cfg = make(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative_config == SpeculativeConfig(3, "ngram", 5, 5)  # vLLM's defaults
    assert cfg.scheduler_config.num_lookahead_slots == 3
    assert make(model).scheduler_config.num_lookahead_slots == 0
    # JSON text (the CLI's form), one lookup bound given: the other takes its value
    cfg = make(model, speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                         '"prompt_lookup_max": 3}')
    assert (cfg.speculative_config.prompt_lookup_min,
            cfg.speculative_config.prompt_lookup_max) == (3, 3)
    # vLLM's older flat arguments
    cfg = make(model, speculative_model="[ngram]", num_speculative_tokens=2,
               ngram_prompt_lookup_max=4, ngram_prompt_lookup_min=2)
    assert cfg.speculative_config == SpeculativeConfig(2, "ngram", 4, 2)
    bad = [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an int >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4},
         "not supported"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "goes in 'model'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "EAGLE"),
        ({"method": "magic", "num_speculative_tokens": 2}, "must be one of"),
        ("{not json", "not valid JSON"),
        (4, "must be a dict"),
    ]
    for value, message in bad:
        with pytest.raises(ConfigurationError, match=message):
            make(model, speculative_config=value)
    with pytest.raises(ConfigurationError, match="needs speculative_model"):
        make(model, num_speculative_tokens=3)
    with pytest.raises(ConfigurationError, match="not both"):
        make(model, speculative_config=NGRAM, speculative_model="[ngram]")


def test_cli_flag_parses_json():
    import argparse

    from fleetllm.engine.arg_utils import add_engine_args, engine_kwargs_from

    parser = argparse.ArgumentParser()
    actions = add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    kwargs = engine_kwargs_from(args, actions)
    assert SpeculativeConfig.from_value(kwargs["speculative_config"]) == \
        SpeculativeConfig.from_value(NGRAM)


def test_prometheus_counters_follow_the_engine(demo_pair):
    """/metrics: vLLM's spec_decode_* counters (fleetllm: prefix), moved by the engine's
    running totals (EngineLoad), as the server renders them."""
    from fleetllm.engine.stats import EngineLoad
    from fleetllm.entrypoints.openai.metrics import PrometheusMetrics

    _, spec = demo_pair
    spec.generate(COPY_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True), use_tqdm=False)
    load = EngineLoad.of(spec.llm_engine)
    m = spec.llm_engine.spec_decode_metrics
    assert (load.spec_decode_num_accepted_tokens, load.spec_decode_num_draft_tokens,
            load.spec_decode_num_emitted_tokens) == \
        (m.accepted_tokens, m.draft_tokens, m.emitted_tokens)
    text = PrometheusMetrics("demo").render(load).decode()
    for name, value in (("accepted", m.accepted_tokens), ("draft", m.draft_tokens),
                        ("emitted", m.emitted_tokens)):
        line = f'fleetllm:spec_decode_num_{name}_tokens_total{{model_name="demo"}} {value}.0'
        assert line in text, line


def test_the_per_prompt_tool_runs_every_copy_prompt_with_and_without_speculation(capsys):
    """tools/spec_per_prompt.py: each distinct copy-edit prompt (here two held-out stdlib
    functions, the demo model's) alone, speculation on and off, and their summed ratio."""
    tool = load_tool("spec_per_prompt")
    assert tool.main(["--source", "stdlib-heldout", "--max-prompts", "2", "--output-len", "8",
                      "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["prompt 0", "prompt 1"]
    assert "decode steps with speculation" in lines[0]
    assert lines[-1].startswith("2 prompts (stdlib-heldout): ")


def test_bf16_greedy_same_tokens_with_batch_invariant_kernels(monkeypatch):
    """bf16 (issue 70, 9): a drafted step scores k + 1 rows a sequence, so its projections ran
    other kernels than a plain decode step's (the GEMV up to 16 rows on AVX2-only CPUs, the
    small batches' copy up to 4-64 rows beside oneDNN on AMX) and rounded differently: the
    demo model's greedy tokens differed from the 9th-25th on. With FLEETLLM_BATCH_INVARIANT=1
    every row is the same bits in any batch (layers packed by pairs alone): the same tokens
    from 8 sequences drafted together (up to 40 rows a step, past every kernel's row limit) as
    from each sequence alone without drafts (one row a step)."""
    from fleetllm.kernels import cpu_kernels

    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("no AVX2 or AVX-512: no batch-invariant bf16 GEMM here")
    monkeypatch.setenv("FLEETLLM_BATCH_INVARIANT", "1")
    prompts = COPY_PROMPTS + [p.replace("a", "o") for p in COPY_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    kwargs = {"dtype": "bfloat16", "kv_cache_memory": 64 << 20}
    with LLM(str(DEMO_MODEL), **kwargs) as base:
        want = [base.generate(p, params, use_tqdm=False)[0] for p in prompts]
    with LLM(str(DEMO_MODEL), speculative_config=NGRAM, **kwargs) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        assert spec.llm_engine.spec_decode_metrics.accepted_tokens > 32
    assert tokens(got) == tokens(want)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_bf16_random_checkpoints_same_tokens_with_batch_invariant_kernels(
        tiny_models, name, monkeypatch):
    """The same on checkpoints whose every size suits the AMX tiles (all of the layers in the
    one-call decode step, on AMX copies alone where the CPU has AMX) and with q/k/v biases:
    10 sequences drafted together against each alone."""
    from fleetllm.kernels import cpu_kernels

    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("no AVX2 or AVX-512: no batch-invariant bf16 GEMM here")
    monkeypatch.setenv("FLEETLLM_BATCH_INVARIANT", "1")
    prompts = [{"prompt_token_ids": ([5, 9, 17, 33, 2 + i] * 8)[:30 + i]} for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kwargs = {"dtype": "bfloat16", "block_size": 4}
    with LLM(tiny_models[name], **kwargs) as base:
        want = [base.generate(p, params, use_tqdm=False)[0] for p in prompts]
    with LLM(tiny_models[name], speculative_config=NGRAM, **kwargs) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        assert spec.llm_engine.spec_decode_metrics.accepted_tokens > 0
    assert tokens(got) == tokens(want)
