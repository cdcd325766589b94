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

from ..core.draft import BaseDrafter, Budget, Draft
from ..core.sampling import Sampling


class LookupDrafter(BaseDrafter):
    """Proposes the continuation of the latest earlier match of the sequence's last n tokens."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft | None:
        tokens = sequence[0]
        length = tokens.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself.
            windows = tokens[:-1].unfold(0, n, 1)
            starts = (windows == tokens[-n:]).all(1).nonzero().flatten()
            if starts.numel():
                begin = int(starts[-1]) + n
                copied = tokens[begin: begin + budget.tokens]
                if copied.numel():
                    return Draft.chain(copied)
        return None
