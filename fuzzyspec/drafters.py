"""Drafters: whatever proposes the next few tokens for the target to check.

The decoding loop only ever calls ``propose`` and ``reset`` (and ``observe``,
for drafters that read the target's features); a new drafter plugs in by
implementing those.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor
from transformers import DynamicCache

from .kvcache import crop_to
from .sampling import Sampling
from .vocab import DraftVocab


@dataclass
class Proposal:
    """``tokens`` [B, k] drafted (target ids); ``logits`` [B, k, N] raw draft logits; ``probs``
    [B, k, N] the processed distributions the tokens were drawn from (q in the rules). With a
    reduced draft vocabulary (``vocab``) the N columns are its tokens and q is zero elsewhere;
    without one N is the target's vocabulary. ``full`` widens them when a rule needs q."""

    tokens: Tensor
    logits: Tensor
    probs: Tensor
    vocab: DraftVocab | None = None

    @staticmethod
    def empty(batch: int, vocab_size: int, device: torch.device) -> "Proposal":
        no_dist = torch.empty(batch, 0, vocab_size, device=device)
        return Proposal(torch.empty(batch, 0, dtype=torch.long, device=device), no_dist, no_dist)

    def full(self) -> tuple[Tensor, Tensor]:
        """(logits, probs) over the target's vocabulary: -inf and 0 outside a reduced draft vocabulary."""
        if self.vocab is None:
            return self.logits, self.probs
        return self.vocab.expand(self.logits, float("-inf")), self.vocab.expand(self.probs)


class Drafter(Protocol):
    forwards: int  # draft forward passes so far, for statistics

    def propose(self, sequence: Tensor, num: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        """Draft up to ``num`` tokens after ``sequence`` ([B, L], the prompt and every emitted token)."""

    def reset(self) -> None:
        """Forget all state (call between unrelated sequences)."""

    # Optional: a drafter with ``wants_target_features = True`` also gets
    # ``observe(start, features)`` after each target pass: the target's last hidden
    # states ([1, n, H], after its final norm) of positions start .. start + n - 1.


def common_prefix(a: Tensor, b: Tensor) -> int:
    """Length of the longest common prefix of two [1, L] token tensors."""
    n = min(a.shape[1], b.shape[1])
    same = (a[0, :n] == b[0, :n]).long()
    return int(same.cumprod(0).sum())


def draft_chain(logits: Tensor, advance: Callable[[Tensor], Tensor], num: int, sampling: Sampling,
                generator: torch.Generator | None, min_confidence: float = 0.0,
                vocab: DraftVocab | None = None) -> Proposal:
    """Draft up to ``num`` tokens one after another: pick a token from ``logits`` ([B, N]), then
    ``advance(token)`` ([B, 1], a target id) gives the next logits (not called after the last token).
    ``vocab`` maps the columns of a reduced draft vocabulary to target ids.

    With ``min_confidence > 0`` drafting stops before a token whose distribution's top
    probability is below it; the first token is always kept, so a proposal is never empty.
    """
    tokens, all_logits, all_probs = [], [], []
    for i in range(num):
        probs = sampling.probs(logits)
        if tokens and min_confidence and probs.max() < min_confidence:
            break
        token = sampling.pick(logits, probs, generator).unsqueeze(1)
        if vocab is not None:
            token = vocab.to_target(token)
        tokens.append(token)
        all_logits.append(logits)
        all_probs.append(probs)
        if i + 1 < num:
            logits = advance(token)
    return Proposal(torch.cat(tokens, 1), torch.stack(all_logits, 1), torch.stack(all_probs, 1), vocab)


class ModelDrafter:
    """A small causal LM sharing the target's vocabulary, drafting autoregressively.

    Its KV cache survives between steps: at each ``propose`` it is cropped back to
    the longest prefix it shares with the accepted sequence and only the new tokens
    are fed, so the prompt is never recomputed. ``min_confidence``: see ``draft_chain``.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, min_confidence: float = 0.0) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.vocab: DraftVocab | None = getattr(model, "draft_vocab", None)  # a reduced LM head's id map
        self.min_confidence = min_confidence
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached: Tensor | None = None  # the tokens whose keys and values are in the cache

    @torch.inference_mode()
    def propose(self, sequence: Tensor, num: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        if num < 1:
            return Proposal.empty(sequence.shape[0], self.vocab_size, sequence.device)
        kept = 0 if self.cached is None else common_prefix(self.cached, sequence)
        kept = min(kept, sequence.shape[1] - 1)  # always feed at least one token
        crop_to(self.cache, kept)
        fed: list[Tensor] = []  # drafted tokens fed to the model (all but the last, unless drafting stopped early)

        def forward(feed: Tensor) -> Tensor:
            out = self.model(input_ids=feed, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.forwards += 1
            logits = out.logits[:, -1]
            return logits if self.vocab is not None else logits[:, : self.vocab_size]

        def advance(token: Tensor) -> Tensor:
            fed.append(token)
            return forward(token)

        proposal = draft_chain(forward(sequence[:, kept:]), advance, num, sampling, generator, self.min_confidence,
                               self.vocab)
        self.cached = torch.cat([sequence, *fed], 1)
        return proposal
