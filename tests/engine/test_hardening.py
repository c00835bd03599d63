"""Engine defects found in review (issue "Hardening"): each test failed before its fix.

n > 1 with a one-token final prompt chunk, swap OOM of a forked group, atomic steps, aborts
that land during a step, and stop strings (earliest match, monotonic text, EOS after held-back
text).
"""

from __future__ import annotations

import threading

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.engine.detokenizer import find_stop_string, held_back_length
from fleetllm.errors import RemoteWorkerError
from fleetllm.sequence import Sequence

KV = 32 << 20


def ids(n: int, start: int = 10) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


@pytest.mark.parametrize("prompt_len", [16, 17, 18, 33])
def test_n_samples_survive_a_one_token_final_prompt_chunk(tiny_models, prompt_len):
    """17 tokens with a budget of 16: the last prompt chunk is one token, and it still draws
    all n samples (it used to be sent as a decode and draw one)."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        [reference] = llm.generate(ids(prompt_len), params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, max_num_batched_tokens=16) as llm:
        [out] = llm.generate(ids(prompt_len), params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    assert all(len(c.token_ids) == 6 for c in out.outputs)


def test_forked_group_without_swap_space_is_recomputed_not_lost(tiny_models):
    """The review's case: 12 blocks, no CPU pool, r1 has two seeded samples. Preempting r1
    used to raise in the middle of scheduling and empty every queue. Now r1 is recomputed
    (both samples); at 100 tokens it can never fit the pool and ends with an error; r0 and
    r2 complete; no block leaks. (r1 has a stop string that never matches: a request certain
    to outgrow the pool is refused at admission instead, see test_server_hardening.)"""
    path = tiny_models["llama_gqa"]
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    def run(r1_tokens: int, **engine_kw):
        seeded = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=r1_tokens,
                                ignore_eos=True, stop=["\x00" * 4])
        with LLM(path, **engine_kw) as llm:
            outs = llm.generate([ids(16), ids(16, 40), ids(16, 70)], [greedy, seeded, greedy],
                                use_tqdm=False)
            sched = llm.llm_engine.scheduler
            assert not llm.llm_engine.seq_groups and not sched.has_unfinished_seqs()
            assert sched.block_manager.num_free_gpu_blocks == sched.block_manager.num_gpu_blocks
            return outs, sched.num_preemptions

    small = dict(num_gpu_blocks_override=12, swap_space=0)
    reference, _ = run(40, kv_cache_memory=KV)
    outs, preemptions = run(40, **small)
    assert preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[c.token_ids for c in o.outputs] for o in reference]  # seeded samples reproduce
    outs, _ = run(100, **small)
    r0, r1, r2 = outs
    for got, want in ((r0, reference[0]), (r2, reference[2])):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == 100
    assert r1.finished and {c.finish_reason for c in r1.outputs} == {"error"}
    assert "cannot be scheduled" in r1.error and len(r1.outputs) == 2


class FailingExecuteModel:
    """Wraps an executor's execute_model: raises instead of running on the given calls."""

    def __init__(self, executor, fail_on: set[int], during=None):
        self.inner = executor.execute_model
        self.fail_on, self.during = fail_on, during
        self.calls = 0
        self.requests = []

    def __call__(self, request):
        self.calls += 1
        self.requests.append(request)
        if self.during is not None:
            self.during(self.calls)
        if self.calls in self.fail_on:
            raise RemoteWorkerError(f"injected failure at call {self.calls}")
        return self.inner(request)


@pytest.mark.parametrize("caching", [False, True])
def test_a_failed_step_loses_nothing_and_can_be_retried(tiny_models, caching):
    """(With prefix caching, a group recomputed after a failed step finds its own blocks
    again and this pool no longer runs out: the preemption is checked without it.)"""
    prompts = [ids(40), ids(25, 100), ids(60, 200), ids(5, 300)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        reference = llm.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_models["llama_gqa"], num_gpu_blocks_override=14, swap_space=1 << 22,
             preemption_mode="swap", max_num_batched_tokens=32,
             enable_prefix_caching=caching) as llm:
        engine = llm.llm_engine
        fail = FailingExecuteModel(engine.model_executor, fail_on={2, 5, 9, 14, 20})
        engine.model_executor.execute_model = fail
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), p, sp)
        finished, failures = {}, 0
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            try:
                outs = engine.step()
            except RemoteWorkerError:
                failures += 1
                continue
            for o in outs:
                assert o.request_id not in finished, "a second terminal output"
                if o.finished:
                    finished[o.request_id] = o
        assert failures == 5 and (caching or engine.scheduler.num_preemptions > 0)
        bm = engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
        assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
        # Finished ids reach the workers once, also those whose step failed.
        calls = list(enumerate(fail.requests, start=1))
        sent = [r for call, req in calls if call not in fail.fail_on
                for r in req.finished_requests_ids]
        lost = {r for call, req in calls if call in fail.fail_on
                for r in req.finished_requests_ids}
        assert len(sent) == len(set(sent)) and lost <= set(sent)
    assert [[c.token_ids for c in finished[str(i)].outputs] for i in range(4)] == \
        [[c.token_ids for c in o.outputs] for o in reference]


def test_abort_during_a_step_is_applied_after_it(tiny_models):
    """An abort from another thread while the workers run: applied when the step ends, no
    IndexError, and no output for that request after abort_request returns."""
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        engine = llm.llm_engine

        def abort_from_another_thread(call: int) -> None:
            if call == 3:
                t = threading.Thread(target=engine.abort_request, args=(["a", "b"],))
                t.start()
                t.join(5)
                assert not t.is_alive()
                assert "a" in engine.seq_groups  # not yet: the step is still running
            if call == 4:
                engine.add_request("late", ids(8, 50), SamplingParams(max_tokens=2))

        engine.model_executor.execute_model = FailingExecuteModel(
            engine.model_executor, set(), during=abort_from_another_thread)
        params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=30, ignore_eos=True)
        for rid in ("a", "b", "c"):
            engine.add_request(rid, ids(20, 5 * len(rid)), params)
        seen: dict[str, list] = {"a": [], "b": [], "c": [], "late": []}
        steps = 0  # every step here calls execute_model once: the abort lands in step 2
        while engine.has_unfinished_requests() and steps < 200:
            for o in engine.step():
                seen[o.request_id].append((steps, o))
            steps += 1
        for rid in "ab":
            assert seen[rid] and all(step < 2 for step, _ in seen[rid])
        assert seen["c"][-1][1].finished and len(seen["c"][-1][1].outputs) == 2
        assert seen["late"][-1][1].finished
        bm = engine.scheduler.block_manager
        assert bm.num_free_gpu_blocks == bm.num_gpu_blocks


# ----------------------------------------------------------------------------- stop strings


def _seq_with(text: str) -> Sequence:
    seq = Sequence(0, None, [1])
    seq.output_text = text
    return seq


def test_earliest_stop_string_wins_whatever_the_list_order():
    params = SamplingParams(stop=["world", "lo w"])
    seq = _seq_with("hello world")
    assert find_stop_string(seq, len("hello world"), params) == "lo w"
    assert seq.output_text == "hel"
    seq = _seq_with("hello world")
    params = SamplingParams(stop=["world", "o"], include_stop_str_in_output=True)
    assert find_stop_string(seq, 11, params) == "o" and seq.output_text == "hello"


def test_held_back_text_is_the_longest_possible_stop_prefix():
    assert held_back_length("abc", ["cde"]) == 1
    assert held_back_length("abcd", ["cdx", "bcdy"]) == 3
    assert held_back_length("abc", ["abc"]) == 0  # a whole match is found, not held back
    assert held_back_length("abc", ["xyz"]) == 0
    assert held_back_length("", ["xyz"]) == 0


def test_streamed_text_never_shrinks_and_eos_keeps_held_back_text(tiny_models):
    prompt = "def hello(world):"
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True), use_tqdm=False)
        base = base[0].outputs[0]
        text, tokens = base.text, base.token_ids
        assert len(text) > 12
        engine = llm.llm_engine
        # Both end at character 9; the one listed first starts later (or occurs earlier).
        stops = [text[6:9], text[5:9], text[2:4] + "\x01never"]

        def stream(params: SamplingParams) -> list[str]:
            engine.add_request("s", prompt, params)
            texts = []
            while engine.has_unfinished_requests():
                texts += [o.outputs[0].text for o in engine.step()]
            for before, after in zip(texts, texts[1:], strict=False):
                assert after.startswith(before), (before, after)
            return texts

        texts = stream(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                      stop=stops))
        assert texts[-1] == text[:min(text.find(stops[0]), text.find(stops[1]))]
        # A stop string that never completes holds back its prefix while it could; a stop
        # token then ends the request and the held-back text is part of the final output.
        k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
        partial = llm.get_tokenizer().decode(tokens[:k]).rstrip("\ufffd")
        never = partial[-2:] + "\x01never"
        texts = stream(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                      stop=[never], stop_token_ids=[tokens[k]]))
        assert texts[-1] == partial
