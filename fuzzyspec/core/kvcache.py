"""KV caches: the target's static cache, whose write positions the engine owns, and the draft heads' caches.

``StaticCache`` preallocates every layer's keys and values for ``slots`` rows of up to ``capacity``
positions. Row (slot) b holds its tokens at positions 0 .. lengths[b] - 1, with no holes. A step feeds
k tokens per row and writes them at lengths[b] .. lengths[b] + k - 1; what the rule rejects is simply
not counted (the length does not move past it, and the next step overwrites it), and the kept path of
a tree is copied down to consecutive positions within its row. Nothing is concatenated per step, and
rows join and leave by taking and freeing slots.

Two rules keep compiled steps fast and safe:

- every layer's keys and values are separate tensors, written with an indexed assignment
  (``t[rows, :, positions] = new``), which inductor turns into an in-place write; a write into a view
  of one shared buffer, or a ``scatter_``, would be compiled as a copy of the whole buffer;
- compiled code does not check bounds (an index past the capacity aborts the process), so the engine
  checks every row's room on the host before each step (``fits``) and grows the cache (``grow``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from . import kernels
from .graphs import Graphs
from .host import upload

if TYPE_CHECKING:  # (importing transformers took 0.75 s of a one-shot answer: see core.llama)
    from transformers import DynamicCache


@dataclass(frozen=True)
class Held:
    """What a free slot of a ``StaticCache`` still holds: the keys and values of ``tokens`` ([n]) at positions
    0 .. n - 1, and the target features ([1, m, F], of positions since .. since + m - 1, at ``layers``) its last
    row's drafter held, where it read them."""

    tokens: Tensor
    features: Tensor | None = None
    layers: tuple[int, ...] = ()
    since: int = 0


class StaticCache:
    """Every layer's keys and values, [slots, kv_heads, capacity, head_dim] each, and each slot's length.

    ``lengths`` is kept on the host (the engine knows every row's length after each step without
    reading the device); a free slot has length 0. ``held[b]``: what a free slot b still holds (``Held``), left by
    the row that last ran there (None: nothing), which a new row whose prompt begins with the same tokens need not
    compute again (``Engine.add_many``).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (slots, kv_heads, capacity, head_dim)
        self.keys = [_static(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]
        self.values = [_static(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]
        self.lengths = [0] * slots
        self.held: list[Held | None] = [None] * slots
        self.moves: Graphs | None = None  # on a GPU, ``keep``'s graphs

    @classmethod
    def for_model(cls, config, slots: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
                  shards: int = 1) -> "StaticCache":
        """The cache of a model with this config; a tensor-parallel rank (one of ``shards``) holds its share
        of the key-value heads."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, kv_heads // shards, head_dim, slots, capacity, dtype, device)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def clear(self) -> None:
        """Empty every slot, in place (the tensors keep their addresses), but for what ``held`` says a slot
        holds. Zeroed past that, so that nothing a former row left (not even a NaN) can reach a masked-out
        product."""
        holding = any(held is not None for held in self.held)
        with torch.inference_mode():  # (the engine makes its caches in inference mode)
            for tensor in (*self.keys, *self.values):
                if not holding:
                    tensor.zero_()
                    continue
                for slot, held in enumerate(self.held):
                    tensor[slot, :, 0 if held is None else len(held.tokens):].zero_()
        self.lengths = [0] * self.slots

    def take_held(self, other: "StaticCache") -> None:
        """Copy what ``other``'s free slots hold (``held``) into this (empty) cache's same slots, where they fit."""
        with torch.inference_mode():
            for slot, held in enumerate(other.held[: self.slots]):
                if held is None or len(held.tokens) > self.capacity:
                    continue
                for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
                    for layer, tensor in enumerate(mine):
                        tensor[slot, :, : len(held.tokens)] = theirs[layer][slot, :, : len(held.tokens)]
                self.held[slot] = held

    def fits(self, width: int, rows: int | None = None) -> bool:
        """Whether each of the first ``rows`` slots can take ``width`` more positions."""
        return max(self.lengths[:rows] if rows else self.lengths, default=0) + width <= self.capacity

    def grow(self, slots: int | None = None, capacity: int | None = None) -> None:
        """Reallocate with more slots and/or positions, keeping what is there (a copy, paid rarely: the
        engine doubles the capacity when a row would not fit)."""
        slots, capacity = max(slots or 0, self.slots), max(capacity or 0, self.capacity)
        if (slots, capacity) == (self.slots, self.capacity):
            return
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
                new[: old.shape[0], :, : old.shape[2]] = old
                tensors[i] = _static(new)
        self.lengths += [0] * (slots - len(self.lengths))
        self.held += [None] * (slots - len(self.held))

    def keep(self, slot: int, start: int, columns: list[int]) -> None:
        """Of the positions a step wrote from ``start`` in ``slot``, keep ``columns`` (offsets, ascending, the
        kept path of a tree): their keys and values move down to start .. start + len(columns) - 1.

        Two indexing operations a layer's tensor cost 0.8 ms a tree step for the embedded model on a 2-core EPYC,
        and about 1 ms of an H200 machine's host: on the CPU our kernel moves them all in one call; on a GPU one
        CUDA graph (per slot and number of moves) does."""
        if columns == list(range(len(columns))):  # a chain's kept prefix is already in place
            return
        device = self.device
        if device.type == "cpu" and kernels.loaded():
            torch.ops.fuzzyspec_layer.keep_columns([*self.keys, *self.values], slot, start, columns)
            return
        moved = [(start + column, start + i) for i, column in enumerate(columns) if column != i]
        if device.type != "cuda":
            _move(self, upload(list(zip(*moved)), device), slot)
            return
        room = 1 << (len(moved) - 1).bit_length()  # (padded with the first move again: a graph per power of 2)
        moves = upload(list(zip(*(moved + moved[:1] * (room - len(moved))))), device)
        if self.moves is None:
            self.moves = Graphs(warm_up=False)  # (moving twice would move a column already moved)
        self.moves((slot, room), partial(_move, slot=slot), (self, moves))


def _move(cache: StaticCache, moves: Tensor, slot: int) -> None:
    """In ``slot`` of every layer's keys and values, positions ``moves[0]`` to ``moves[1]`` (all read, then all
    written)."""
    for tensor in (*cache.keys, *cache.values):
        row = tensor[slot]
        row[:, moves[1]] = row[:, moves[0]]


def _static(tensor: Tensor) -> Tensor:
    """``tensor``, marked as keeping its address: CUDA graphs (``core.step``) then write into it in place,
    where they would refuse to capture a step that changes one of its inputs."""
    if tensor.device.type == "cuda":
        torch._dynamo.mark_static_address(tensor)
    return tensor


def write_positions(starts: Tensor, width: int) -> Tensor:
    """[B, width]: where a step's tokens go, row b's from starts[b] on."""
    return starts[:, None] + torch.arange(width, device=starts.device)


def attention_mask(starts: Tensor, tree: Tensor, capacity: int) -> Tensor:
    """[B, 1, k, capacity] bool (True: may attend): query i of row b sees the row's cached positions
    (< starts[b]) and the new positions starts[b] + j that ``tree`` [B, k, k] allows. ``tree`` must let
    every node see itself (a query with nothing to see would give NaN). Its tensor ops cost O(B k capacity) and
    can run inside a compiled step; on the CPU, outside one, one call of our kernels makes the same mask (the
    seven ops took 71-79 us a step after a target pass, the call 32-38, on a 2-core AVX2 EPYC)."""
    if starts.device.type == "cpu" and not torch.compiler.is_compiling() and kernels.loaded():
        return torch.ops.fuzzyspec_layer.attention_mask(starts, tree, capacity)
    rows, width, _ = tree.shape
    positions = torch.arange(capacity, device=starts.device)
    mask = (positions[None, None, :] < starts[:, None, None]).expand(rows, width, capacity).clone()
    mask.scatter_(2, write_positions(starts, width)[:, None, :].expand(rows, width, width), tree)
    return mask[:, None]


def chain_tree(rows: int, width: int, device: torch.device | str) -> Tensor:
    """The tree mask of chains: every node sees itself and the nodes before it."""
    return torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(rows, width, width)


class DraftCache:
    """A draft head's keys and values for one sequence: per layer, [1, kv_heads, room, head_dim] with room grown
    by doubling, and how many positions are filled. It speaks the part of transformers' cache protocol a
    decoder layer uses (``update``, ``get_seq_length``), so a head's own layer or transformers' writes into it.

    transformers' ``DynamicCache`` concatenates each layer's whole cache at every call (a copy of it all per
    drafted token) and crops by slicing; here a write lands in place and dropping the positions a draft tree
    computed from its own predictions only moves the length back (``crop_to``)."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.lengths: list[int] = []

    def get_seq_length(self, layer: int = 0) -> int:
        return self.lengths[layer] if layer < len(self.lengths) else 0

    def update(self, keys: Tensor, values: Tensor, layer: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append ``keys``, ``values`` ([1, kv_heads, t, head_dim]) to ``layer``; return its filled keys and values."""
        if layer == len(self.lengths):
            self.keys.append(keys.new_empty(*keys.shape[:2], max(64, keys.shape[2]), keys.shape[3]))
            self.values.append(values.new_empty(self.keys[-1].shape))
            self.lengths.append(0)
        start = self.lengths[layer]
        end = start + keys.shape[2]
        if end > self.keys[layer].shape[2]:
            for tensors in (self.keys, self.values):
                grown = tensors[layer].new_empty(*keys.shape[:2], max(end, 2 * start), keys.shape[3])
                grown[:, :, :start] = tensors[layer][:, :, :start]
                tensors[layer] = grown
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class HeadCache:
    """A draft head's keys and values as a static cache for one sequence (``drafters.head_step``): one layer,
    [1, kv_heads, capacity, head_dim] each, filled to ``length``. The capacity is a power of two (at least
    ``HEAD_CAPACITY``), doubled when a call would write past it, so a compiled head step meets a handful of
    shapes; a call writes its inputs at ``length`` on, and cropping only moves ``length`` back."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 0) -> None:
        shape = (1, kv_heads, _room(capacity), head_dim)
        with torch.inference_mode():  # as the head's calls run: compiled graphs tell the two kinds of tensor apart
            self.keys = _static(torch.zeros(shape, dtype=dtype, device=device))
            self.values = _static(torch.zeros(shape, dtype=dtype, device=device))
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def make_room(self, end: int) -> None:
        """Grow (keeping what is there) so that positions up to ``end`` - 1 can be written."""
        if end <= self.capacity:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], _room(end), old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, _static(new))


HEAD_CAPACITY = 256


def _room(end: int) -> int:
    """The capacity that holds ``end`` positions: a power of two, at least ``HEAD_CAPACITY``."""
    return max(HEAD_CAPACITY, 1 << max(end - 1, 0).bit_length())


def common_prefix(a: Tensor, b: Tensor) -> int:
    """Length of the longest common prefix of two [1, L] token tensors (what a cache of ``a`` still holds of
    ``b``)."""
    n = min(a.shape[1], b.shape[1])
    same = (a[0, :n] == b[0, :n]).long()
    return int(same.cumprod(0).sum())


def crop_to(cache: DynamicCache | DraftCache | HeadCache, length: int) -> None:
    """Keep the first ``length`` positions of a drafter's cache (a ``DraftCache`` or ``HeadCache``: the lengths
    move back; a ``DynamicCache``: a slice of each layer's tensors). Either way it costs nothing in proportion to
    the prefix."""
    if isinstance(cache, HeadCache):
        cache.length = min(cache.length, length)
        return
    if isinstance(cache, DraftCache):
        cache.lengths = [min(filled, length) for filled in cache.lengths]
        return
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


def cache_keyword(function: Callable) -> str:
    """What ``function`` (a transformers model's or layer's forward, or its mask maker) calls its KV cache
    argument: ``cache`` from transformers 5.24 on, ``past_key_values`` before (still taken, with a warning)."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"
