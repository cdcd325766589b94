"""Judging a row's draft: the target's distributions in, the accepted path and the next token out.

``judge`` applies the row's rule (``rules`` on chains, vectorised; ``tree_rules.walk`` on trees) and
computes the divergence D only where a fuzzy rule reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..options import FUZZY
from .config import DecodeConfig
from .divergences import divergence, point_divergence
from .draft import Draft
from .rules import RULES
from .sampling import raw_probs, sample
from .tree_rules import walk


@dataclass
class Verdict:
    """A rule's decision on one row's draft: the accepted nodes (root's child first), the token after them,
    what the statistics record (drafts that could have been accepted, and D where a fuzzy rule read it)."""

    path: list[int]
    token: int
    proposed: int
    d: Tensor | None


def judge(config: DecodeConfig, draft: Draft | None, logits: Tensor, generator: torch.Generator | None
          ) -> Verdict:
    """Apply the row's rule to its draft, given the target's logits [n + 1, V] at the root and every node."""
    sampling = config.sampling
    p = sampling.probs(logits)
    rule = "sd" if config.method == "ar" else config.method
    fuzzy = rule in FUZZY
    n = len(draft) if draft is not None else 0
    if n == 0:
        token = p[0].argmax() if sampling.greedy else sample(p[0], generator)
        return Verdict([], int(token), 0, None)
    d = None
    if draft.is_chain:
        if fuzzy:
            d = _divergences(config, draft, logits[:n], p[:n], slice(0, n))
        # q matters to SD's test only where the chain was drawn from it; a chosen token is a point mass.
        q = draft.widened(slice(0, n))[1][None] if draft.sampled and not sampling.greedy else None
        accepted, token = RULES[rule](draft.tokens[None], p[None], q, d[None] if d is not None else None,
                                      config.threshold, sampling.greedy, generator)
        return Verdict(list(range(int(accepted[0]))), int(token[0]), n, d)
    lazy = None
    if fuzzy:
        if draft.q is None:
            raise ValueError("fuzzy rules on a draft tree need the draft's distributions")
        lazy = _TreeDivergences(config, draft, logits, p)
    path, token = walk(rule, draft, p, lazy, config.threshold, sampling.greedy, generator)
    return Verdict(path, token, max(draft.depths), lazy.computed() if lazy is not None else None)


class _TreeDivergences:
    """D(p, q) at the rows of a tree that the walk reads, computed on first read: the walk visits at most
    depth + 1 of a tree's rows, and a divergence over the whole vocabulary is the costly part of a step."""

    def __init__(self, config: DecodeConfig, draft: Draft, logits: Tensor, p: Tensor) -> None:
        self.config, self.draft, self.logits, self.p = config, draft, logits, p
        self.values: dict[int, Tensor] = {}

    def __getitem__(self, row: int) -> Tensor:
        if row not in self.values:
            rows = slice(row, row + 1)
            self.values[row] = _divergences(self.config, self.draft, self.logits[rows], self.p[rows], rows)[0]
        return self.values[row]

    def computed(self) -> Tensor | None:
        return torch.stack(list(self.values.values())) if self.values else None


def _divergences(config: DecodeConfig, draft: Draft, target_logits: Tensor, p: Tensor, rows) -> Tensor:
    """D(p, q) at the draft's ``rows``: on the processed distributions or (``raw_divergence``) the raw ones;
    a draft without distributions is a point mass on each drafted token."""
    options = dict(top_k=config.divergence_top_k, top_p=config.divergence_top_p)
    if config.raw_divergence:
        p = raw_probs(target_logits)
    if draft.q is None:
        return point_divergence(p, draft.tokens[rows], config.divergence, **options)
    draft_logits, q = draft.widened(rows)
    if config.raw_divergence:
        q = raw_probs(draft_logits)
    return divergence(p, q, config.divergence, **options)
