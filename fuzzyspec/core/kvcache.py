"""KV caches: a padded cache for many sequences of different lengths, and the crop the drafters use.

``PaddedCache`` keeps the tensors of a transformers ``DynamicCache`` for B rows at a
common length L, with a mask ``valid`` [B, L] saying which positions hold a real token
of that row. A forward feeds every row the same number of new positions; whatever a
row does not keep (rejected drafts, left padding) is only marked invalid, so no row is
shifted or recomputed mid-step. A query attends to the valid positions of its own row
and to the new positions its mask allows, at a position id equal to the number of
valid positions before it plus its depth, which is what the row would see decoded
alone. Columns invalid in every row are cropped off the end; when holes make up most
of a cache, ``compact`` packs each row's valid entries together.
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache``: a slice of each layer's
    tensors, so it costs nothing in proportion to the prefix."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5 takes the number of positions to drop, negated


def model_mask(model: torch.nn.Module, allowed: Tensor) -> Tensor:
    """A 4D mask ``allowed`` (True: may attend) in the form ``model``'s attention takes it: as it is for
    SDPA, additive for eager attention (which would add a boolean mask to the scores, masking nothing)."""
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    raise ValueError(f"trees and batching need custom attention masks, which {implementation!r} attention does "
                     "not take: load the model with attn_implementation='sdpa' or 'eager'")


class PaddedCache:
    """A KV cache for B rows of different lengths: the tensors of a DynamicCache and a validity mask."""

    def __init__(self, cache: DynamicCache | None = None, valid: Tensor | None = None) -> None:
        self.cache = cache if cache is not None else DynamicCache()
        self.valid = valid if valid is not None else torch.zeros(0, 0, dtype=torch.bool)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def _kv(self) -> list[tuple[Tensor, Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers
                if getattr(layer, "is_initialized", False) and layer.keys.numel()]

    def _rebuild(self, kv: list[tuple[Tensor, Tensor]], valid: Tensor) -> None:
        self.cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
        self.valid = valid

    def forward(self, model: torch.nn.Module, tokens: Tensor, new_valid: Tensor, logits_to_keep: int,
                allowed: Tensor | None = None, depths: Tensor | None = None, hidden_states: bool = False):
        """Feed ``tokens`` [B, n] (``new_valid`` [B, n] marks the real ones). Among the new positions,
        query i may attend to key j where ``allowed`` [B, n, n] says so (default: causally) and sits at
        ``depths`` [B, n] past the row's valid positions (default: its rank among the valid new ones).
        Returns the model output; the last ``logits_to_keep`` logits are in ``.logits``. The new
        positions join the cache."""
        rows, n = tokens.shape
        device = tokens.device
        valid = self.valid.to(device)
        mask = positions = None
        # No holes and a causal chain (a batch of one between steps, typically): the model's own causal
        # attention at positions length.. is the same thing, without building and applying a mask.
        if not (allowed is None and depths is None and bool(new_valid.all()) and bool(valid.all())):
            if allowed is None:
                allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
            eye = torch.eye(n, dtype=torch.bool, device=device)[None]
            new_part = (new_valid[:, None, :] & allowed) | eye  # a padded query sees itself: no empty row
            allowed_all = torch.cat([valid[:, None, :].expand(rows, n, self.length), new_part], 2)[:, None]
            mask = model_mask(model, allowed_all)
            if depths is None:
                depths = new_valid.long().cumsum(1) - 1
            positions = (valid.sum(1, keepdim=True) + depths).clamp_min(0)
        out = model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                    past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep,
                    output_hidden_states=hidden_states)
        self.valid = torch.cat([valid, new_valid], 1)
        return out

    def keep(self, row: int, start: int, width: int, columns: list[int]) -> None:
        """Of the ``width`` positions from ``start`` that a step fed, row ``row`` keeps ``columns`` (offsets,
        ascending): their keys and values move to the front of that span, the rest become invalid."""
        if columns != list(range(len(columns))):
            source = torch.tensor(columns, device=self.valid.device) + start
            for keys, values in self._kv():
                keys[row, :, start: start + len(columns)] = keys[row, :, source]
                values[row, :, start: start + len(columns)] = values[row, :, source]
        self.valid[row, start: start + width] = False
        self.valid[row, start: start + len(columns)] = True

    def drop(self, row: int, start: int) -> None:
        """Mark row ``row``'s positions from ``start`` on invalid."""
        self.valid[row, start:] = False

    def crop_unused(self) -> None:
        """Cut the trailing positions that no row holds (what every row rejected): no copy."""
        used = self.valid.any(0)
        length = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        if length < self.length:
            crop_to(self.cache, length)
            self.valid = self.valid[:, :length]

    def select(self, rows: Tensor) -> None:
        """Keep only these rows (a [b] long index)."""
        if rows.numel() == 0:  # start over: an empty batch has no length either
            self._rebuild([], self.valid.new_zeros(0, 0))
            return
        kv = [(k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device))) for k, v in self._kv()]
        self._rebuild(kv, self.valid.index_select(0, rows.to(self.valid.device)))

    def extend(self, other: "PaddedCache") -> None:
        """Append ``other``'s rows below these, left-padding the shorter side with invalid positions."""
        mine, theirs = self._kv(), other._kv()
        length = max(self.length, other.length)

        def pad(kv: list[tuple[Tensor, Tensor]], like: list[tuple[Tensor, Tensor]], rows: int, have: int
                ) -> list[tuple[Tensor, Tensor]]:
            if not kv:  # no positions at all: zeros shaped like the other side's layers
                kv = [(k.new_zeros(rows, *k.shape[1:-2], 0, k.shape[-1]),
                       v.new_zeros(rows, *v.shape[1:-2], 0, v.shape[-1])) for k, v in like]
            extra = length - have
            return [(torch.cat([k.new_zeros(*k.shape[:-2], extra, k.shape[-1]), k], -2),
                     torch.cat([v.new_zeros(*v.shape[:-2], extra, v.shape[-1]), v], -2)) for k, v in kv]

        valid = torch.cat([_left_pad(self.valid, length), _left_pad(other.valid, length)], 0)
        if not mine and not theirs:
            self._rebuild([], valid)
            return
        a = pad(mine, theirs, self.rows, self.length)
        b = pad(theirs, mine, other.rows, other.length)
        self._rebuild([(torch.cat([ka, kb], 0), torch.cat([va, vb], 0)) for (ka, va), (kb, vb) in zip(a, b)], valid)

    def compact(self) -> None:
        """Pack each row's valid positions to the right end (left padding), dropping the holes."""
        counts = self.valid.sum(1)
        length = int(counts.max()) if self.rows else 0
        if length == self.length:
            return
        # Sorting by (valid, position) puts each row's valid positions last, in order.
        order = torch.arange(self.length, device=self.valid.device)
        keys = self.valid.long() * self.length + order
        index = keys.argsort(1)[:, -length:] if length else keys[:, :0]
        valid = self.valid.gather(1, index)
        kv = []
        for k, v in self._kv():
            gather = index.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            kv.append((k.gather(2, gather), v.gather(2, gather)))
        self._rebuild(kv, valid)

    @property
    def holes(self) -> int:
        return int(self.length - self.valid.sum(1).max()) if self.rows else 0


def _left_pad(mask: Tensor, length: int) -> Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], length - mask.shape[1]), mask], 1)
