"""The model drafter: a small causal LM sharing the target's vocabulary, drafting token by token."""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.draft import BaseDrafter, Budget, Draft
from ..core.kvcache import cache_keyword, common_prefix, crop_to
from ..core.sampling import Sampling
from ..core.vocab import DraftVocab
from .chain import draft_chain


class ModelDrafter(BaseDrafter):
    """A small causal LM sharing the target's vocabulary, drafting autoregressively.

    Its KV cache survives between steps: at each ``propose`` it is cropped back to
    the longest prefix it shares with the accepted sequence and only the new tokens
    are fed, so the prompt is never recomputed. Where the text outgrows ``window`` (the
    positions it trained on), it reads the text's last half window alone, as if the text
    began there (a model with rotary embeddings sees only distances), and again each time
    they grow to a whole window.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, vocab: DraftVocab | None = None,
                 window: int | None = None) -> None:
        """``vocab``: the id map of a reduced LM head (its logits then cover those N tokens only); ``window``:
        the positions it reads at most (None: all)."""
        super().__init__()
        self.model = model
        self.cache_keyword = cache_keyword(model.forward)
        self.vocab_size = vocab_size
        self.vocab = vocab
        self.window = window
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.cached: Tensor | None = None  # the tokens whose keys and values are in the cache
        self.seen = 0  # the length of the sequence the last proposal was made for
        self.valid: int | None = None  # positions of the cache known to match the next sequence
        self.offset = 0  # the text position of the cache's first

    def accepted(self, count: int) -> None:
        self.valid = self.seen + count

    @torch.inference_mode()
    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft:
        if self.cached is None:
            kept = 0
        elif self.valid is not None:  # told by the engine: no need to compare tokens on the device
            kept = min(self.valid, self.cached.shape[1])
        else:
            kept = common_prefix(self.cached, sequence)
        kept = min(kept, sequence.shape[1] - 1)  # always feed at least one token
        self.seen, self.valid = sequence.shape[1], None
        if self.window and (sequence.shape[1] - self.offset > self.window or kept < self.offset):
            self.offset = kept = max(0, sequence.shape[1] - 1 - self.window // 2)  # (the cache anew from there)
        crop_to(self.cache, kept - self.offset)
        fed: list[Tensor] = []  # drafted tokens fed to the model (all but the last, unless drafting stopped early)

        def forward(feed: Tensor) -> Tensor:
            out = self.model(input_ids=feed, **{self.cache_keyword: self.cache}, use_cache=True, logits_to_keep=1)
            self.forwards += 1
            logits = out.logits[:, -1]
            return logits if self.vocab is not None else logits[:, : self.vocab_size]

        def advance(token: Tensor) -> Tensor:
            fed.append(token)
            return forward(token)

        draft = draft_chain(forward(sequence[:, kept:]), advance, budget, sampling, generator, self.vocab)
        self.cached = torch.cat([sequence, *fed], 1)
        return draft
