"""Structured outputs in the engine: outputs follow their JSON schema / regex / choice /
grammar on random-weight checkpoints and the demo model, with both backends, greedy and
sampled, n = 2; malformed constraints are refused before anything is queued; a grammar that
is compiling delays no other request; the masks travel to mp and ray workers."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import pytest
import torch
from structured_helpers import check_output, random_constraint

from fleetllm import LLM, SamplingParams, StructuredOutputsParams
from fleetllm.errors import ConfigurationError, InvalidRequestError
from fleetllm.structured_outputs import backends
from fleetllm.worker.sampler import SampleRow, sample, unpack_bitmask

DEMO = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
pytestmark = pytest.mark.timeout(600)


def params_for(rng: random.Random, so: StructuredOutputsParams, index: int,
               max_tokens: int) -> SamplingParams:
    kind = rng.choice(["greedy", "seeded", "random"])
    return SamplingParams(n=rng.choice([1, 2]), temperature=0.0 if kind == "greedy" else 1.0,
                          seed=index if kind == "seeded" else None, max_tokens=max_tokens,
                          structured_outputs=so)


def check_all(constraints, outputs) -> None:
    for so, out in zip(constraints, outputs, strict=True):
        assert out.error is None, out.error
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text, so)
            check_output(so, c.text)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    with LLM(tiny_models["llama_gqa"], max_model_len=1024) as llm:
        yield llm


# --------------------------------------------------------- acceptance 1: 200 random schemas


def test_random_constraints_on_a_random_weight_checkpoint(tiny):
    rng = random.Random(1)
    constraints = [random_constraint(rng) for _ in range(100)]
    params = [params_for(rng, so, i, 900) for i, so in enumerate(constraints)]
    check_all(constraints, tiny.generate(["Hello world"] * 100, params, use_tqdm=False))
    kinds = {so.kind for so in constraints}
    assert kinds == {"json", "regex", "choice"}, kinds


@pytest.fixture(scope="module")
def demo():
    with LLM(str(DEMO)) as llm:
        yield llm


def test_random_constraints_on_the_demo_model(demo):
    """JSON whitespace is off: the demo model writes code and fills every optional gap with
    indentation (capped at MAX_JSON_WHITESPACE per gap, a big schema's gaps still outrun its
    512-token context)."""
    rng = random.Random(2)
    constraints = []
    for _ in range(100):
        so = random_constraint(rng)
        if so.json is not None:
            so = StructuredOutputsParams(json=so.json, disable_any_whitespace=True)
        constraints.append(so)
    params = [params_for(rng, so, i, 400) for i, so in enumerate(constraints)]
    outputs = demo.generate(["def parse(text):\n    return {"] * 100, params, use_tqdm=False)
    check_all(constraints, outputs)


def test_any_json_object(demo):
    """Unbounded (keys and strings of any length): a model closes it when it will, so only
    outputs that finished are parsed; the demo model closes most of these greedily."""
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    prompts = ["def parse(text):\n    return ", "config = ", "x = {", "data = dict(",
               "import json\nobj = "]
    outputs = demo.generate(prompts, SamplingParams(temperature=0, max_tokens=300,
                                                    structured_outputs=so), use_tqdm=False)
    done = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(done) >= 3
    for c in done:
        check_output(so, c.text)


def test_the_guidance_backend_follows_the_same_constraints(tiny_models):
    rng = random.Random(3)
    constraints = [random_constraint(rng) for _ in range(30)]
    params = [params_for(rng, so, i, 900) for i, so in enumerate(constraints)]
    with LLM(tiny_models["qwen2_bias"], max_model_len=1024,
             structured_outputs_backend="guidance") as llm:
        check_all(constraints, llm.generate(["x = "] * 30, params, use_tqdm=False))


GRAMMARS = [
    # EBNF (GBNF) and Lark, each with the regex its language equals
    ('root ::= "(" [0-9] ("+" [0-9]){0,3} ")"', r"\([0-9](\+[0-9]){0,3}\)"),
    ('start: "yes" | "no" | NUM\nNUM: /[0-9]{1,3}/', r"yes|no|[0-9]{1,3}"),
]


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_ebnf_and_lark_grammars(tiny_models, backend):
    with LLM(tiny_models["llama_gqa"], structured_outputs_backend=backend) as llm:
        for grammar, language in GRAMMARS:
            so = StructuredOutputsParams(grammar=grammar)
            [out] = llm.generate("1 + 2", SamplingParams(n=2, temperature=1.0, seed=0,
                                                         max_tokens=50, structured_outputs=so),
                                 use_tqdm=False)
            for c in out.outputs:
                assert c.finish_reason == "stop" and re.fullmatch(language, c.text), c.text


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("constraint", [dict(regex=".[^a]{1,3}"), dict(regex="[^b][^a]{1,3}"),
                                        dict(grammar="root ::= [^b] [^a]{1, 3}")])
def test_no_grammar_ends_before_its_first_character(tiny_models, backend, constraint):
    """xgrammar 0.2.9 let `[^b] [^a]{1, 3}` end before any character (EOS allowed and accepted
    from the start: a sampled request once came back '' with finish reason "stop"); the
    package pins it out (pyproject.toml). Each backend's fresh matcher must refuse EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama_gqa"])
    eos = tokenizer.eos_token_id
    backend_ = backends.make_backend(backend, tokenizer, len(tokenizer), [eos])
    matcher = backend_.matcher(backend_.compile(backend_.parse(
        StructuredOutputsParams(**constraint))))
    bitmask = torch.full((1, (len(tokenizer) + 31) // 32), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    assert not bool(unpack_bitmask(bitmask, len(tokenizer))[0, eos])
    assert not matcher.accept(eos)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_disable_any_whitespace_is_compact_json_with_either_backend(tiny_models, backend):
    """No space after any ',' or ':', also inside values of no given type and any json_object
    (xgrammar 0.2 writes its generic JSON rules with ', ' and ': ' whatever its separators)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama_gqa"])
    eos = tokenizer.eos_token_id
    backend_ = backends.make_backend(backend, tokenizer, len(tokenizer), [eos])

    def accepts(so: StructuredOutputsParams, text: str) -> bool:
        matcher = backend_.matcher(backend_.compile(backend_.parse(so)))
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)
                   ) and matcher.accept(eos)

    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}},
        "c": {}, "d": {"enum": ["p, q", "r: s"]}}, "required": ["a", "b", "c", "d"]}
    value = {"a": 1, "b": ["x", "y"], "c": {"k": [1, 2], "m": {"n": None}}, "d": "p, q"}
    compact, spaced = json.dumps(value, separators=(",", ":")), json.dumps(value)
    for so in (StructuredOutputsParams(json=schema, disable_any_whitespace=True),
               StructuredOutputsParams(json_object=True, disable_any_whitespace=True)):
        assert accepts(so, compact)
        assert not accepts(so, spaced)
        gaps = [i + 1 for i, ch in enumerate(compact) if ch in ",:" and i < compact.index('"d"')]
        for i in gaps:  # a single space in any gap is refused
            assert not accepts(so, compact[:i] + " " + compact[i:]), compact[:i] + " "
    # without it, the usual spacing (and up to MAX_JSON_WHITESPACE per gap) is allowed
    assert accepts(StructuredOutputsParams(json=schema), spaced)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_sampled_strings_are_valid_utf8_and_valid_json(tiny_models, backend):
    """A byte-level tokenizer's one-byte tokens can spell UTF-8 surrogates and control
    characters: xgrammar's own classes let both into strings (backends.py closes them)."""
    constraints = [StructuredOutputsParams(json={"type": "string", "maxLength": 4}),
                   StructuredOutputsParams(regex=".[^a]{1,3}")]
    params = [SamplingParams(temperature=1.5, seed=i, max_tokens=50, structured_outputs=so)
              for i in range(100) for so in constraints]
    with LLM(tiny_models["llama_gqa"], structured_outputs_backend=backend) as llm:
        outputs = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outputs, strict=True):
        text, seen = out.outputs[0].text, (p.seed, out.outputs[0].token_ids,
                                           out.outputs[0].finish_reason)
        assert "\ufffd" not in text, (text, seen)
        try:
            check_output(p.structured_outputs, text)
        except AssertionError as e:  # e.g. xgrammar 0.2.9's early end (test above)
            raise AssertionError(f"{e}; seed, tokens, finish reason: {seen}") from None


def test_a_complete_grammar_finishes_with_stop_even_ignoring_eos(tiny):
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    [out] = tiny.generate("x", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              structured_outputs=so), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in so.choice


def test_guided_decoding_is_the_old_name(tiny):
    old = SamplingParams(temperature=0, max_tokens=20, guided_decoding=StructuredOutputsParams(
        regex="[a-c]{3}"))
    [out] = tiny.generate("x", old, use_tqdm=False)
    assert re.fullmatch("[a-c]{3}", out.outputs[0].text)


# -------------------------------------------------------------- acceptance 4: bad inputs


@pytest.mark.parametrize("constraint, words", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"type": "frobnicate"}), "frobnicate"),
    (dict(json="[1, 2]"), "a JSON schema is an object"),
    (dict(regex="a(b"), "parenthesis|unclosed group"),
    (dict(grammar="root ::= missing_rule"), "missing_rule"),
    (dict(grammar="start: unknown"), "unknown"),
])
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_a_malformed_constraint_is_refused_naming_the_problem(tiny, constraint, words, backend):
    engine = tiny.llm_engine
    manager = engine.structured_outputs
    saved, manager.backend_name = manager.backend_name, backend
    try:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", "x", params)
    finally:
        manager.backend_name = saved
    assert re.search(words, str(info.value)), str(info.value)  # each library words its own
    assert not engine.has_unfinished_requests() and "bad" not in engine.seq_groups


@pytest.mark.parametrize("kwargs", [dict(), dict(json={}, regex="a"), dict(choice=[]),
                                    dict(choice="ab"), dict(regex=""), dict(json=3),
                                    dict(json={"enum": {1, 2}}),  # no JSON: not a TypeError
                                    dict(regex="a" * (64 * 1024 + 1)),  # MAX_CONSTRAINT_CHARS
                                    dict(choice=["ab"] * (32 * 1024 + 1)),
                                    dict(json={"enum": ["a" * 64 * 1024]})])
def test_constraint_params_are_checked(kwargs):
    with pytest.raises(ConfigurationError):
        StructuredOutputsParams(**kwargs)
    StructuredOutputsParams(regex="a" * 64 * 1024)  # the limit itself is fine


def test_unknown_backend_and_config_fields_are_refused(tiny_models):
    with pytest.raises(ConfigurationError, match="structured_outputs_backend"):
        LLM(tiny_models["llama_gqa"], structured_outputs_backend="outlines")
    with pytest.raises(ConfigurationError, match="reasoning_parser"):
        LLM(tiny_models["llama_gqa"], structured_outputs_config={"reasoning_parser": "x"})


# ------------------------------------------------- compiling off the step path, failures


def test_a_compiling_grammar_delays_no_other_request(tiny, monkeypatch):
    release = threading.Event()
    real = backends.XgrammarBackend.compile

    def slow(self, grammar):
        assert release.wait(30)
        return real(self, grammar)

    monkeypatch.setattr(backends.XgrammarBackend, "compile", slow)
    engine = tiny.llm_engine
    so = StructuredOutputsParams(regex="[0-9]{4}-slow")  # not in the cache yet
    engine.add_request("grammar", "x", SamplingParams(temperature=0, max_tokens=20,
                                                      structured_outputs=so))
    engine.add_request("plain", "x", SamplingParams(temperature=0, max_tokens=5))
    done = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if "plain" in done:
            break
    assert "plain" in done and "grammar" not in done
    release.set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert re.fullmatch("[0-9]{4}-slow", done["grammar"].outputs[0].text)


def test_a_grammar_that_fails_to_compile_ends_its_request_with_an_error(tiny, monkeypatch):
    def broken(self, grammar):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(backends.XgrammarBackend, "compile", broken)
    so = StructuredOutputsParams(regex="[0-9]{3}-broken")
    out = tiny.generate(["x", "y"], [SamplingParams(max_tokens=4, structured_outputs=so),
                                     SamplingParams(max_tokens=4)], use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error" and "compiler exploded" in out[0].error
    assert out[1].error is None and len(out[1].outputs[0].token_ids) == 4


# --------------------------------------------------------------------- mp and ray workers


def test_masks_reach_distributed_workers(tiny, tiny_models, distributed):
    rng = random.Random(4)
    constraints = [random_constraint(rng) for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=600, structured_outputs=so)
              for so in constraints]
    want = tiny.generate(["Hello"] * 8, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], max_model_len=1024, **distributed) as llm:
        got = llm.generate(["Hello"] * 8, params, use_tqdm=False)
    check_all(constraints, got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


# ------------------------------------------------------------------------------ sampler


def test_bitmask_unpacking_and_masking_only_rows_that_have_one():
    vocab = 70
    allowed = torch.zeros(3, dtype=torch.int32)  # 96 bits: tokens 5, 31 and 64 allowed
    allowed[0] = (1 << 5) | (-(1 << 31))  # bit 31 of a signed word
    allowed[2] = 1
    bits = unpack_bitmask(allowed, vocab)
    assert bits.nonzero().flatten().tolist() == [5, 31, 64]
    logits = torch.randn(2, vocab)
    logits[:, 7] = 100.0  # the unconstrained favourite
    rows = [SampleRow(0, SamplingParams(temperature=0), [1], [], None, allowed=allowed),
            SampleRow(1, SamplingParams(temperature=0), [1], [], None)]
    out = sample(logits, rows)
    assert out.token_ids[0] in (5, 31, 64) and out.token_ids[1] == 7
    drawn = {sample(logits, [SampleRow(0, SamplingParams(temperature=5.0), [1], [], None,
                                       allowed=allowed)]).token_ids[0] for _ in range(60)}
    assert drawn <= {5, 31, 64} and len(drawn) > 1


def test_a_grammar_that_only_allows_eos_wins_over_min_tokens():
    eos, vocab = 2, 40
    allowed = torch.zeros(2, dtype=torch.int32)
    allowed[0] = 1 << eos
    params = SamplingParams(temperature=0, min_tokens=5, eos_token_ids=[eos])
    out = sample(torch.randn(1, vocab), [SampleRow(0, params, [1], [], None, allowed=allowed)])
    assert out.token_ids == [eos]


def test_bench_grammar_reports_both_backends(capsys):
    import argparse

    from fleetllm.benchmarks import grammar

    result = grammar.run(argparse.Namespace(model=None, vocab_size=None, tokens=5,
                                            backends="xgrammar,guidance"))
    assert set(result) == {"xgrammar", "guidance"}
    for figures in result.values():
        assert len(figures) == 4 and all(f["mask_us"] > 0 for f in figures.values())
    assert "mask us/token" in capsys.readouterr().out


# ------------------------------------------------- faults while a grammar is compiling


def _step_until_done(engine, limit: int = 300) -> dict:
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in done, "a second terminal output"
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return done


def test_abort_and_worker_crash_while_a_grammar_compiles(tiny, monkeypatch):
    """Faults that arrive while a request waits for its grammar: it is aborted (no output,
    the compile finishing later touches nothing), or the workers crash and are replaced (it
    still runs, once, when its grammar is ready)."""
    from fleetllm.errors import WorkerCrashedError

    release = threading.Event()
    real = backends.XgrammarBackend.compile
    monkeypatch.setattr(backends.XgrammarBackend, "compile",
                        lambda self, g: (release.wait(30), real(self, g))[1])
    engine = tiny.llm_engine
    greedy = dict(temperature=0, max_tokens=30)
    engine.add_request("aborted", "x", SamplingParams(**greedy, structured_outputs=(
        StructuredOutputsParams(regex="[a-d]{3}-aborted"))))
    engine.add_request("waits", "x", SamplingParams(**greedy, structured_outputs=(
        StructuredOutputsParams(regex="[a-d]{3}-waits"))))
    engine.add_request("plain", "y", SamplingParams(**greedy))
    engine.step()  # plain runs; both grammar requests wait
    engine.abort_request("aborted")
    crash = engine.model_executor.execute_model
    calls = {"n": 0}

    def crash_once(request):
        calls["n"] += 1
        if calls["n"] == 1:
            raise WorkerCrashedError("injected worker crash", rank=0)
        return crash(request)

    monkeypatch.setattr(engine.model_executor, "execute_model", crash_once)
    engine.step()  # the crash: the workers are replaced, plain is recomputed
    release.set()
    done = _step_until_done(engine)
    assert set(done) == {"waits", "plain"}
    assert re.fullmatch("[a-d]{3}-waits", done["waits"].outputs[0].text)
    assert engine.scheduler.block_manager.num_free_gpu_blocks == \
        engine.scheduler.block_manager.num_gpu_blocks
