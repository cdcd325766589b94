"""Drafting a chain token by token, and the model drafter (a small causal LM sharing the target's vocabulary).

The interface every drafter implements (``Drafter``, ``Draft``, ``Budget``) is the engine's and lives in
``core.draft``; it is re-exported here.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from .core.draft import BaseDrafter, Budget, Draft, Drafter  # noqa: F401 (re-exported)
from .core.kvcache import crop_to
from .core.sampling import Sampling
from .core.vocab import DraftVocab


def common_prefix(a: Tensor, b: Tensor) -> int:
    """Length of the longest common prefix of two [1, L] token tensors."""
    n = min(a.shape[1], b.shape[1])
    same = (a[0, :n] == b[0, :n]).long()
    return int(same.cumprod(0).sum())


def draft_chain(logits: Tensor, advance: Callable[[Tensor], Tensor], budget: Budget, sampling: Sampling,
                generator: torch.Generator | None, vocab: DraftVocab | None = None) -> Draft:
    """Draft up to ``budget.tokens`` tokens one after another: pick a token from ``logits`` ([1, N]), then
    ``advance(token)`` ([1, 1], a target id) gives the next logits (not called after the last token).
    ``vocab`` maps the columns of a reduced draft vocabulary to target ids."""
    tokens, all_logits, all_probs = [], [], []
    for i in range(budget.tokens):
        probs = sampling.probs(logits)
        if tokens and budget.min_confidence and probs.max() < budget.min_confidence:
            break
        token = (logits.argmax(-1) if budget.greedy else sampling.pick(logits, probs, generator)).unsqueeze(1)
        if vocab is not None:
            token = vocab.to_target(token)
        tokens.append(token)
        all_logits.append(logits)
        all_probs.append(probs)
        if i + 1 < budget.tokens:
            logits = advance(token)
    return Draft.chain(torch.cat(tokens, 1)[0], torch.cat(all_probs), torch.cat(all_logits), vocab,
                       sampled=not (sampling.greedy or budget.greedy))


class ModelDrafter(BaseDrafter):
    """A small causal LM sharing the target's vocabulary, drafting autoregressively.

    Its KV cache survives between steps: at each ``propose`` it is cropped back to
    the longest prefix it shares with the accepted sequence and only the new tokens
    are fed, so the prompt is never recomputed.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size
        self.vocab: DraftVocab | None = getattr(model, "draft_vocab", None)  # a reduced LM head's id map
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.cached: Tensor | None = None  # the tokens whose keys and values are in the cache

    @torch.inference_mode()
    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft:
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

        draft = draft_chain(forward(sequence[:, kept:]), advance, budget, sampling, generator, self.vocab)
        self.cached = torch.cat([sequence, *fed], 1)
        return draft
