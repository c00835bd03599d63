"""Speculative decoding building blocks (#19, not wired into the engine yet): the n-gram
proposer, and a statistical test that rejection-sampled tokens follow the target
distribution (chi-square over 20,000 draws on a tiny vocabulary, p > 0.01), which a
deliberately wrong sampler fails."""

from __future__ import annotations

import pytest
import torch

from fleetllm.spec_decode import rejection_sampler
from fleetllm.spec_decode.ngram_proposer import NgramProposer
from fleetllm.spec_decode.rejection_sampler import greedy_accept, rejection_sample

DRAWS, VOCAB, K = 20_000, 6, 3


def test_ngram_proposes_what_followed_the_latest_match():
    prop = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert prop.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]  # "2 3" seen before
    assert prop.propose([7, 1, 2, 8, 1, 2, 9, 5, 1, 2]) == [9, 5, 1]  # the latest match
    assert prop.propose([1, 2, 3]) == []  # nothing repeats
    assert prop.propose([4, 4]) == [4]  # only one token known after the match
    assert NgramProposer(2, 2, 2).propose([5, 6, 1, 6]) == []  # the 2-gram "1 6" is new
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat.double() / 2))


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(K + 1, VOCAB, generator=g) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(K, VOCAB, generator=g) * 1.5, dim=-1)
    draft_tokens = torch.stack([torch.multinomial(draft, 1, generator=g).squeeze(1)
                                for _ in range(DRAWS)])  # [DRAWS, K], drawn from the draft
    return target, draft, draft_tokens


def _emitted(sampler, target, draft, draft_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return sampler(target.expand(DRAWS, -1, -1), draft_tokens,
                   None if draft is None else draft.expand(DRAWS, -1, -1), generator=g)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampled_tokens_follow_the_target(deterministic_draft):
    target, draft, draft_tokens = _setup(0)
    if deterministic_draft:  # an n-gram draft: a fixed token, q one-hot
        draft_tokens = torch.full_like(draft_tokens, 2)
        draft = None
    out = _emitted(rejection_sample, target, draft, draft_tokens, 1)
    # The first token is distributed as the target's first position; the second, among
    # draws whose first token was accepted as the draft's, as the target's second (given
    # that prefix, which the target scored).
    counts0 = torch.bincount(out[:, 0], minlength=VOCAB).double()
    assert _chi_square_p(counts0, target[0].double()) > 0.01
    took = out[:, 0] == draft_tokens[:, 0]
    counts1 = torch.bincount(out[took, 1], minlength=VOCAB).double()
    assert _chi_square_p(counts1, target[1].double()) > 0.01
    emitted = (out >= 0).sum(dim=1)
    assert bool((emitted >= 1).all()) and bool((emitted <= K + 1).all())
    # -1 only after the emitted tokens
    assert bool(((out >= 0).int().diff(dim=1) <= 0).all())


def _resampling_from_the_target(target_probs, draft_token_ids, draft_probs, generator):
    """The classic bug: a rejected position drawn from p itself, not from max(0, p - q)."""
    p0, q0, x0 = target_probs[:, 0], draft_probs[:, 0], draft_token_ids[:, 0]
    rows = torch.arange(len(x0))
    u = torch.rand(len(x0), generator=generator)
    accepted = u * q0[rows, x0] < p0[rows, x0]
    redraw = torch.multinomial(p0, 1, generator=generator).squeeze(1)
    first = torch.where(accepted, x0, redraw)
    return torch.stack([first, torch.full_like(first, -1)], dim=1)


def test_a_wrong_sampler_fails_the_same_test():
    target, draft, draft_tokens = _setup(0)
    out = _emitted(_resampling_from_the_target, target, draft, draft_tokens, 1)
    counts0 = torch.bincount(out[:, 0], minlength=VOCAB).double()
    assert _chi_square_p(counts0, target[0].double()) < 0.01


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    argmax = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    drafts = torch.tensor([[4, 5, 6], [4, 9, 6], [1, 5, 6]])
    assert greedy_accept(argmax, drafts).tolist() == [[4, 5, 6, 7], [4, 5, -1, -1],
                                                      [4, -1, -1, -1]]
    assert rejection_sampler.greedy_accept is greedy_accept
