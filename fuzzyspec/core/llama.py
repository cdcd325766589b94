"""A Llama-family causal LM built from our own modules, for a GGUF target held at its 4-bit bytes.

Its modules carry transformers' names and layout (``model.layers[i].self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ``model.rotary_emb``, ``lm_head``, ...), so our step (``core.step``), an EAGLE head built
for it (``drafters.eagle_head``, which takes its decoder layer's class) and a state dict read it as they read
transformers' ``LlamaForCausalLM``, and its forward computes what that model's does (tested against it).

Why not transformers' own classes: importing them is most of a short answer's time. On a 2-core AVX2 EPYC
(transformers 5.24), ``LlamaConfig`` pulled in ``torch.distributed.tensor`` through its validators (1.9 s),
``transformers.generation.utils`` ``torch._dynamo`` (0.8 s) and ``transformers.modeling_utils`` 0.7 s more: 3.4 s
of the README's main command's 7.5. Its config too is a plain object (``LlamaLikeConfig``), as is the tokenizer's
reader (``fuzzyspec.tokenizer``), so such an answer imports nothing of transformers. Float targets, training and every
other model still go through transformers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LlamaLikeConfig:
    """The fields of transformers' ``LlamaConfig`` that a Llama-family model's modules read (same names and
    defaults), as a plain object: importing transformers itself (its package alone, to reach ``PretrainedConfig``)
    took 0.75 s of the README's main command's 3.3 s (2-core AVX2 EPYC, 2026-11-29). Other fields given are kept as
    attributes, as transformers' configs keep them (an EAGLE head's config.json carries its own); saved
    (``to_json_file``), it reads back as a ``LlamaConfig``."""

    model_type = "llama"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, hidden_act: str = "silu", max_position_embeddings: int = 2048,
                 rms_norm_eps: float = 1e-6, attention_bias: bool = False, attention_dropout: float = 0.0,
                 mlp_bias: bool = False, tie_word_embeddings: bool = False, rope_parameters: dict | None = None,
                 **kwargs: Any) -> None:
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act, self.max_position_embeddings, self.rms_norm_eps = hidden_act, max_position_embeddings, rms_norm_eps
        self.attention_bias, self.attention_dropout, self.mlp_bias = attention_bias, attention_dropout, mlp_bias
        self.tie_word_embeddings = tie_word_embeddings
        if rope_parameters is None:  # (the older fields: a theta, and a scaling whose type Rotary checks)
            scaling = kwargs.pop("rope_scaling", None) or {}
            rope_parameters = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                               "rope_theta": kwargs.pop("rope_theta", 10000.0)}
        self.rope_parameters = dict(rope_parameters)
        self._attn_implementation = kwargs.pop("attn_implementation", None) or "sdpa"
        kwargs.pop("_attn_implementation", None)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """Its fields as transformers writes a config's (dtypes by name), with its ``model_type``."""
        fields = {name: str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
                  for name, value in vars(self).items() if not name.startswith("_")}
        return {**fields, "model_type": self.model_type}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json_string())


@dataclass
class GenerationDefaults:
    """The special tokens transformers' ``GenerationConfig.from_model_config`` takes from a config: what callers here
    read of a model's ``generation_config`` (its EOS ids, ``api.eos_token_ids``)."""

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def of(cls, config: LlamaLikeConfig) -> "GenerationDefaults":
        return cls(*(getattr(config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")))


def normed(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight along the last dimension, in float32 and cast back before the weight (as transformers'
    ``LlamaRMSNorm``)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return normed(x, self.weight, self.variance_epsilon)


TABLE_LIMIT = 65_536  # positions a rotary table holds at most: 2 x 65,536 x D floats (32 MB at D = 64)


class Rotary(nn.Module):
    """cos and sin [B, T, D] of each position's rotary angles (the default rope: theta ** (-2i / D))."""

    def __init__(self, config: LlamaLikeConfig) -> None:
        super().__init__()
        parameters = config.rope_parameters
        if parameters.get("rope_type", "default") != "default":
            raise ValueError(f"rope type {parameters['rope_type']!r} is not implemented here (only the default)")
        dim = config.head_dim
        # on the CPU whatever the default device: made on the meta device, an arange imports torch._dynamo (0.8 s)
        steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
        inv_freq = 1.0 / (parameters["rope_theta"] ** (steps / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._tables: dict[torch.dtype, Tensor] = {}  # dtype -> [2, positions, D]: each position's cos and sin

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self._looked_up(x.dtype, positions)
        return self.angles(x.dtype, positions)

    def angles(self, dtype: torch.dtype, positions: Tensor) -> tuple[Tensor, Tensor]:
        angles = positions[..., None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _looked_up(self, dtype: torch.dtype, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``angles``, read from a table of every position so far that ``angles`` made (element by element: a
        position's values do not depend on the others made with it, so they are the same bits). One lookup where
        ``angles`` made five operations, each run cold after a target pass (93 us of a 4-bit step on a 2-core AVX2
        EPYC); cos and sin come out contiguous, as the kernels read them. The table doubles when a position outgrows
        it, up to ``TABLE_LIMIT`` positions; a position past that, or below 0, is computed."""
        table, flat = self._tables.get(dtype), positions.reshape(-1)
        try:
            if table is None:
                raise IndexError
            rows = table.index_select(1, flat)
        except (IndexError, RuntimeError):  # (a position past the table, or none yet: index_select says so)
            if flat.numel() == 0 or int(flat.min()) < 0 or int(flat.max()) >= TABLE_LIMIT:
                return self.angles(dtype, positions)
            rows = self.table(dtype, int(flat.max()) + 1).index_select(1, flat)
        rows = rows.view(2, *positions.shape, rows.shape[-1])
        return rows[0], rows[1]

    def table(self, dtype: torch.dtype, size: int) -> Tensor | None:
        """[2, P, D]: the cos and sin of positions 0 .. P - 1 (P >= ``size``), as ``angles`` makes them, on the CPU;
        grown by doubling; None past ``TABLE_LIMIT`` positions."""
        table = self._tables.get(dtype)
        if table is not None and table.shape[1] >= size:
            return table
        if size > TABLE_LIMIT:
            return None
        size = min(TABLE_LIMIT, max(256, 2 * (0 if table is None else table.shape[1]), size))
        table = self._tables[dtype] = torch.stack(self.angles(dtype, torch.arange(size, device="cpu")))
        return table


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., D] turned by its position's angles (cos, sin broadcast to x), the two halves of D paired."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaLikeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        heads, kv, hidden, bias = (config.num_attention_heads, config.num_key_value_heads, config.hidden_size,
                                   config.attention_bias)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)

    def forward(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor], mask: Tensor | None,
                cache=None) -> Tensor:
        """``mask`` [B, 1, T, past + T], bool (True: may attend) or added to the scores; None: causal."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (projection(x).view(shape).transpose(1, 2) for projection in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = (t[:, None] for t in position_embeddings)  # over the heads of [B, heads, T, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        causal = mask is None and q.shape[2] > 1 and q.shape[2] == k.shape[2]
        if mask is None and not causal and q.shape[2] > 1:  # new tokens after a cache: causal over the last T
            mask = causal_mask(q.shape[2], k.shape[2], x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One decoder layer, called as transformers calls its own (``cache``, ``position_embeddings``, a 4D
    ``attention_mask``): an EAGLE head built for this model takes it as its layer."""

    def __init__(self, config: LlamaLikeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                cache=None, use_cache: bool = False, position_embeddings: tuple[Tensor, Tensor] | None = None,
                **_) -> Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                           cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def causal_mask(width: int, length: int, device: torch.device) -> Tensor:
    """[1, 1, width, length] bool: the last ``width`` of ``length`` positions each see every position up to its own."""
    return torch.ones(width, length, dtype=torch.bool, device=device).tril(length - width)[None, None]


class Decoder(nn.Module):
    def __init__(self, config: LlamaLikeConfig) -> None:
        super().__init__()
        # left unset (torch.empty): a loader fills every weight, and torch's normal initialiser, run on the meta
        # device, imports torch._dynamo (0.8 s)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config)


@dataclass
class Output:
    """What transformers' causal LMs return, as far as callers here read it."""

    logits: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    past_key_values: object = None


class LlamaLM(nn.Module):
    """A Llama-family causal LM (see the module docstring), with the parts of transformers' ``PreTrainedModel``
    that callers here use: ``config``, ``generation_config``, ``device``, ``dtype``, the embedding accessors and
    ``forward``."""

    def __init__(self, config: LlamaLikeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.generation_config = GenerationDefaults.of(config)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                cache=None, past_key_values=None, use_cache: bool = False, logits_to_keep: int = 0,
                output_hidden_states: bool = False, **_) -> Output:
        """Logits of ``input_ids`` [B, T] after ``cache`` (a transformers cache, or None). ``attention_mask``:
        [B, past + T] (1: a real token) or a 4D mask passed through; ``logits_to_keep``: only the last that many
        (0: all). ``output_hidden_states``: each layer's input, then the final normed output."""
        cache = cache if cache is not None else past_key_values
        past = cache.get_seq_length() if cache is not None else 0
        width = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + width, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:  # causal, never to a pad; a pad sees itself (a row of none is NaN)
            query = torch.arange(past, past + width, device=mask.device)[:, None]
            key = torch.arange(past + width, device=mask.device)
            mask = (key <= query) & (mask.bool()[:, None, None, :] | (key == query))
        h = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary_emb(h, position_ids)
        hidden = []
        for layer in self.model.layers:
            hidden.append(h)
            h = layer(h, attention_mask=mask, cache=cache, position_embeddings=rotary)
        h = self.model.norm(h)
        hidden.append(h)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return Output(logits, tuple(hidden) if output_hidden_states else None, cache if use_cache else None)
