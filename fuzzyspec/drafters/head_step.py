"""An EAGLE head's step: its inputs in, its predicted features out, over the head's KV cache; eager or compiled.

Every head call the drafter makes (the true features after a verification, each chain token, each tree level)
writes its T inputs at the cache's ``length`` on, with rotary ``positions`` (default: the write positions), and
attends causally, or as ``allowed`` [T, n] (bool, on the device; a tree level's mask) says of the cache's last n - T
positions and the inputs themselves (every position before those is seen).

``HeadStep`` runs an EAGLE-1/2 head of the Llama family (``eagle_head.EagleHead``: fc over [embedding ; feature],
one decoder layer) as one function of tensors over a ``HeadCache`` of fixed capacity, through the same layer code
as the target's step (``core.step.decoder_layer``). Through transformers' decoder layer a draft call was about 60
eager operations and their Python around one token's worth of products: 1.06 ms of an 8.3 ms compiled int4 step
on a 2-core CPU (a 1-token chain, 2026-11-26), and on a GPU each eager operation costs a launch. With fixed shapes
the call compiles: at a few widths (T padded up, the padding written past ``length`` and never attended to), each
graph serving every cache capacity (a dimension kept symbolic), a call is one graph's run (on a GPU, CUDA graphs'
replay). On the CPU the graphs are kept on disk and called without dynamo (``core.kept``: compiled once per
machine, loaded by later processes): dynamo's frame evaluation and cache lookup were about half of a one-token
call's time (0.277 ms against 0.084 called directly, 2026-11-27).

``ModuleStep`` calls any other head (EAGLE-3, or a layer family our step does not cover) as its own module does,
over a ``DraftCache``.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch import Tensor, nn

from ..core import step as core_step
from ..core.graphs import Graphs
from ..core.host import upload
from ..core.int4 import Int8Linear
from ..core.kept import Kept, NotKept, fingerprint, marked_like, structure
from ..core.kernels import ROWS
from ..core.kvcache import DraftCache, HeadCache, attention_mask
from ..core.step import CPU_INDUCTOR, KEEPS, Compiled, Heads, decoder_layer, llama_layers, packed, whole_layer
from .eagle_head import EagleHead

WIDTHS = (1, 2, 4, 8)  # compiled widths of a head call: a chain step (1), the accepted tokens, a tree level


class ModuleStep:
    """A head called as its own module does, over a ``DraftCache`` (see the module docstring)."""

    compiles = False

    def __init__(self, head: nn.Module, embed: nn.Module) -> None:
        self.head, self.embed = head, embed

    def new_cache(self) -> DraftCache:
        return DraftCache()

    def borrow_cache(self, owner: object) -> DraftCache:
        return DraftCache()

    def __call__(self, cache: DraftCache, tokens: Tensor, features: Tensor, positions: Tensor | None = None,
                 allowed: Tensor | None = None, compiled: bool = False) -> Tensor:
        embeds = self.embed(tokens)
        mask = None
        if allowed is not None:  # (every position before the part ``allowed`` covers is seen)
            seen = cache.get_seq_length() + tokens.shape[1] - allowed.shape[1]
            mask = torch.cat([allowed.new_ones(allowed.shape[0], seen), allowed], 1)[None, None]
        return self.head(embeds, features.to(embeds.dtype), cache, mask=mask, positions=positions)


class HeadStep:
    """An EAGLE-1/2 head's step over a ``HeadCache``, eager or compiled (see the module docstring)."""

    compiles = True

    def __init__(self, head: EagleHead, embed: nn.Module) -> None:
        self.head, self.embed = head, embed
        weight = embed.weight
        self.heads = Heads.of(head.config, weight)
        self.dtype, self.device = weight.dtype, weight.device
        self.graphs = weight.device.type == "cuda"
        self._compiled: Compiled | None = None  # its calls keyed by (width, features' dtype)
        # On the CPU, the same calls kept on disk and called without dynamo (None: through dynamo's graphs)
        self._kept = Kept(_head_call, fingerprint(structure(head), structure(embed), "eagle head step"),
                          "the EAGLE head's step", CPU_INDUCTOR, _any_capacity) \
            if weight.device.type == "cpu" and KEEPS else None
        self._layer = _Layer(self)  # (what a kept graph reads)
        # its layer in one call in eager float32 steps, where its weights allow (a 4-bit target's drafter's 8 bits)
        self._whole = whole_layer(head.layers[0], self.heads)
        self._input = _input_in_one_call(head, embed) if self._whole is not None else None
        self._free: list[HeadCache] = []  # caches whose drafters are gone (``borrow_cache``)
        # On a GPU, EAGLE-2 trees' whole growth, captured per shape and cache, from a shape's third growth on
        # (``EagleDrafter._tree``)
        self.trees = Graphs(patience=2) if self.graphs else None

    @staticmethod
    def supports(head: nn.Module) -> bool:
        """An EAGLE-1/2 head whose layer is a Llama-family decoder layer as transformers writes it."""
        return isinstance(head, EagleHead) and llama_layers(head.config, head.layers)

    def new_cache(self, capacity: int = 0) -> HeadCache:
        return HeadCache(self.heads.kv, self.heads.dim, self.dtype, self.device, capacity)

    def borrow_cache(self, owner: object) -> HeadCache:
        """An empty cache for ``owner`` (a drafter), given back when ``owner`` is collected: one whose drafter
        is gone where there is one. Its tensors keep their addresses, so the CUDA graphs captured over them
        (``core.graphs``) serve the next answer too, where a new cache's would be captured again."""
        cache = self._free.pop() if self._free else self.new_cache()
        cache.length = 0
        weakref.finalize(owner, self._free.append, cache)
        return cache

    def forward(self, keys: Tensor, values: Tensor, tokens: Tensor, features: Tensor, positions: Tensor,
                write: Tensor, mask: Tensor) -> Tensor:
        """The head over [1, T] inputs written at ``write`` [1, T], attending where ``mask`` [1, 1, T, capacity]
        allows: predicted features [1, T, H]."""
        head = self.head
        if self._input is not None and core_step.fused_eager(features):
            h = torch.ops.fuzzyspec_int4.head_input(tokens, features, *self._input)
        else:
            h = head.fc(torch.cat([self.embed(tokens), features.to(self.dtype)], -1))
        cos, sin = head.rotary_emb(h, positions)
        where = torch.zeros(1, 1, dtype=torch.long, device=tokens.device)
        return decoder_layer(head.layers[0], h, cos[:, :, None], sin[:, :, None], keys, values, where, write, mask,
                             None, self.heads, whole=self._whole)

    @torch.inference_mode()
    def __call__(self, cache: HeadCache, tokens: Tensor, features: Tensor, positions: Tensor | None = None,
                 allowed: Tensor | None = None, compiled: bool = False, start: Tensor | None = None) -> Tensor:
        """``start``: where the inputs are written, as a tensor on the device, for a call inside a captured CUDA
        graph (a tree's growth, ``EagleDrafter._tree``), which must neither copy host data to the device nor
        replay a graph of its own: its mask is made on the device, the compiled function is called directly, and
        the cache's ``length`` is left as it is (the caller has made room). Needs ``allowed``."""
        width = tokens.shape[1]
        padded = next((w for w in WIDTHS if w >= width), None) if compiled else None
        run = padded or width
        device = tokens.device
        if start is None:
            start = cache.length
            cache.make_room(start + run)
            write = torch.arange(start, start + run, device=device)[None]
            # Where each input may look, made on the host: the cache so far, then the tree's (or causal) part; a
            # padding input sees itself alone, and is written past ``length``, where nothing reads it.
            own = _own_part(run, width if allowed is None else 0)
            if allowed is None and core_step.fused_eager(features):  # (one call of our kernels, not four ops)
                mask = attention_mask(write[:, 0], own[None], cache.capacity)[0, 0]
            else:
                mask = torch.zeros(run, cache.capacity, dtype=torch.bool)
                mask[:, :start] = True
                mask[:, start: start + run] = own
                mask = upload(mask, device)
            if allowed is not None:  # (a tree level's, made on the device: written there, not read back)
                mask[:width, start + width - allowed.shape[1]: start + width] = allowed
        else:
            write = start + torch.arange(run, device=device)[None]
            mask = _mask_on_device(write, width, allowed, cache.capacity)
        if run > width:
            tokens = torch.cat([tokens, tokens.new_zeros(1, run - width)], 1)
            features = torch.cat([features, features.new_zeros(1, run - width, features.shape[2])], 1)
            if positions is not None:
                positions = torch.cat([positions, positions[:, -1:].expand(1, run - width)], 1)
        if positions is None:  # (a tensor of its own: dynamo tells graphs apart by their inputs' aliasing too)
            positions = write.clone()
        arguments = (cache.keys, cache.values, tokens, features, positions, write, mask[None, None])
        if padded is None:
            hidden = self.forward(*arguments)
        else:
            arguments = tuple(packed(t) for t in arguments)  # (a slice's strides would compile a graph of its own)
            hidden = self._kept_call((run, features.dtype), arguments) if self._kept is not None else None
            if hidden is None:
                if self._compiled is None:
                    self._compiled = Compiled(self.forward, self.device, self.graphs)
                # One graph serves every capacity: the cache's length is a symbol in it (a long prompt's cache,
                # doubled past the capacities compiled ahead, otherwise compiled anew inside its answer)
                for tensor, dim in ((arguments[0], 2), (arguments[1], 2), (arguments[-1], 3)):
                    torch._dynamo.mark_dynamic(tensor, dim)
                if isinstance(start, Tensor):  # (inside a capture: the compiled function, not a replay)
                    hidden = self._compiled.checked((run, features.dtype), *arguments)
                else:
                    hidden = self._compiled((run, features.dtype), *arguments)
                    if self.graphs:  # the next replay overwrites it
                        hidden = hidden.clone()
        if not isinstance(start, Tensor):
            cache.length = start + width
        return hidden[:, :width]

    def _kept_call(self, key: tuple, arguments: tuple) -> Tensor | None:
        """The kept graph's result for ``key`` (width, features' dtype), or None where the head cannot be compiled
        ahead (then, for good, dynamo's graphs serve)."""
        try:
            return self._kept(key, self._layer, *arguments)
        except NotKept:  # (warned)
            self._kept = None
            return None

    @torch.inference_mode()  # (as decoding's inputs are made: graphs tell inference tensors apart)
    def prepare(self, capacity: int, on_compile: Callable[[], None] | None = None) -> None:
        """Compile ahead (or load, where kept) every width, at a cache of ``capacity`` positions: each graph serves
        every capacity. ``on_compile`` is told once, before the first width that compiles: on the CPU, none where
        every width's graph is kept already (``core.kept``); through dynamo's graphs, always."""
        features = self.head.config.hidden_size
        told = on_compile is None
        for width in WIDTHS:
            if not told and not (self._kept is not None and self._kept.ready((width, self.dtype))):
                on_compile()
                told = True
            cache = self.new_cache(capacity)
            tokens = torch.zeros(1, width, dtype=torch.long, device=self.device)
            self(cache, tokens, torch.zeros(1, width, features, dtype=self.dtype, device=self.device), compiled=True)


def _input_in_one_call(head: EagleHead, embed: nn.Module) -> tuple[Tensor, Tensor, Tensor] | None:
    """What ``fuzzyspec_int4.head_input`` takes to compute an eager step's ``fc([embed(tokens) ; features])`` in one
    call (the embedding's float32 rows, fc's 8-bit bytes, its bias or an empty tensor), where the head's fc is an
    8-bit layer of whole groups of rows beside a plain float32 embedding on the CPU; else None. Its four operations
    (lookup, concatenation, product, bias) each ran cold after a target pass: 0.23-0.26 ms of a draft on a 2-core
    AVX2 EPYC, for about 0.05 of products."""
    fc, weight = head.fc, getattr(embed, "weight", None)
    if not (isinstance(fc, Int8Linear) and fc.out_features % ROWS == 0 and type(embed) is nn.Embedding
            and embed.max_norm is None and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and fc.in_features == 2 * weight.shape[1]):
        return None
    bias = fc.bias.detach().float() if fc.bias is not None else weight.new_empty(0)
    return weight.detach(), fc.packed, bias


@functools.lru_cache(maxsize=64)
def _own_part(run: int, causal: int) -> Tensor:
    """[run, run] bool: what a call's inputs see of each other, the first ``causal`` causally, the rest (padding,
    or a tree level's nodes, whose mask the caller writes) themselves alone. Kept: on an H200 machine's host,
    cProfile gave a ``tril`` of it 0.63 ms a call, one a tree step (2026-11-28)."""
    part = torch.eye(run, dtype=torch.bool)
    part[:causal, :causal] = torch.ones(causal, causal, dtype=torch.bool).tril()
    return part


def _mask_on_device(write: Tensor, width: int, allowed: Tensor, capacity: int) -> Tensor:
    """The mask ``HeadStep`` makes on the host, made on the device from the write positions ``write`` [1, run]
    (the first at the cache's length): each input sees every position before the first, and itself; the first
    ``width`` inputs see the last n - width positions before them as ``allowed`` [width, n] says."""
    columns = torch.arange(capacity, device=write.device)
    mask = (columns < write[:, :1]) | (columns == write[0, :, None])
    n = allowed.shape[1]
    tree_part = write[:, :1] + torch.arange(width - n, width, device=write.device)
    mask[:width].scatter_(1, tree_part.expand(width, n), allowed)
    return mask


class _Layer:
    """What ``HeadStep.forward`` reads, and nothing else of the step (a kept graph's guards hold its state)."""

    forward = HeadStep.forward

    def __init__(self, step: HeadStep) -> None:
        self.head, self.embed, self.heads, self.dtype = step.head, step.embed, step.heads, step.dtype
        self._whole = None  # (a compiled graph leaves the layer's steps to inductor: ``decoder_layer``)
        self._input = None  # (and its input's: ``_input_in_one_call`` serves eager steps alone)


def _head_call(layer: _Layer, keys: Tensor, values: Tensor, tokens: Tensor, features: Tensor, positions: Tensor,
               write: Tensor, mask: Tensor) -> Tensor:
    """``HeadStep.forward`` as ``Kept`` compiles it: the cache's capacity told equal to the mask's (one symbol)."""
    torch._check(keys.shape[2] == mask.shape[3])
    torch._check(values.shape[2] == mask.shape[3])
    return layer.forward(keys, values, tokens, features, positions, write, mask)


def _any_capacity(arguments: tuple) -> tuple:
    """``_head_call``'s arguments as its graph is compiled from: stand-ins for the cache and the mask whose capacity
    is marked dynamic (``kept.marked_like``)."""
    layer, keys, values, *middle, mask = arguments
    return (layer, marked_like(keys, 2), marked_like(values, 2), *middle, marked_like(mask, 3))


_STEPS: "weakref.WeakKeyDictionary[nn.Module, HeadStep | ModuleStep]" = weakref.WeakKeyDictionary()


def head_step(head: nn.Module, embed: nn.Module) -> HeadStep | ModuleStep:
    """The step of ``head`` (with the target's input embedding ``embed``), one per loaded head: its drafters (one
    per sequence) share its compiled graphs."""
    step = _STEPS.get(head)
    if step is None or step.embed is not embed:
        step = HeadStep(head, embed) if HeadStep.supports(head) else ModuleStep(head, embed)
        _STEPS[head] = step
    return step
