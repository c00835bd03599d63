"""The sampler on hand-made logits: each knob changes what is drawn as it should."""

from __future__ import annotations

import math
from collections import Counter

import torch

from fleetllm.sampling_params import SamplingParams
from fleetllm.worker.sampler import SampleRow, draw_seed, prompt_logprobs, sample

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
    counts = draw(SamplingParams(temperature=1.0), times=4000)
    assert len(counts) >= 5  # random, not greedy
    assert abs(counts[0] / 4000 - 0.40) < 0.04 and abs(counts[1] / 4000 - 0.25) < 0.04
    cold = draw(SamplingParams(temperature=0.05), times=400)
    assert cold[0] == 400  # a low temperature concentrates on the mode
    hot = draw(SamplingParams(temperature=5.0), times=4000)
    assert hot[6] > 4000 * 0.08  # a high one flattens: the rarest token gets >> 2%


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
