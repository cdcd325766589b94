"""Drafting a chain token by token: the loop the model drafters (draft LMs and EAGLE heads) share."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..core.draft import Budget, Draft
from ..core.sampling import Sampling, argmax
from ..core.vocab import DraftVocab


def draft_chain(logits: Tensor, advance: Callable[[Tensor], Tensor], budget: Budget, sampling: Sampling,
                generator: torch.Generator | None, vocab: DraftVocab | None = None) -> Draft:
    """Draft up to ``budget.tokens`` tokens one after another: pick a token from ``logits`` ([1, N]), then
    ``advance(token)`` ([1, 1], a target id) gives the next logits (not called after the last token).
    ``vocab`` maps the columns of a reduced draft vocabulary to target ids. The draft keeps its distributions
    where the rule reads them (``budget.distributions``); a greedy chain that keeps none computes none."""
    likeliest = budget.greedy or sampling.greedy
    needs_probs = budget.distributions or bool(budget.min_confidence) or not likeliest
    tokens, all_logits, all_probs = [], [], []
    for i in range(budget.tokens):
        probs = sampling.probs(logits) if needs_probs else None
        if tokens and budget.min_confidence and probs.max() < budget.min_confidence:
            break
        token = (argmax(logits) if likeliest else sampling.pick(logits, probs, generator)).unsqueeze(1)
        if vocab is not None:
            token = vocab.to_target(token)
        tokens.append(token)
        all_logits.append(logits)
        all_probs.append(probs)
        if i + 1 < budget.tokens:
            logits = advance(token)
    chain = torch.cat(tokens, 1)[0]
    if not budget.distributions:
        return Draft.chain(chain, sampled=not likeliest)
    return Draft.chain(chain, torch.cat(all_probs), torch.cat(all_logits), vocab, sampled=not likeliest)
