"""Prompt lookup: drafting by copying, with no weights at all.

When an answer quotes, edits or extracts from its prompt (or repeats itself), the
next tokens often already appear in the text so far. The drafter finds the most
recent earlier occurrence of the sequence's last n tokens (n from ``max_ngram``
down to ``min_ngram``) and proposes the tokens that followed it, as transformers'
``prompt_lookup_num_tokens`` and vLLM's n-gram drafter do. Each proposed token is
chosen with certainty, so its draft distribution is a point mass (``Draft.q`` is
None) and SD stays exact: the target accepts a copied token with probability
p(token).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.draft import BaseDrafter, Budget, Draft, Drafter
from ..core.sampling import Sampling


def copy_of(tokens: Tensor, max_ngram: int, min_ngram: int, count: int) -> Tensor | None:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the last n of ``tokens`` [L], for the
    largest n from ``max_ngram`` down to ``min_ngram`` that has one; None where none has."""
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself.
        windows = tokens[:-1].unfold(0, n, 1)
        starts = (windows == tokens[-n:]).all(1).nonzero().flatten()
        if starts.numel():
            begin = int(starts[-1]) + n
            copied = tokens[begin: begin + count]
            if copied.numel():
                return copied
    return None


class LookupDrafter(BaseDrafter):
    """Proposes the continuation of the latest earlier match of the sequence's last n tokens."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft | None:
        copied = copy_of(sequence[0], self.max_ngram, self.min_ngram, budget.tokens)
        return None if copied is None else Draft.chain(copied)


class CopyFirst(BaseDrafter):
    """``drafter``, except where the sequence's last ``ngram`` tokens occurred earlier in it: then the tokens that
    followed them, copied (up to ``Budget.copy``, which the cost schedule sizes from the copies' own acceptance and
    the measured widths, ``cost.copy_length``; a draft not ``planned``). The default job drafts so.

    Why: on everyday prompts (the target's greedy answers to 32 of them, 2026-11-26), the last 3 tokens had occurred
    before at 12% of the steps, and then the copy's first token was the target's 73% of the time and 2.1 of up to 4
    copied tokens were, against about 0.5 tokens a step from the shipped EAGLE head's 1-token chains. A copy costs no
    model pass, and an answer that quotes, lists or repeats its prompt's phrases does this most (writing, roleplay
    and extraction prompts: 16-24% of steps). Shorter matches copy far worse (1 token: 18% right). It copies at
    steps where the planner drafts nothing too (``copies``). Made for a target on the CPU only (``registry``): on a
    GPU each step's match would cost a host sync, and would keep AR steps from running ahead."""

    copies = True

    def __init__(self, drafter: Drafter, ngram: int = 3) -> None:
        self.drafter, self.ngram = drafter, ngram
        self.name = drafter.name
        self.wants_target_features = drafter.wants_target_features
        self.drafts_trees = drafter.drafts_trees
        self.feature_layers = drafter.feature_layers

    @property
    def forwards(self) -> int:  # (a copy takes none)
        return self.drafter.forwards

    @property
    def compiled(self) -> bool:
        return self.drafter.compiled

    @compiled.setter
    def compiled(self, compiled: bool) -> None:
        self.drafter.compiled = compiled

    def reset(self) -> None:
        self.drafter.reset()

    def observe(self, start: int, features: Tensor) -> None:
        self.drafter.observe(start, features)

    def accepted(self, count: int) -> None:
        self.drafter.accepted(count)

    def first_feature(self, length: int) -> int:
        return getattr(self.drafter, "first_feature", lambda n: 0)(length)

    def true_features(self) -> tuple[int, Tensor] | None:
        return getattr(self.drafter, "true_features", lambda: None)()

    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft | None:
        if budget.copy:
            copied = copy_of(sequence[0], self.ngram, self.ngram, budget.copy)
            if copied is not None:
                draft = Draft.chain(copied)
                draft.planned = False
                return draft
        return self.drafter.propose(sequence, budget, sampling, generator) if budget.tokens else None
