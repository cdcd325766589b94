import torch

from fuzzyspec.core.draft import Budget
from fuzzyspec.drafters.lookup import LookupDrafter
from fuzzyspec.core.sampling import Sampling


def propose(drafter, tokens, budget=4):
    return drafter.propose(torch.tensor([tokens]), Budget(budget), Sampling(), None)


def test_copies_what_followed_the_latest_match_of_the_longest_suffix():
    drafter = LookupDrafter(max_ngram=3)
    #            the suffix 7 8 9 occurred at 1..3, followed by 4 5 6; 8 9 alone also at 10..11
    draft = propose(drafter, [1, 7, 8, 9, 4, 5, 6, 2, 3, 8, 9, 0, 7, 8, 9])
    assert draft.tokens.tolist() == [4, 5, 6, 2] and draft.is_chain and draft.q is None
    # The latest of several matches wins, and the budget caps the copy.
    assert propose(drafter, [5, 1, 2, 5, 3, 5], budget=2).tokens.tolist() == [3, 5]


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    drafter = LookupDrafter(max_ngram=3, min_ngram=1)
    assert propose(drafter, [1, 2, 3, 9, 9, 4, 3]).tokens.tolist() == [9, 9, 4, 3]  # only "3" matches
    assert propose(drafter, [1, 2, 3, 4]) is None
    assert propose(LookupDrafter(3, 2), [1, 2, 3, 9, 9, 4, 3]) is None  # "3" is too short a match
    assert propose(drafter, [5]) is None
