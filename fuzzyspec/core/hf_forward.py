"""One step of any Hugging Face causal LM over our ``StaticCache`` (``step.make_forward`` picks it where our own
``LlamaForward`` does not serve): transformers' attention is called with a cache whose layers write at the
positions the engine gives, and a 4D mask passed through untouched. Apart from ``core.step`` because it imports
transformers, which a 4-bit target's answer does without."""
from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .kvcache import StaticCache, cache_keyword
from .step import Features


class _PositionedLayer(CacheLayerMixin):
    """One layer's view of a StaticCache for transformers' attention: writes at the owner's positions."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "_PositionedCache", index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # the StaticCache is allocated already

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        owner = self.owner
        keys, values = owner.cache.keys[self.index], owner.cache.values[self.index]
        keys[owner.where, :, owner.write] = key_states.transpose(1, 2)
        values[owner.where, :, owner.write] = value_states.transpose(1, 2)
        if owner.slots is not None:
            return keys.index_select(0, owner.slots), values.index_select(0, owner.slots)
        rows = owner.where.shape[0]
        return (keys, values) if keys.shape[0] == rows else (keys[:rows], values[:rows])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.cache.capacity, 0

    def get_seq_length(self) -> int:  # rows have lengths of their own: position ids are always given
        raise NotImplementedError("a positioned cache has no single length; pass position_ids and a 4D mask")

    def get_max_length(self) -> int:
        return self.owner.cache.capacity


class _PositionedCache(Cache):
    """A transformers ``Cache`` over a StaticCache whose write positions are set before each forward.
    transformers' attention calls ``update(key, value, layer)`` with no positions at all (and its own
    ``StaticCache`` writes at a counter of its own), so the positions travel on the cache object."""

    def __init__(self, cache: StaticCache, layers: int) -> None:
        self.cache = cache
        self.where = self.write = self.slots = None
        super().__init__(layers=[_PositionedLayer(self, i) for i in range(layers)])


class HFForward(nn.Module):
    """One step of any Hugging Face causal LM that takes a 4D attention mask (sdpa or eager attention)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"the engine needs custom attention masks, which {implementation!r} attention does not "
                             "take: load the model with attn_implementation='sdpa' or 'eager'")
        self.model, self.additive = model, implementation == "eager"
        self.layer_count = model.config.num_hidden_layers
        self.cache_keyword = cache_keyword(model.forward)
        # transformers repeats the kv heads of grouped-query attention before SDPA whenever a mask is given
        # (a copy of each layer's cache per step) unless told to let SDPA share them.
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

    def forward(self, cache: StaticCache, tokens: Tensor, positions: Tensor, write: Tensor, mask: Tensor,
                slots: Tensor | None = None, keep: int = 0, features: tuple[int, ...] = ()
                ) -> tuple[Tensor, Features]:
        positioned = _PositionedCache(cache, self.layer_count)
        positioned.write, positioned.slots = write, slots
        positioned.where = (slots if slots is not None else torch.arange(tokens.shape[0], device=tokens.device))[:, None]
        if self.additive:  # eager attention adds the mask to the scores
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, **{self.cache_keyword: positioned},
                         use_cache=True, logits_to_keep=keep, output_hidden_states=bool(features))
        found = {i: out.hidden_states[i] for i in features} if features else {}
        return out.logits, found
