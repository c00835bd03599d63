"""The engine: scheduler + block manager + LLMEngine.step + LLM.generate (issue: engine)."""

from __future__ import annotations

import random

import pytest
from helpers import check_logprobs_close, hf_greedy, load_hf

from fleetllm import LLM, SamplingParams
from fleetllm.errors import InvalidRequestError

KV = 32 << 20


def random_prompts(count: int, low: int, high: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randint(low, high))]}
            for _ in range(count)]


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "llama_tied"])
def test_generate_matches_hf_for_32_prompts(tiny_models, name):
    prompts = random_prompts(32, 1, 300, seed=11)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    with LLM(tiny_models[name], kv_cache_memory=KV, max_num_batched_tokens=1024) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(tiny_models[name])
    equal = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        [completion] = out.outputs
        assert len(completion.token_ids) == 32 and completion.finish_reason == "length"
        ref_tokens, ref_rows = hf_greedy(hf, prompt["prompt_token_ids"], 32)
        lps = [{k: v.logprob for k, v in d.items()} for d in completion.logprobs]
        equal += check_logprobs_close(completion.token_ids, lps, ref_tokens, ref_rows)
    assert equal >= 31


@pytest.mark.parametrize("mode, swap_space", [("recompute", 1 << 28), ("swap", 1 << 28),
                                              ("swap", 0)])  # no CPU pool: falls back
def test_preemption_gives_the_same_results(tiny_models, mode, swap_space):
    prompts = random_prompts(12, 40, 90, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    path = tiny_models["llama_gqa"]
    with LLM(path, kv_cache_memory=KV) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    # 40 blocks of 16 tokens: room for ~4 of the 12 sequences at full length.
    with LLM(path, num_gpu_blocks_override=40, preemption_mode=mode,
             swap_space=swap_space) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_preemptions > 0
        assert scheduler.block_manager.num_free_gpu_blocks == 40
    assert [o.outputs[0].token_ids for o in outputs] == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_200_requests_none_lost_or_duplicated(tiny_models, mode):
    prompts = random_prompts(200, 1, 60, seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], num_gpu_blocks_override=48, preemption_mode=mode,
             max_num_seqs=64) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert len(outputs) == 200 and len({o.request_id for o in outputs}) == 200
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt["prompt_token_ids"]
        assert out.finished and len(out.outputs[0].token_ids) == 8


def test_n_samples_are_seeded_and_share_prompt_blocks(tiny_models):
    prompt = {"prompt_token_ids": list(range(10, 74))}  # 64 tokens: 4 full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        first = llm.generate(prompt, params, use_tqdm=False)[0]
        again = llm.generate(prompt, params, use_tqdm=False)[0]
        other_seed = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=4,
                                                         max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)[0]
        # Block sharing: right after the prompt is sampled, the 4 sequences hold the prompt's
        # 4 blocks once, plus one new block each for the next token.
        engine = llm.llm_engine
        bm = engine.scheduler.block_manager
        free_before = bm.num_free_gpu_blocks
        engine.add_request("shared", prompt, SamplingParams(n=4, temperature=1.0, seed=3,
                                                             max_tokens=3, ignore_eos=True))
        engine.step()  # prefill + 4 samples
        engine.step()  # first decode of the 4 forks
        used = free_before - bm.num_free_gpu_blocks
        assert used == 4 + 4, used  # not 4 * 5
        while engine.has_unfinished_requests():
            engine.step()
        assert bm.num_free_gpu_blocks == free_before
    samples = [c.token_ids for c in first.outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    assert samples == [c.token_ids for c in again.outputs]
    assert samples != [c.token_ids for c in other_seed.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]


def test_sampling_knobs_change_generation(tiny_models):
    prompts = random_prompts(4, 5, 20, seed=2)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        def gen(**kw):
            params = SamplingParams(max_tokens=24, ignore_eos=True, **kw)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
        greedy = gen(temperature=0)
        assert gen(temperature=0) == greedy
        shared = SamplingParams(max_tokens=2)
        llm.generate(prompts, shared, use_tqdm=False)
        assert shared.eos_token_ids == []  # the engine works on a copy
        assert gen(temperature=1.0, seed=1) != greedy
        assert gen(temperature=1.0, seed=1, top_k=1) == greedy  # top-1 is greedy
        assert gen(temperature=1.0, seed=1, top_p=1e-6) == greedy  # nucleus of one token
        assert gen(temperature=1.0, seed=1, min_p=1.0) == greedy  # only the mode survives
        # The tiny random model loops; a strong repetition penalty breaks every loop.
        assert any(len(set(t)) < len(t) for t in greedy)
        for tokens in gen(temperature=0, repetition_penalty=50.0):
            assert len(set(tokens)) == len(tokens)
        assert gen(temperature=0, frequency_penalty=2.0) != greedy
        assert gen(temperature=0, presence_penalty=2.0) != greedy


def test_stop_strings_stop_tokens_and_min_tokens(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        base = llm.generate("def hello(world):", SamplingParams(temperature=0, max_tokens=30,
                                                                ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        assert len(base.text) > 10
        stop = base.text[6:9]
        first = base.text.find(stop)
        out = llm.generate("def hello(world):", SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
            use_tqdm=False)[0].outputs[0]
        assert out.text == base.text[:first] and out.finish_reason == "stop"
        assert out.stop_reason == stop
        kept = llm.generate("def hello(world):", SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
        assert kept.text == base.text[:first + len(stop)]

        token = base.token_ids[4]
        out = llm.generate("def hello(world):", SamplingParams(
            temperature=0, max_tokens=30, stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:base.token_ids.index(token) + 1]
        assert out.stop_reason == token and out.finish_reason == "stop"
        # As in vLLM, the stopping token's text is not in the output.
        # (A partial UTF-8 character before it is withheld, as during streaming.)
        assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1]).rstrip("\ufffd")
        out = llm.generate("def hello(world):", SamplingParams(
            temperature=0, max_tokens=30, min_tokens=10, stop_token_ids=[token]),
            use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= 10 and token not in out.token_ids[:9]


def test_abort_frees_every_block(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        engine = llm.llm_engine
        bm = engine.scheduler.block_manager
        total = bm.num_free_gpu_blocks
        for i, p in enumerate(random_prompts(3, 30, 60, seed=1)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert bm.num_free_gpu_blocks < total
        engine.abort_request("r1")
        engine.step()
        assert engine.get_num_unfinished_requests() == 2
        engine.abort_request(["r0", "r2"])
        assert not engine.has_unfinished_requests()
        assert bm.num_free_gpu_blocks == total
        with pytest.raises(InvalidRequestError, match="already in use"):
            engine.add_request("dup", {"prompt_token_ids": [5]}, None)
            engine.add_request("dup", {"prompt_token_ids": [5]}, None)


def test_too_long_prompt_is_rejected_and_others_complete(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, max_model_len=128) as llm:
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            llm.llm_engine.add_request("x", {"prompt_token_ids": [5] * 200})
        assert not llm.llm_engine.has_unfinished_requests()
        prompts = [{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 200},
                   {"prompt_token_ids": [7] * 20}, {"prompt_token_ids": [600]}]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True),
                               use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 0, 5, 0]
    assert outputs[1].outputs[0].finish_reason == "error"
    assert "max_model_len=128" in outputs[1].error
    assert "vocabulary" in outputs[3].error
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm, \
            pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.llm_engine.add_request("s", {"prompt_token_ids": [5]},
                                   SamplingParams(stop_token_ids=[10**6], min_tokens=1))


def test_output_metrics_and_text(tiny_models):
    with LLM(tiny_models["llama_tied"], kv_cache_memory=KV) as llm:
        tok = llm.get_tokenizer()
        [out] = llm.generate(["for i in range(10):"], SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1),
            use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert out.prompt == "for i in range(10):"
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    assert all(len(d) >= 2 for d in completion.logprobs)
    assert completion.logprobs[0][completion.token_ids[0]].decoded_token is not None
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_prompt_chunks_alone_and_recompute_keep_results_and_prompt_logprobs(tiny_models):
    """A step of nothing but non-final prompt chunks, and prompts preempted by recompute
    part-way: same tokens and exactly one prompt logprob per prompt token."""
    prompts = random_prompts(6, 40, 80, seed=21)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    path = tiny_models["llama_gqa"]
    with LLM(path, kv_cache_memory=KV) as llm:
        reference = llm.generate(prompts, params, use_tqdm=False)
    with LLM(path, kv_cache_memory=KV, max_num_batched_tokens=16) as llm:
        [alone] = llm.generate(prompts[0], params, use_tqdm=False)  # chunks only, 1 request
    assert alone.outputs[0].token_ids == reference[0].outputs[0].token_ids
    with LLM(path, num_gpu_blocks_override=12, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for out, ref in zip(outputs, reference, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for mine, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert mine.keys() == theirs.keys()
            for k in mine:
                assert abs(mine[k].logprob - theirs[k].logprob) < 1e-4


def test_incremental_text_skips_special_tokens_as_the_tokenizer_does(tiny_models):
    """The detokenizer's text, token by token, is the tokenizer's decode of the ids, with
    special tokens (BOS/EOS among them) skipped or kept as skip_special_tokens says; it skips
    them from a set of special ids read once, not by transformers' per-call list."""
    from transformers import AutoTokenizer

    from fleetllm.engine.detokenizer import Detokenizer, TokenTexts

    tok = AutoTokenizer.from_pretrained(tiny_models["llama_tied"])
    special = sorted(tok.all_special_ids)
    assert special
    rng = random.Random(5)
    for trial in range(20):
        ids = [rng.choice(special) if rng.random() < 0.25 else rng.randrange(3, len(tok))
               for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            detok, state = Detokenizer(tok), TokenTexts()
            detok.seed(state, [], skip)
            text = "".join(detok.advance(state, i, skip) for i in ids)
            # (the last token may end in an incomplete UTF-8 character, which waits for the next)
            want = tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
            assert text.strip() == want.strip(), (trial, skip, ids)
