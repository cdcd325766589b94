"""The target's forward over a ``StaticCache``: k new tokens per row, in one call, eager or compiled.

Two forwards give the same numbers (tested):

- ``LlamaForward``: our own forward over a Llama-family model's weights (Llama, Mistral, Qwen2 and
  the like: RMSNorm, rotary embeddings, grouped-query attention, a gated SiLU MLP), written as one
  flat function of tensors in the manner of gpt-fast, so that ``torch.compile`` sees the whole step.
  It calls the model's own projection modules, so a model whose linear layers hold int4 weights
  (``core.int4.Int4Linear``) runs through the same code;
- ``HFForward`` (``core.hf_forward``): any Hugging Face causal LM, called with a ``transformers`` cache whose
  layers write at the positions the engine gives and a 4D mask passed through untouched.

``Forward.__call__`` takes, for B rows of k tokens: ``tokens`` [B, k], ``positions`` [B, k] (each
token's position id), ``write`` [B, k] (where its keys and values go in its row), ``mask``
[B, 1, k, capacity] (``kvcache.attention_mask``), ``slots`` (None: rows 0 .. B - 1 of the cache; else
the cache rows these B rows are, for a prefill of joining rows), ``keep`` (logits of the last ``keep``
tokens; 0: all) and ``features`` (indices into what would be Hugging Face's ``hidden_states``: i < L
the input of layer i, L the final normed output). It returns the logits [B, keep or k, V] and a dict
of the asked features [B, k, H].
"""
from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .attention import attend, runs as attention_runs
from .cost import Profile
from .graphs import Graphs
from .int4 import Int4Linear, Int8Linear, holds_blocks, projection_groups
from .kernels import ROWS
from .kept import Kept, NotKept, fingerprint, marked_like, structure
from .kvcache import StaticCache, attention_mask, chain_tree, write_positions
from .llama import Rotary, normed, rotate
from .parallel import shards

Features = dict[int, Tensor]
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Heads:
    """A Llama-family attention's shape, as one rank computes it (``ranks``: a tensor-parallel rank holds its
    share of the heads), and whether ``attend`` serves it: float32 on a CPU, where our attention gives a query the
    same numbers in a pass of any width (``core.attention``), so a verification scores each token as a one-token
    step would."""

    count: int
    kv: int
    dim: int
    invariant: bool

    @classmethod
    def of(cls, config, weight: Tensor, ranks: int = 1) -> "Heads":
        """The heads of a model with this ``config`` whose weights are like ``weight`` (device, dtype)."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(heads // ranks, kv // ranks, dim, attention_runs(weight.device, weight.dtype))

    @property
    def widths(self) -> tuple[int, int, int]:
        """The widths of q, k and v in a fused q|k|v product."""
        return self.count * self.dim, self.kv * self.dim, self.kv * self.dim


def llama_layers(config, layers) -> bool:
    """Whether ``layers`` (of a model with this ``config``) are Llama-family decoder layers as transformers writes
    them, with no sliding window in play: what ``decoder_layer`` runs."""
    return (config.model_type in LLAMA_FAMILY and not getattr(config, "sliding_window", None)
            and getattr(config, "hidden_act", "silu") == "silu"
            and all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers))


def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """transformers' RMSNorm, in float32 with the weight applied after casting back (an ``nn.Identity``, as an
    EAGLE head's dropped input norm is, passes ``x`` through)."""
    if isinstance(norm, nn.Identity):
        return x
    if fused_eager(x) and norm.weight.dtype == torch.float32:
        return torch.ops.fuzzyspec_layer.rms_norm(x, norm.weight, norm.variance_epsilon)
    return normed(x, norm.weight, norm.variance_epsilon)


def fused_eager(x: Tensor) -> bool:
    """Whether an eager step over ``x`` runs its layers' small steps through ``layer_kernel.cpp`` (one call for a
    norm, one for the rotary embedding and cache writes, where PyTorch makes six and about twenty: an eager 4-bit
    step of the embedded model went from 10.0 to 7.2 ms): float32 on a CPU with our kernels, outside autograd, and
    not while compiling (inductor fuses them itself)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and kernels.available())


def _whole_calls(h: Tensor, keys: Tensor) -> bool:
    """Whether an eager step runs a layer's ``whole_layer`` in one call (``fuzzyspec_layer.decoder_layer``)."""
    return fused_eager(h) and keys.dtype in (torch.float32, torch.float16)


def decoder_layer(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                  where: Tensor, write: Tensor, mask: Tensor, slots: Tensor | None, heads: Heads,
                  qkv: nn.Module | None = None, gate_up: nn.Module | None = None, whole: tuple | None = None
                  ) -> Tensor:
    """One Llama-family decoder ``layer`` (its own modules) over the residual stream ``h`` [B, k, H]: its keys
    and values go into ``keys``, ``values`` [slots, kv_heads, capacity, D] at rows ``where`` [B, 1] and positions
    ``write`` [B, k]; attention reads the cache rows (``slots`` where given, else the first B) where ``mask``
    [B, 1, k, capacity] allows; ``cos``, ``sin`` [B, k, 1, D]. ``qkv``, ``gate_up``: fused projections, if any.
    ``whole``: the layer's ``whole_layer``, which an eager float32 step runs in one call. Returns the new ``h``.
    The target's step and an EAGLE head's step both run their layers through it."""
    if whole is not None and _whole_calls(h, keys):
        return torch.ops.fuzzyspec_layer.decoder_layer(h, *whole, cos, sin, keys, values, where, write, mask,
                                                       heads.count, heads.kv, heads.dim ** -0.5)
    rows, width = h.shape[:2]
    attention = layer.self_attn
    x = rms_norm(layer.input_layernorm, h)
    if qkv is not None:
        q, k, v = qkv(x).split(heads.widths, -1)
    else:
        q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    if fused_eager(h) and cos.dtype == torch.float32 and keys.dtype in (torch.float32, torch.float16):
        q = torch.ops.fuzzyspec_layer.rope_store(q, k, v, cos, sin, keys, values, where, write, heads.count, heads.kv)
    else:
        q = rotate(q.view(rows, width, heads.count, heads.dim), cos, sin)
        k = rotate(k.view(rows, width, heads.kv, heads.dim), cos, sin)
        v = v.view(rows, width, heads.kv, heads.dim)
        # [B, k, kv_heads, D] is the layout the advanced indices (first) give: no transpose to write.
        keys[where, :, write] = k
        values[where, :, write] = v
    if slots is not None:
        keys, values = keys.index_select(0, slots), values.index_select(0, slots)
    elif keys.shape[0] != rows:  # the step runs over the first rows of a larger cache
        keys, values = keys[:rows], values[:rows]
    scale = heads.dim ** -0.5
    if heads.invariant:
        out = attend(q, keys, values, mask, scale)
    else:  # enable_gqa: the kv heads are shared by SDPA itself, never repeated (a copy of the layer's cache)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=heads.count != heads.kv).transpose(1, 2)
    h = h + attention.o_proj(out.reshape(rows, width, heads.count * heads.dim))
    mlp = layer.mlp
    x = rms_norm(layer.post_attention_layernorm, h)
    if gate_up is not None and fused_eager(h):  # (one call, and the whole layer's op computes it so)
        return h + mlp.down_proj(torch.ops.fuzzyspec_layer.silu_mul(gate_up(x)))
    if gate_up is not None:
        gate, up = gate_up(x).chunk(2, -1)
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return h + mlp.down_proj(F.silu(gate) * up)


def whole_layer(layer: nn.Module, heads: Heads, qkv: nn.Module | None = None,
                gate_up: nn.Module | None = None) -> tuple | None:
    """What ``fuzzyspec_layer.decoder_layer`` takes of a Llama-family decoder ``layer`` (its norms' weights and
    epsilons, its packed projections), to run it in one call in an eager float32 step: about 20 ops a layer through
    Python cost an eager 4-bit step of the embedded model about a third of its time. The call runs the kernels of
    ``decoder_layer``'s fused path in its order, so it gives the same numbers (tested). None unless its projections
    are all 4-bit or all 8-bit layers of our kernels without biases (``qkv``, ``gate_up``: fused ones; separate
    ones are packed side by side here), its norms RMSNorms with float32 weights (or no input norm, an EAGLE
    head's), and its attention ours."""
    attention, mlp = layer.self_attn, layer.mlp
    projections = (_packed_together([qkv] if qkv is not None else
                                    [attention.q_proj, attention.k_proj, attention.v_proj]),
                   _packed_together([attention.o_proj]),
                   _packed_together([gate_up] if gate_up is not None else [mlp.gate_proj, mlp.up_proj]),
                   _packed_together([mlp.down_proj]))
    norms = [_norm_of(layer.input_layernorm, absent=True), _norm_of(layer.post_attention_layernorm)]
    if (not heads.invariant or any(p is None for p in projections) or any(n is None for n in norms)
            or len({p.shape[2] for p in projections}) > 1):
        return None
    qkv_packed, o_packed, gate_up_packed, down_packed = projections
    return (*norms[0], qkv_packed, o_packed, *norms[1], gate_up_packed, down_packed)


def _packed_together(linears: list) -> Tensor | None:
    """The packed bytes of these layers' outputs side by side (one layer's own), or None unless they are all
    ``Int4Linear`` or all ``Int8Linear``, without biases, several only in whole groups of rows."""
    kinds = {type(linear) for linear in linears}
    if len(kinds) != 1 or not kinds <= {Int4Linear, Int8Linear} \
            or any(getattr(linear, "bias", None) is not None for linear in linears):
        return None
    if len(linears) == 1:
        return linears[0].packed
    if any(linear.out_features % ROWS for linear in linears):
        return None
    return torch.cat([linear.packed for linear in linears])


def _norm_of(norm: nn.Module, absent: bool = False) -> tuple[Tensor, float] | None:
    """An RMSNorm's float32 weight and epsilon; where ``absent`` is allowed, an ``nn.Identity`` (no norm) as an
    empty weight; else None."""
    if absent and isinstance(norm, nn.Identity):
        return torch.empty(0), 0.0
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dtype != torch.float32 or not hasattr(norm, "variance_epsilon"):
        return None
    return weight, norm.variance_epsilon


class LlamaForward(nn.Module):
    """One step of a Llama-family model, as a plain function of tensors over its own modules."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if model.get_input_embeddings().weight.device.type == "cuda":
            fuse_float_projections(model)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        # a tensor-parallel rank computes its share of the heads (its projections' slices)
        self.heads = Heads.of(model.config, model.get_input_embeddings().weight, shards(model))
        self.layer_count = len(self.decoder.layers)
        # fused projections where the loader made them (``int4.fuse``): one product for q, k and v, one for gate/up
        self.qkv = [getattr(layer.self_attn, "qkv_proj", None) for layer in self.decoder.layers]
        self.gate_up = [getattr(layer.mlp, "gate_up_proj", None) for layer in self.decoder.layers]
        # each layer in one call in eager float32 steps, where its weights allow (a 4-bit target's)
        wholes = [whole_layer(layer, self.heads, qkv, gate_up)
                  for layer, qkv, gate_up in zip(self.decoder.layers, self.qkv, self.gate_up)]
        self.whole = wholes if all(w is not None for w in wholes) else None
        # the same, all layers in one call (``fuzzyspec_layer.decoder_layers``): each of its arguments' list by layer
        self.stacked = [list(column) for column in zip(*wholes)] if self.whole is not None else None
        # and the final norm in that call, where it is an RMSNorm of float32 weights (its own call ran cold after the
        # layers' stream of weights); an empty weight: the norm is left to its own call
        self.final = _norm_of(self.decoder.norm) or (torch.empty(0), 0.0)
        # and the token embedding's lookup and the rotary angles' too, where the embedding is a plain table (float32 on
        # the CPU, seen at each pass) and the angles ours (``fuzzyspec_layer.embedded_layers``): two more operations,
        # each cold after a pass
        embed = self.decoder.embed_tokens
        self.lookup = type(embed) is nn.Embedding and embed.max_norm is None and isinstance(self.decoder.rotary_emb,
                                                                                             Rotary)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Llama-family decoders laid out as transformers' Llama (and with no sliding window in play)."""
        decoder = getattr(model, "model", None)
        return decoder is not None and hasattr(decoder, "layers") and llama_layers(model.config, decoder.layers)

    def forward(self, cache: StaticCache, tokens: Tensor, positions: Tensor, write: Tensor, mask: Tensor,
                slots: Tensor | None = None, keep: int = 0, features: tuple[int, ...] = ()
                ) -> tuple[Tensor, Features]:
        rows = tokens.shape[0]
        where = slots[:, None] if slots is not None else torch.arange(rows, device=tokens.device)[:, None] \
            if torch.compiler.is_compiling() else _row_slots(rows, tokens.device)
        found: Features = {}
        embedding = self.decoder.embed_tokens.weight
        angles = self.decoder.rotary_emb.table(torch.float32, cache.capacity) \
            if self.lookup and self.stacked is not None and _whole_calls(embedding, cache.keys[0]) and \
            all(i == self.layer_count for i in features) else None
        if angles is not None:  # (the whole pass but the LM head in one call)
            h = torch.ops.fuzzyspec_layer.embedded_layers(tokens, embedding, angles, positions, *self.stacked,
                                                          cache.keys, cache.values, where, write, mask,
                                                          self.heads.count, self.heads.kv, self.heads.dim ** -0.5,
                                                          *self.final)
            normed = self.final[0].numel() > 0
        else:
            h = self.decoder.embed_tokens(tokens)
            cos, sin = self.decoder.rotary_emb(h, positions)
            cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads in [B, k, heads, D]
            if self.whole is not None and self.stacked is not None and _whole_calls(h, cache.keys[0]) and all(
                    i in (0, self.layer_count) for i in features):  # (no inner layer's input asked for: one call)
                if 0 in features:
                    found[0] = h
                h = torch.ops.fuzzyspec_layer.decoder_layers(h, *self.stacked, cos, sin, cache.keys, cache.values,
                                                             where, write, mask, self.heads.count, self.heads.kv,
                                                             self.heads.dim ** -0.5, *self.final)
                normed = self.final[0].numel() > 0
            else:
                for i, layer in enumerate(self.decoder.layers):
                    if i in features:
                        found[i] = h
                    h = decoder_layer(layer, h, cos, sin, cache.keys[i], cache.values[i], where, write, mask, slots,
                                      self.heads, self.qkv[i], self.gate_up[i], self.whole and self.whole[i])
                normed = False
        if not normed:
            h = rms_norm(self.decoder.norm, h)
        if self.layer_count in features:
            found[self.layer_count] = h
        return self.lm_head(h[:, -keep:] if keep else h), found


@lru_cache(maxsize=64)
def _row_slots(rows: int, device: torch.device) -> Tensor:
    """[rows, 1]: row b's cache slot, b (kept, never written: two operations a step, each cold after a pass)."""
    return torch.arange(rows, device=device)[:, None]


def fuse_float_projections(model: nn.Module) -> None:
    """Give every decoder layer of a Llama-family ``model`` whose q, k and v (gate and up) are plain float layers
    without biases one product for them, ``self_attn.qkv_proj`` (``mlp.gate_up_proj``), which ``LlamaForward``
    calls instead, as ``int4.fuse_projections`` does for int4 layers. Done on a GPU, where a small model's step
    is bound by how many kernels it runs rather than by the bytes they read. The separate layers keep working
    (transformers' own forward calls them) on views of the fused weight, so the weights are held once. The fused
    layers are plain attributes, not submodules: the model's state dict keeps its keys (a self-draft copies layers
    by it). Layers fused already are left as they are."""
    for owner, name, linears in projection_groups(model):
        if hasattr(owner, name) or not all(type(m) is nn.Linear and m.bias is None for m in linears):
            continue
        trained = linears[0].weight.requires_grad
        weight = torch.cat([m.weight.detach() for m in linears])
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        fused.weight = nn.Parameter(weight, requires_grad=trained)
        start = 0
        for m in linears:
            m.weight = nn.Parameter(weight[start: start + m.out_features], requires_grad=trained)
            start += m.out_features
        object.__setattr__(owner, name, fused)


def make_forward(model: nn.Module, own: bool = True) -> nn.Module:
    """The forward for ``model``: our own for the Llama family (unless ``own`` is False), else transformers'."""
    if own and LlamaForward.supports(model):
        return LlamaForward(model)
    from .hf_forward import HFForward  # (imports transformers: a 4-bit target's answer does without it)

    return HFForward(model)


WIDTHS = (1, 2, 4, 6, 8, 12, 17, 24, 32, 48, 64)  # compiled widths: 1 (AR), gamma + 1 and tree sizes + 1 fit
# On a GPU a pass of a few tokens reads the same weights as one of a single token and costs about as much, so
# padding is cheap there, and every width is one more graph to compile and capture: fewer, coarser widths.
GPU_WIDTHS = (1, 6, 17, 32, 64)
MIN_CAPACITY = 256  # positions a new cache holds at least (it doubles when a row needs more)
# A compiled CPU step's graphs are made per cache capacity, and a first pass at a new one traces and compiles the
# target again, inside the answer, in every process: 8.2-8.6 s a width on the 2-core EPYC (inductor's kept code
# spares the C++ compiler, not the tracing and frozen weights' passes). A cache that starts at 256 positions
# doubled for 3 of the 64 everyday prompts (prompt + 128 tokens) and for a chat's later turns, stalling each width
# they used. Its capacity marked dynamic, one graph served every capacity, but a pass ran about 10% slower. A first
# capacity of 1024 passes as fast (3.38-3.56 ms at 1 token and 4.38-4.39 at 6 after 128 positions, at 256, 2048
# and 8192) and holds chats to 1024 positions without a compilation: 24 MB a row for the embedded model's float16
# cache (benchmarks/results_between_passes_epyc_2026-11-28.txt). Our own forward's CPU steps are kept graphs since
# (``core.kept``), one for every capacity; transformers' forward still compiles a graph per capacity.
COMPILED_CPU_CAPACITY = 1024
# Our own forward's compiled CPU steps are kept on disk and called without dynamo (``core.kept``); false: dynamo's
# graphs, with frozen weights, as before (``FUZZYSPEC_KEPT_STEPS=0``: to compare the two)
KEEPS = os.environ.get("FUZZYSPEC_KEPT_STEPS", "1") != "0"


class TargetStep:
    """The target and how its steps run: the forward (``make_forward``), eager, or compiled at a few fixed
    shapes (``compile``): a width is padded up to the next of ``widths`` and the rows to a power of two,
    so a handful of graphs serve every step. Prefills (prompts of any length) always run eagerly.

    On the CPU our own forward's graphs are compiled ahead and kept on disk (``core.kept``): once per machine, one
    for every cache capacity, called without dynamo. Such a call checks no guards, so its key holds everything
    else a graph depends on, and the cache's tensors are always whole tensors of their own (``StaticCache``).

    On a GPU a compiled step is also captured as CUDA graphs (``graphs``; ``core.graphs``, by our own hand): a
    small model's step is otherwise bound by launching its hundreds of kernels one by one from Python."""

    def __init__(self, model: nn.Module, compile: bool = False, own: bool = True,
                 widths: tuple[int, ...] | None = None, graphs: bool = True) -> None:
        self.model = model
        self.forward = make_forward(model, own)
        self.layer_count = model.config.num_hidden_layers
        self.shards = shards(model)
        if compile and self.shards > 1:
            raise ValueError("compiled steps of a tensor-parallel target are not supported yet: use --no-compile")
        on_gpu = model.get_input_embeddings().weight.device.type == "cuda"
        self.compile, self.widths = compile, widths or (GPU_WIDTHS if on_gpu else WIDTHS)
        self.graphs = compile and graphs and on_gpu
        self._compiled: Compiled | Kept | None = None
        self._shapes: set[tuple[int, ...]] = set()  # (rows, width, capacity) dynamo's graphs compiled so far
        self._every_layer = tuple(range(self.layer_count + 1))
        self.on_compile: Callable[[int, int], None] | None = None  # told (rows, width) before each compilation
        self.compiling = False  # whether the last call may have compiled (its time then is not a step's cost)
        # A server's: a call whose kept graph is not ready runs eagerly, and its graph compiles when the server is
        # idle (``compile_deferred``), so a batch size's first requests do not wait 15-50 s a graph for it
        self.defer = False
        self.deferred: dict[tuple, tuple] = {}  # call key -> (rows, width, the cache's slots and dtype, keep, modes)
        self.profile = Profile()  # what its steps (and its drafters') cost here, measured as they run
        self._spare: StaticCache | None = None  # the cache the last engine gave back (``borrow_cache``)
        self._lending = threading.Lock()
        weight = model.get_input_embeddings().weight
        # A target held at its GGUF's 4-bit bytes caches its keys and values in float16, as llama.cpp does by
        # default: a step reads every cached position's, and at a few hundred positions that is a sixth of what a
        # step of the embedded model reads (float32: 46 KB a position). Only our own forward with our attention
        # reads a float16 cache; every other keeps the weights' dtype.
        float16_cache = holds_blocks(model) and isinstance(self.forward, LlamaForward) and self.forward.heads.invariant
        self.cache_dtype = torch.float16 if float16_cache else weight.dtype

    @property
    def min_capacity(self) -> int:
        """The positions a new cache for these steps holds at least: ``COMPILED_CPU_CAPACITY`` for compiled steps on
        the CPU, else ``MIN_CAPACITY``."""
        on_cpu = self.model.get_input_embeddings().weight.device.type == "cpu"
        return COMPILED_CPU_CAPACITY if self.compile and on_cpu else MIN_CAPACITY

    def borrow_cache(self, slots: int, capacity: int) -> StaticCache:
        """An empty cache of ``slots`` rows of ``capacity`` positions for one engine: the one the last engine gave
        back (``give_back``) where it has that shape, else a new one. So one answer after another runs over the
        same tensors, which CUDA graphs are captured over: a new cache for each answer would capture them anew.
        Either way it keeps what the one given back held in its free slots (``StaticCache.held``)."""
        with self._lending:
            spare, self._spare = self._spare, None
        if spare is not None and (spare.slots, spare.capacity, spare.keys[0].dtype) == (slots, capacity,
                                                                                         self.cache_dtype):
            spare.clear()
            return spare
        weight = self.model.get_input_embeddings().weight
        cache = StaticCache.for_model(self.model.config, slots, capacity, self.cache_dtype, weight.device, self.shards)
        if spare is not None and spare.keys[0].dtype == self.cache_dtype:
            cache.take_held(spare)  # (what its free slots hold: a chat's next turn need not compute it again)
        return cache

    def give_back(self, cache: StaticCache) -> None:
        """``cache``, no longer used by the engine that borrowed it, for the next one."""
        with self._lending:
            self._spare = cache

    def shape(self, width: int, rows: int) -> tuple[int, int]:
        """The (width, rows) a step of this many tokens per row and rows runs at."""
        if not self.compile:
            return width, rows
        padded_rows = 1 << (rows - 1).bit_length()
        return next((w for w in self.widths if w >= width), width), padded_rows

    def __call__(self, cache: StaticCache, tokens: Tensor, positions: Tensor, write: Tensor, mask: Tensor,
                 slots: Tensor | None = None, keep: int = 0, features: tuple[int, ...] = (),
                 compiled: bool = False) -> tuple[Tensor, Features]:
        self.compiling = False
        if not (compiled and self.compile):
            return self.forward(cache, tokens, positions, write, mask, slots, keep, features)
        # Packed inputs: a graph is then chosen by the shapes and Python values in ``call`` alone.
        if write is positions:  # dynamo guards on aliasing too: a graph for one tensor would not serve two
            write = positions.clone()
        tokens, positions, write, mask = (packed(t) for t in (tokens, positions, write, mask))
        slots = packed(slots) if slots is not None else None
        runner = self._compiled_forward()
        kept = isinstance(runner, Kept)  # (then one graph serves every capacity, and every count of spare slots)
        capacity = None if kept else cache.capacity
        slots_in_cache = spare_slots(cache, tokens) if kept else cache.keys[0].shape[0]
        call = (tuple(tokens.shape), tuple(mask.shape[:3]), (slots_in_cache, cache.keys[0].shape[1]), capacity,
                cache.keys[0].shape[3], cache.keys[0].dtype, None if slots is None else tuple(slots.shape), keep,
                torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        new = not runner.ready(call) if kept else (*tokens.shape, capacity) not in self._shapes
        if new and kept and self.defer:
            self.deferred.setdefault(call, (*tokens.shape, cache.keys[0].shape[0], cache.keys[0].dtype, keep,
                                            torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
            self.compiling = True  # (an eager pass: its time is not a compiled step's)
            return self.forward(cache, tokens, positions, write, mask, slots, keep, features)
        if new and self.on_compile is not None:
            self.on_compile(*tokens.shape)
        if not kept:  # (a kept graph knows whether it is ready)
            self._shapes.add((*tokens.shape, capacity))
        # One graph per shape serves every row, whichever layers its drafter reads: the graph returns every
        # layer's hidden state (each exists anyway, as the residual stream) and the caller's are picked here.
        if kept:
            arguments = (self.forward, cache, tokens, positions, write, mask, slots, keep, self._every_layer)
        else:
            arguments = (cache, tokens, positions, write, mask, slots, keep, self._every_layer)
        try:
            logits, found = runner(call, *arguments)
        except NotKept:  # (warned) dynamo's graphs serve instead, for good
            self._compiled = Compiled(self.forward, cache.device, self.graphs)
            return self(cache, tokens, positions, write, mask, slots, keep, features, compiled)
        self.compiling = runner.compiling  # (then its time is not a step's)
        if self.graphs:  # a replay's outputs live in the graphs' memory, which the next replay overwrites
            return logits.clone(), {i: found[i].clone() for i in features}
        return logits, {i: found[i] for i in features}

    def compile_deferred(self) -> bool:
        """Compile (and keep) one graph that a deferred call (``defer``) asked for, from inputs of its shape: what
        a server does while idle. Returns whether there was one."""
        if not self.deferred:
            return False
        call, (rows, width, slots, dtype, keep, grad, inference) = next(iter(self.deferred.items()))
        device = self.model.get_input_embeddings().weight.device
        capacity = 64 + width  # (any: the capacity is a symbol of the graph)
        cache = StaticCache.for_model(self.model.config, slots, capacity, dtype, device)
        defer, self.defer = self.defer, False
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                starts = torch.zeros(rows, dtype=torch.long, device=device)
                tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
                positions = write_positions(starts, width)
                mask = attention_mask(starts, chain_tree(rows, width, device), capacity)
                self(cache, tokens, positions, positions.clone(), mask, None, keep, (), compiled=True)
        finally:
            self.defer = defer
            self.deferred.pop(call)
        return True

    def stop_deferring(self) -> None:
        """End deferring (``defer``) and forget the graphs it waits for: later new shapes compile as they occur."""
        self.defer = False
        self.deferred.clear()

    def _compiled_forward(self) -> "Compiled | Kept":
        """On the CPU, our own forward's steps compiled ahead and kept on disk (``core.kept``: once per machine, one
        graph for every capacity, called without dynamo); else dynamo's graphs (on a GPU, captured)."""
        if self._compiled is None:
            device = self.model.get_input_embeddings().weight.device
            if device.type == "cpu" and isinstance(self.forward, LlamaForward) and KEEPS:
                self._compiled = Kept(any_capacity_step, fingerprint(structure(self.model), "target step"),
                                      "the target's step", CPU_INDUCTOR, any_capacity)
            else:
                self._compiled = Compiled(self.forward, device, self.graphs)
        return self._compiled


def any_capacity(arguments: tuple) -> tuple:
    """``any_capacity_step``'s ``arguments`` as its graph is compiled from: the cache's tensors and the mask stood in
    for by ones whose capacity is marked dynamic (``kept.marked_like``), and the cache's slots too where it has more
    than the step's rows (a server's cache holds every row it has seated; the step runs over the first ones)."""
    forward, cache, tokens, positions, write, mask, *rest = arguments
    dims = (0, 2) if spare_slots(cache, tokens) else (2,)
    stand_in = copy.copy(cache)
    stand_in.keys = [marked_like(t, *dims) for t in cache.keys]
    stand_in.values = [marked_like(t, *dims) for t in cache.values]
    return (forward, stand_in, tokens, positions, write, marked_like(mask, 3), *rest)


def spare_slots(cache: StaticCache, tokens: Tensor) -> bool:
    """Whether the cache holds more rows than the step runs over: then one kept graph serves every number of them
    (their count a symbol), and another the cache of exactly the step's rows (there the layers' test of the two
    counts would pin the symbol, and dynamo pins a dimension of size 1 anyway)."""
    return cache.keys[0].shape[0] > tokens.shape[0]


def any_capacity_step(forward: LlamaForward, cache: StaticCache, tokens: Tensor, positions: Tensor, write: Tensor,
                      mask: Tensor, slots: Tensor | None, keep: int, features: tuple[int, ...]
                      ) -> tuple[Tensor, Features]:
    """``forward``'s step as ``Kept`` compiles it. The forward is an argument, not a closure, so a kept graph holds
    no model: the weights are read from the one passed. Every layer's cache capacity is told equal to the mask's:
    dynamo gives each dynamic dimension a symbol of its own, and with 61 of them a pass cost about 0.2 ms more (the
    symbols passed as tensors, one by one) than with one. So are the layers' slots, and there are more of them
    than the step's rows where they are a symbol (``spare_slots``)."""
    for tensor in (*cache.keys, *cache.values):
        torch._check(tensor.shape[2] == mask.shape[3])
        torch._check(tensor.shape[0] == cache.keys[0].shape[0])
    if spare_slots(cache, tokens):
        torch._check(cache.keys[0].shape[0] > tokens.shape[0])
    return forward(cache, tokens, positions, write, mask, slots, keep, features)


# How inductor builds a CPU step. Its wrapper, which calls a graph's kernels one after another, is C++ rather than
# Python (``cpp_wrapper``), and does not check the sizes and strides of what our kernels return (``size_asserts``:
# the inputs are checked by dynamo's guards, or by ``Compiled``'s key). A compiled 4-bit step of the embedded model
# calls about 150 of our kernels and 150 fused ones, and checked about 215 sizes: with both, compiled decoding on a
# 2-core EPYC ran 3-5% faster (AR 1.043-1.049x, the default job 1.026-1.036x; 2026-11-26). The price is compile
# time, about 20% more: each graph's wrapper goes through the C++ compiler too, once per machine (the code is kept).
CPU_INDUCTOR = {"cpp_wrapper": True, "size_asserts": False}


class Compiled:
    """``function`` compiled as steps are (the target's, an EAGLE head's): one graph per shape (``dynamic=False``;
    a caller may mark a dimension dynamic), on a GPU captured as CUDA graphs where ``graphs`` (``core.graphs``:
    captured by our own hand, replayed without dynamo; a caller copies what it keeps of the outputs before the
    next call, whose replay overwrites them)."""

    def __init__(self, function: Callable, device: torch.device, graphs: bool = False) -> None:
        import torch._dynamo.config as dynamo
        import torch._inductor.config as inductor

        # Frozen weights are constants to inductor: on the CPU it prepacks them for its GEMM kernels (on a
        # GPU it gains nothing there and copies every weight while compiling).
        if device.type == "cpu":
            inductor.freezing = True
        # One graph per shape and per model: dynamo's default of 8 graphs a function would silently run later
        # shapes eagerly (measured: a second model's widths 6 and 17 ran eager).
        dynamo.recompile_limit = max(dynamo.recompile_limit, 256)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
        # (caches' tensors are marked static, ``kvcache._static``: graphs write into them in place)
        options = CPU_INDUCTOR if device.type == "cpu" else None
        self.function = torch.compile(function, dynamic=False, options=options)
        self.graphs = Graphs() if graphs else None
        self.seen: set[tuple] = set()  # the keys of the calls run so far
        self.compiling = False  # whether the last call may have compiled a graph

    def __call__(self, key: tuple, *arguments):
        """The compiled function's result. ``key``: what tells this call's graph apart (shapes, dtypes, Python
        values). Checking all of dynamo's guards costs about 0.8 ms a call on a 30-layer target (its frozen
        weights); a call whose key was seen before checks only the guards that tell the graphs apart. Where those
        find no graph (something the key does not hold changed), dynamo refuses rather than guess, and the call
        runs fully checked."""
        if self.graphs is not None:
            result, self.compiling = self.graphs(key, partial(self.checked, key), arguments)
            return result
        self.compiling = key not in self.seen
        return self.checked(key, *arguments)

    def checked(self, key: tuple, *arguments):
        """The compiled function's result, never through a graph of this step's own (a call inside another
        capture, ``HeadStep``'s in a tree's growth), its guards checked as ``__call__`` says."""
        seen = key in self.seen
        self.seen.add(key)
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=seen):
                return self.function(*arguments)
        except RuntimeError as error:
            if not seen or "skip_guard_eval_unsafe" not in str(error):
                raise
            self.compiling = True
            return self.function(*arguments)


def packed(tensor: Tensor) -> Tensor:
    """``tensor`` with the strides of a fresh tensor of its shape. ``contiguous()`` is not enough: a [1, w] slice
    of a longer row counts as contiguous but keeps the row's stride, and dynamo guards on every stride, so a
    graph compiled for the slice (as ``tuning.prepare`` fed it) was compiled again for the engine's own inputs,
    inside a timed answer."""
    strides, size = [], 1
    for length in reversed(tensor.shape):
        strides.append(size)
        size *= length
    return tensor if tensor.stride() == tuple(reversed(strides)) else tensor.clone(memory_format=torch.contiguous_format)
