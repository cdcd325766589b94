import torch

from fuzzyspec.core.draft import Budget, Draft
from fuzzyspec.drafters.lookup import CopyFirst, LookupDrafter
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


class Planned(LookupDrafter):
    """A stand-in for a model drafter: proposes a fixed token, and records what the engine tells it."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list = []

    def propose(self, sequence, budget, sampling, generator):
        self.forwards += 1
        return Draft.chain(torch.tensor([0] * budget.tokens))

    def observe(self, start, features):
        self.told.append(("observe", start))

    def accepted(self, count):
        self.told.append(("accepted", count))


def test_copy_first_copies_after_a_3_token_match_else_asks_its_drafter():
    inner = Planned()
    drafter = CopyFirst(inner)
    #                  "7 8 9" occurred at 1..3, followed by 4 5 6 2
    copied = drafter.propose(torch.tensor([[1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9]]), Budget(1, copy=3), Sampling(), None)
    assert copied.tokens.tolist() == [4, 5, 6] and not copied.planned and copied.q is None and inner.forwards == 0
    # a 2-token match is not enough, nor is a budget that lets nothing be copied (fsd at T = inf: nothing judges it)
    for tokens, budget in (([1, 8, 9, 4, 5, 2, 8, 9], Budget(2, copy=3)), ([1, 7, 8, 9, 4, 7, 8, 9], Budget(2))):
        draft = drafter.propose(torch.tensor([tokens]), budget, Sampling(), None)
        assert draft.tokens.tolist() == [0, 0] and draft.planned
    assert drafter.forwards == inner.forwards == 2
    # at a step planned to draft nothing (size 0), a copy or nothing: its drafter is not asked
    assert drafter.propose(torch.tensor([[1, 8, 9, 4]]), Budget(0, copy=3), Sampling(), None) is None
    assert drafter.propose(torch.tensor([[7, 8, 9, 4, 7, 8, 9]]), Budget(0, copy=3), Sampling(), None).tokens.tolist() \
        == [4, 7, 8]
    assert inner.forwards == 2
    drafter.observe(3, torch.zeros(1, 1, 4))
    drafter.accepted(2)
    assert inner.told == [("observe", 3), ("accepted", 2)]
