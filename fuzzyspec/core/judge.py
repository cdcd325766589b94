"""Judging a row's draft: the target's distributions in, the accepted path and the next token out.

``judge`` applies the row's rule (``rules`` on chains, vectorised; ``tree_rules`` on trees) and
computes the divergence D only where a fuzzy rule reads it. It answers in two halves (``Pending``): what
the rule computed, still on the device, and how to finish the verdict once those values are on the host,
so that the engine reads every row's outcome in one transfer per step (with the shape of a tree grown on the
device, ``Draft.grown``, which the host has not seen before). Chains under every rule, rows
with no drafts, and ``sd`` trees (greedy, or sampled with every row's test decided at once) need nothing
else from the device; fuzzy tree walks read the device as they go (at most once per level), because they
compute D only at the rows they visit: on a CPU, D at every row of a 16-node tree would cost more than the
reads it saves (about 1.2 ms a row over a 49k vocabulary, 2 threads).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..options import FUZZY
from .config import DecodeConfig
from .divergences import divergence, point_divergence
from .draft import Draft
from .rules import RULES
from .sampling import argmax, raw_probs, sample
from .tree_rules import decide_exactly, walk


@dataclass
class Verdict:
    """A rule's decision on one row's draft: the accepted nodes (root's child first), the token after them,
    what the statistics record (drafts that could have been accepted, and D where a fuzzy rule read it), and
    the draft's tokens as host ids."""

    path: list[int]
    token: int
    proposed: int
    d: Tensor | None
    drafted: list[int] = field(default_factory=list)

    @property
    def emitted(self) -> list[int]:
        """The tokens this step adds: the accepted drafts, then the target's next token."""
        return [self.drafted[node] for node in self.path] + [self.token]


def next_token_only(values: list[int]) -> Verdict:
    """The verdict of a row that drafted nothing: the target's next token, read back as ``values[0]``."""
    return Verdict([], values[0], 0, None)


@dataclass
class Pending:
    """A verdict whose last values are still on the device: ``values`` (a 1-D long tensor) is read with every
    other row's, and ``finish`` makes the verdict from them as a host list."""

    values: Tensor
    finish: Callable[[list[int]], Verdict]


def judge(config: DecodeConfig, draft: Draft | None, logits: Tensor, generator: torch.Generator | None
          ) -> Pending:
    """Apply the row's rule to its draft, given the target's logits [n + 1, V] at the root and every node."""
    sampling = config.sampling
    rule = "sd" if config.method == "ar" else config.method
    n = len(draft) if draft is not None else 0
    if rule == "sd" and sampling.greedy:
        # Greedy exact decoding reads only argmaxes, the logits' own (as a row with no drafts takes its next token:
        # a softmax over the vocabulary would cost time, and where two logits round to one probability its argmax
        # could pick another token than AR's). One operation on the device, then the walk on the host, for chains
        # and trees alike.
        ahead = argmax(logits)
        if n == 0:
            return Pending(ahead[:1], next_token_only)
        known = ahead.shape[0]

        def finish_greedy(values: list[int]) -> Verdict:
            values = _learn_shape(draft, values)
            drafted, ahead = values[known:], values[:known]
            path, token = walk(rule, draft, logits, None, config.threshold, True, tokens=drafted, argmax=ahead)
            return Verdict(path, token, n if draft.is_chain else max(draft.depths), None, drafted)

        return Pending(_with_shape(draft, torch.cat([ahead, draft.tokens]).long()), finish_greedy)
    fuzzy = rule in FUZZY
    p = sampling.probs(logits)
    if n == 0:
        return Pending(sample(p[0], generator).view(1), next_token_only)
    d = None
    if draft.is_chain:
        if fuzzy:
            d = _divergences(config, draft, logits[:n], p[:n], slice(0, n))
        # q matters to SD's test only where the chain was drawn from it; a chosen token is a point mass.
        q = draft.widened(slice(0, n))[1][None] if draft.sampled and not sampling.greedy else None
        accepted, token = RULES[rule](draft.tokens[None], p[None], q, d[None] if d is not None else None,
                                      config.threshold, sampling.greedy, generator)
        values = torch.cat([accepted.view(1), token.view(1), draft.tokens]).long()
        return Pending(values, lambda values: Verdict(list(range(values[0])), values[1], n, d, values[2:]))
    if rule == "sd":  # one read: every row's test decided at once
        decisions = decide_exactly(draft, p, generator)
        known = decisions.shape[0]

        def finish(values: list[int]) -> Verdict:
            values = _learn_shape(draft, values)
            drafted = values[known:]
            path, token = walk(rule, draft, p, None, config.threshold, False, tokens=drafted,
                               decisions=values[:known])
            return Verdict(path, token, max(draft.depths), None, drafted)

        return Pending(_with_shape(draft, torch.cat([decisions, draft.tokens]).long()), finish)
    draft.read_shape()  # (a fuzzy walk reads the device as it goes)
    depth = max(draft.depths)
    lazy = None
    if fuzzy:
        if draft.q is None:
            raise ValueError("fuzzy rules on a draft tree need the draft's distributions")
        lazy = _TreeDivergences(config, draft, logits, p)
    drafted = draft.tokens.tolist()
    path, token = walk(rule, draft, p, lazy, config.threshold, sampling.greedy, generator, tokens=drafted)
    verdict = Verdict(path, token, depth, lazy.computed() if lazy is not None else None, drafted)
    return Pending(draft.tokens.new_zeros(0), lambda values: verdict)


def _with_shape(draft: Draft, values: Tensor) -> Tensor:
    """``values``, and after them the parents of a tree grown on the device whose shape the host has not read."""
    return values if draft.parent_ids is not None else torch.cat([values, draft.grown.parents])


def _learn_shape(draft: Draft, values: list[int]) -> list[int]:
    """``values`` as ``_with_shape`` sent them, less the tree's parents, which the draft learns."""
    if draft.parent_ids is not None:
        return values
    n = len(draft)
    draft.learn_shape(values[-n:])
    return values[:-n]


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
