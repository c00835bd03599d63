"""The sampler on hand-made logits: each knob changes what is drawn as it should."""

from __future__ import annotations

import math
from collections import Counter

import torch

from fleetllm.sampling_params import SamplingParams
from fleetllm.worker.sampler import (
    PenaltyState,
    SampleRow,
    draw_seed,
    exponential_noise,
    prompt_logprobs,
    sample,
)

LOGITS = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]))


def draw(params: SamplingParams, times: int = 400, outputs=(), prompt=(), seed=None,
         logits=LOGITS) -> Counter:
    rows = [SampleRow(0, params, list(prompt), list(outputs),
                      None if seed is None else draw_seed(seed, 0, i)) for i in range(times)]
    return Counter(sample(logits.unsqueeze(0), rows).token_ids)


def test_greedy_takes_argmax_and_reports_raw_logprobs():
    result = sample(LOGITS.unsqueeze(0), [SampleRow(0, SamplingParams(temperature=0,
                                                                      logprobs=3), [], [], None)])
    assert result.token_ids == [0]
    lps = result.logprobs[0]
    assert set(lps) == {0, 1, 2}
    assert math.isclose(lps[1].logprob, math.log(0.25), rel_tol=1e-5) and lps[1].rank == 2


def test_temperature_follows_the_distribution_and_sharpens():
    # Unseeded draws use the global generator: fix it, or the cold check below fails ~3% of
    # the time (400 draws at p(other) ~ 8e-5 each) depending on what ran before.
    torch.manual_seed(0)
    counts = draw(SamplingParams(temperature=1.0), times=4000)
    assert len(counts) >= 5  # random, not greedy
    assert abs(counts[0] / 4000 - 0.40) < 0.04 and abs(counts[1] / 4000 - 0.25) < 0.04
    cold = draw(SamplingParams(temperature=0.05), times=400)
    assert cold[0] == 400  # a low temperature concentrates on the mode
    hot = draw(SamplingParams(temperature=5.0), times=4000)
    assert hot[6] > 4000 * 0.08  # a high one flattens: the rarest token gets >> 2%


def test_seeded_and_unseeded_draws_match_every_probability():
    """The race's noise (-log U) is Exp(1): the drawn frequencies match every token's
    probability, for draws from the batch's noise and from each row's own seed alike."""
    torch.manual_seed(1)
    want = torch.softmax(LOGITS, -1).tolist()
    for seed in (None, 7):
        counts = draw(SamplingParams(temperature=1.0, seed=seed), times=20000, seed=seed)
        for token, p in enumerate(want):
            sigma = (p * (1 - p) / 20000) ** 0.5
            assert abs(counts[token] / 20000 - p) < 5 * sigma, (seed, token, counts)


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draw(SamplingParams(top_k=2))) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.5))) == {0, 1}  # 0.40 + 0.25 covers 0.5
    assert set(draw(SamplingParams(top_p=0.7))) == {0, 1, 2}
    assert set(draw(SamplingParams(min_p=0.3))) == {0, 1, 2}  # p >= 0.3 * 0.40
    # top-p applies to the distribution renormalized after top-k: 0.5, 0.31, 0.19
    assert set(draw(SamplingParams(top_k=3, top_p=0.6))) == {0, 1}


def test_penalties_push_away_from_seen_tokens():
    greedy = SamplingParams(temperature=0)
    assert draw(greedy, 1, outputs=[0]) == {0: 1}
    assert draw(SamplingParams(temperature=0, presence_penalty=1.0), 1, outputs=[0]) == {1: 1}
    assert draw(SamplingParams(temperature=0, frequency_penalty=0.2), 1,
                outputs=[0, 0, 0]) == {1: 1}
    assert draw(SamplingParams(temperature=0, frequency_penalty=0.2), 1, outputs=[0]) == {0: 1}
    # Repetition penalty counts prompt tokens too; logits here are negative: multiplied.
    assert draw(SamplingParams(temperature=0, repetition_penalty=2.0), 1, prompt=[0]) == {1: 1}


def test_min_tokens_blocks_stop_tokens():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[0])
    assert draw(params, 1, outputs=[5]) == {1: 1}
    assert draw(params, 1, outputs=[5, 5, 5]) == {0: 1}
    params = SamplingParams(temperature=0, min_tokens=2)
    params.eos_token_ids = [0]
    assert draw(params, 1, outputs=[]) == {1: 1}


def test_seeded_draws_are_reproducible_and_independent_of_the_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(LOGITS.unsqueeze(0), [SampleRow(0, params, [], [], draw_seed(7, 0, p))]
                    ).token_ids[0] for p in range(20)]
    crowd = []
    for p in range(20):  # the same request among unseeded neighbours
        rows = [SampleRow(0, SamplingParams(temperature=1.0), [], [], None),
                SampleRow(0, params, [], [], draw_seed(7, 0, p)),
                SampleRow(0, SamplingParams(temperature=1.0), [], [], None)]
        crowd.append(sample(LOGITS.unsqueeze(0), rows).token_ids[1])
    assert alone == crowd
    assert len(set(alone)) > 1


def test_draw_seeds_are_a_function_of_seed_sample_and_position():
    """Counter-based: the same (seed, sample, position) always draws the same token, in any
    order, and changing any of the three gives another stream."""
    def token(seed: int, index: int, position: int) -> int:
        row = SampleRow(0, SamplingParams(temperature=1.0, seed=seed), [], [],
                        draw_seed(seed, index, position))
        return sample(LOGITS.unsqueeze(0), [row]).token_ids[0]

    forward = [token(3, 1, p) for p in range(40)]
    assert [token(3, 1, p) for p in reversed(range(40))] == forward[::-1]
    assert forward != [token(3, 0, p) for p in range(40)]
    assert forward != [token(4, 1, p) for p in range(40)]
    assert forward != [token(3, 1, p + 1) for p in range(40)]
    seeds = {draw_seed(s, i, p) for s in range(4) for i in range(4) for p in range(64)}
    assert len(seeds) == 4 * 4 * 64 and all(0 <= x < 1 << 63 for x in seeds)


def test_prompt_logprobs_rank_and_top_n():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    out = prompt_logprobs(rows, [2, 0], n=2)
    assert out[0][2].rank == 3 and set(out[0]) == {2, 0, 1}
    assert out[1][0].rank == 7 and math.isclose(out[1][0].logprob, math.log(0.02),
                                                rel_tol=1e-4)


# ------------------------------------------------------------------ the fast paths are exact


def _reference_draw(logits: torch.Tensor, params: SamplingParams, seed: int) -> int:
    """The sampler before candidate sets: sort the whole vocabulary, mask, softmax, and race
    against whole-vocabulary noise from the row's own generator."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(descending=True)
    ranks = torch.arange(vocab)
    drop = ranks >= (params.top_k if params.top_k > 0 else vocab)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= probs.cumsum(-1) - probs >= params.top_p
    drop[0] = False
    masked = torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(
        drop, float("-inf")))
    probs = torch.softmax(masked, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    noise = exponential_noise(vocab, torch.device("cpu"),
                              torch.Generator().manual_seed(seed))
    return int((probs / noise).argmax())


def test_candidate_top_k_top_p_draw_the_same_tokens_as_sorting_the_vocabulary():
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    for scale in (0.5, 3.0, 8.0):  # flat to peaked: nuclei wider and narrower than 256
        logits = torch.randn(6, vocab, generator=gen) * scale
        for case in range(12):
            params = SamplingParams(temperature=[0.7, 1.0, 1.3][case % 3],
                                    top_k=[-1, 5, 300, -1][case % 4],
                                    top_p=[0.9, 1.0, 0.5, 0.99][case % 4 if case % 5 else 0],
                                    min_p=0.05 if case % 6 == 1 else 0.0, seed=case)
            rows = [SampleRow(i, params, [], [], draw_seed(case, 0, i)) for i in range(6)]
            got = sample(logits, rows).token_ids
            want = [_reference_draw(logits[i], params, draw_seed(case, 0, i)) for i in range(6)]
            assert got == want, (scale, params)


def test_greedy_rows_without_logprobs_report_none():
    rows = [SampleRow(0, SamplingParams(temperature=0), [], [], None),
            SampleRow(0, SamplingParams(temperature=0, logprobs=0), [], [], None)]
    result = sample(LOGITS.unsqueeze(0), rows)
    assert result.token_ids == [0, 0]
    assert result.logprobs[0] == {} and set(result.logprobs[1]) == {0}


def test_penalty_state_is_incremental_and_matches_the_history():
    """Each step adds only the new output tokens to a sequence's counts; the penalized
    draws equal those of a state built from the whole history every step."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.3,
                            repetition_penalty=1.4)
    state = PenaltyState()
    prompt, outputs = [3, 5, 5, 9], []
    for _ in range(30):
        logits = torch.randn(1, 50, generator=gen)
        row = SampleRow(0, params, prompt, outputs, None, seq_id=7)
        [token] = sample(logits, [row], state, ["r"]).token_ids
        fresh = sample(logits, [SampleRow(0, params, prompt, outputs, None)]).token_ids
        assert [token] == fresh
        assert state.entries[7][1] == len(outputs)  # counted up to here, no further
        outputs.append(token)
    assert state.entries[7][2].sum() == len(outputs) - 1
    state.drop(["r"])
    assert not state.entries and not state.by_request


def test_greedy_bf16_rows_take_the_kernels_argmax_without_a_float32_copy(monkeypatch):
    """Greedy rows without penalties or logprobs: one argmax over the model's own logits (the
    C kernel on the CPU), the same tokens as a float32 argmax; rows that need float32 math
    still get it."""
    from fleetllm.kernels import cpu_kernels

    if not cpu_kernels.available():
        import pytest
        pytest.skip("no C++ compiler here")
    seen = []
    real = cpu_kernels.argmax
    monkeypatch.setattr(cpu_kernels, "argmax", lambda x: seen.append(x.dtype) or real(x))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 32000, generator=g).bfloat16()
    logits[2, 7], logits[2, 9] = 50, 50  # a tie: the first wins, as in torch.argmax
    greedy = [SampleRow(i, SamplingParams(temperature=0), [], [], None) for i in range(6)]
    assert sample(logits, greedy).token_ids == logits.float().argmax(dim=-1).tolist()
    assert seen == [torch.bfloat16]
    seen.clear()
    penalized = SamplingParams(temperature=0, repetition_penalty=1.5)
    rows = greedy[:5] + [SampleRow(5, penalized, [], [3], None)]
    sample(logits, rows, PenaltyState(), ["r"] * 6)
    assert seen == [torch.float32]
