"""Speculative decoding's n-gram proposer on its own: what it drafts after the latest match.
(The engine accepts drafts in model_runner._accept_drafts:
tests/spec_decode/test_spec_decode.py.)"""

from __future__ import annotations

import pytest

from fleetllm.spec_decode.ngram_proposer import NgramProposer


def test_ngram_proposes_what_followed_the_latest_match():
    prop = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert prop.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]  # "2 3" seen before
    assert prop.propose([7, 1, 2, 8, 1, 2, 9, 5, 1, 2]) == [9, 5, 1]  # the latest match
    assert prop.propose([1, 2, 3]) == []  # nothing repeats
    assert prop.propose([4, 4]) == [4]  # only one token known after the match
    assert NgramProposer(2, 2, 2).propose([5, 6, 1, 6]) == []  # the 2-gram "1 6" is new
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)
