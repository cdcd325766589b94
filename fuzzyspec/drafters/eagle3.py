"""EAGLE-3 draft heads (Li et al. 2025): token prediction from fused low, middle and high-layer features.

The head reads the target's hidden states at three depths (by default the inputs
of layers 2, L/2 and L-3: ``feature_layers``), projects their concatenation to
H with ``fc``, and runs one decoder layer whose attention sees the next token's
embedding beside that feature::

    h0   = fc([f_low ; f_mid ; f_high])                         (true target features)
    x    = [input_norm(embed(s[j+1])) ; hidden_norm(h)]          (2H wide)
    h'   = h + attn(x);  out = h' + mlp(post_norm(h'))
    logits over the draft vocabulary = lm_head(norm(out))

When drafting runs ahead of the target, the head's own ``out`` stands in for the
feature of the next position (no ``fc``: it is already H wide). Training unrolls
exactly that ("training-time test", see ``train.Eagle3Objective``) so later
draft positions do not decay.

The LM head covers a reduced draft vocabulary (``vocab.DraftVocab``). It is
either trained and stored (the EAGLE-3 releases), or the target's own LM head
rows for those tokens, frozen and not stored (``fuzzyspec_lm_head: "target"``
in the config; a much smaller file).

Checkpoint layout, as in the EAGLE-3 releases: ``config.json`` (the target
family's config with one layer, ``draft_vocab_size``, and the feature layer ids
in ``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors``
with ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``d2t``, ``t2d`` and, when
trained, ``lm_head.weight``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .draftlm import config_like, cut_layers, no_random_start
from ..core.kvcache import DraftCache
from ..core.llama import MLP, RMSNorm, causal_mask, rotate
from ..core.vocab import DraftVocab, reduced_lm_head

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PretrainedConfig, PreTrainedModel

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_feature_layers(num_layers: int) -> list[int]:
    """Inputs of layers 2, L/2 and L-3 (indices into the target's ``hidden_states``), as EAGLE-3 picks them."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def is_eagle3(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return ARCHITECTURE in (raw.get("architectures") or []) or "draft_vocab_size" in raw


class Attention(nn.Module):
    """Multi-head attention whose queries, keys and values read a 2H-wide input."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [B, heads, T, d], keys and values [B, kv_heads, T, d]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # over the heads of [B, heads, T, d]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """softmax(q k^T / sqrt(d)) v over the keys ``allowed`` ([B or 1, 1, T, S] bool) -> [B, T, H]."""
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MidLayer(nn.Module):
    """The head's one decoder layer: attention over [embedding ; feature], then an MLP."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def inputs(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)

    def finish(self, hidden: Tensor, attended: Tensor) -> Tensor:
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """fc over fused target features, one decoder layer, a norm and a reduced-vocabulary LM head."""

    def __init__(self, config: PretrainedConfig, vocab: DraftVocab, rotary_class: type[nn.Module],
                 lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.feature_layers = list(config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(hidden, getattr(config, "rms_norm_eps", 1e-6))
        self.lm_head = lm_head if lm_head is not None else nn.Linear(hidden, len(vocab), bias=False)
        self.vocab = vocab
        self.rotary_emb = rotary_class(config=config)

    @property
    def stores_lm_head(self) -> bool:
        return getattr(self.config, "fuzzyspec_lm_head", "trained") != "target"

    def _rope(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.rotary_emb(hidden, positions)
        return cos.to(hidden.dtype), sin.to(hidden.dtype)

    def lift(self, features: Tensor) -> Tensor:
        """Fused target features ([.., len(feature_layers) * H]) to the head's width; own outputs pass."""
        return self.fc(features) if features.shape[-1] != self.config.hidden_size else features

    def forward(self, embeds: Tensor, features: Tensor, cache: DraftCache | None = None,
                mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """embeds [B, T, H]; features [B, T, 3H] (the target's) or [B, T, H] (the head's own outputs).
        Returns the layer's outputs [B, T, H] (``logits`` turns them into draft logits). By default the
        T inputs sit at positions past .. past + T - 1 after the cache, causally; a draft tree passes
        its own 4D ``mask`` ([B, 1, T, past + T], True: may attend) and ``positions`` ([B, T])."""
        hidden = self.lift(features)
        b, t, _ = hidden.shape
        past = cache.get_seq_length() if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + t, device=hidden.device).unsqueeze(0).expand(b, -1)
        if mask is None:
            mask = causal_mask(t, past + t, hidden.device)
        layer = self.midlayer
        q, k, v = layer.self_attn.project(layer.inputs(embeds, hidden), *self._rope(hidden, positions))
        if cache is not None:
            k, v = cache.update(k, v, 0)
        return layer.finish(hidden, layer.self_attn.attend(q, k, v, mask))

    def logits(self, out: Tensor) -> Tensor:
        """Draft-vocabulary logits [..., N] of layer outputs [..., H], in float32."""
        return self.lm_head(self.norm(out)).float()

    def unroll(self, embeds: Tensor, features: Tensor, steps: int) -> list[Tensor]:
        """Training-time test: the head run ``steps`` times over a whole sequence, each time on its own
        previous outputs, as drafting would run it.

        embeds [B, T, H] are the embeddings of tokens 1 .. T (token j + 1 at index j) and features
        [B, T, 3H] the target's at positions 0 .. T - 1. Step 0 at index j reads (token j+1, feature j)
        and attends causally to step 0 at indices <= j: it predicts token j + 2. Step s at index j reads
        token j + s + 1 (the caller shifts ``embeds``: entry s of the list below) and the step s - 1
        output at j, sits at position j + s, and attends to step 0 at indices <= j and to its own index
        at steps 1 .. s: what a drafting cache holds s tokens past the last true feature. It predicts
        token j + s + 2. Returns each step's outputs [B, T, H].
        """
        b, t, _ = embeds.shape
        device = embeds.device
        layer = self.midlayer
        hidden = self.fc(features)
        base = torch.arange(t, device=device).unsqueeze(0).expand(b, -1)
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        diagonal = torch.eye(t, dtype=torch.bool, device=device)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        outputs = []
        for step in range(steps):
            token_embeds = torch.cat([embeds[:, step:], embeds.new_zeros(b, step, embeds.shape[-1])], 1)
            q, k, v = layer.self_attn.project(layer.inputs(token_embeds, hidden), *self._rope(hidden, base + step))
            keys.append(k)
            values.append(v)
            allowed = torch.cat([causal] + [diagonal] * step, 1)[None, None]
            hidden = layer.finish(hidden, layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), allowed))
            outputs.append(hidden)
        return outputs

    def save(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the EAGLE-3 release layout."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.to_json_file(folder / "config.json")
        weights = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()
                   if not k.startswith("rotary_emb") and (self.stores_lm_head or not k.startswith("lm_head"))}
        weights.update(self.vocab.maps())
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def eagle3_config(target_config: PretrainedConfig, draft_vocab_size: int, feature_layers: list[int] | None = None,
                  lm_head: str = "target") -> PretrainedConfig:
    """The config an EAGLE-3 head for this target is saved with."""
    layers = feature_layers or default_feature_layers(target_config.num_hidden_layers)
    if not all(0 <= i <= target_config.num_hidden_layers for i in layers):
        raise ValueError(f"feature layers must be between 0 and {target_config.num_hidden_layers}, got {layers}")
    config = cut_layers(target_config, [0])
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = draft_vocab_size
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    config.fuzzyspec_lm_head = lm_head
    config.tie_word_embeddings = False
    return config


def make_eagle3(target: PreTrainedModel, vocab: DraftVocab, feature_layers: list[int] | None = None,
                train_lm_head: bool = False) -> Eagle3Head:
    """A new head for ``target``: random layer and ``fc``; the norm and LM head start as the target's
    final norm and its LM head rows for the draft vocabulary."""
    config = eagle3_config(target.config, len(vocab), feature_layers, "trained" if train_lm_head else "target")
    head = _build(config, vocab, target)
    head.norm.weight.data.copy_(target.get_decoder().norm.weight.data.float())
    return head.to(target.device)


def _build(config: PretrainedConfig, vocab: DraftVocab, target: PreTrainedModel) -> Eagle3Head:
    rotary = type(target.get_decoder().rotary_emb)
    frozen = getattr(config, "fuzzyspec_lm_head", "trained") == "target"
    lm_head = reduced_lm_head(target.get_output_embeddings(), vocab) if frozen else None
    head = Eagle3Head(config, vocab, rotary, lm_head)
    if lm_head is not None:
        head.lm_head = lm_head  # frozen, kept in the target's dtype
    return head


def load_eagle3(folder: str | Path, target: PreTrainedModel) -> Eagle3Head:
    """Load a head saved by ``Eagle3Head.save`` or an EAGLE-3 release, for ``target``."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    config = config_like(raw, target.config) if "model_type" in raw else cut_layers(target.config, [0])
    for key, value in raw.items():  # the EAGLE-3 fields AutoConfig does not know
        setattr(config, key, value)
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(f"the EAGLE-3 head at {folder} has hidden size {config.hidden_size}, "
                         f"the target {target.config.hidden_size}: it was trained for another target")
    if not getattr(config, "eagle_config", None) or "eagle_aux_hidden_state_layer_ids" not in config.eagle_config:
        config.eagle_config = {"eagle_aux_hidden_state_layer_ids":
                               default_feature_layers(target.config.num_hidden_layers)}
    path = folder / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"no EAGLE-3 head weights in {folder} (model.safetensors)")
    weights = load_file(path)
    if "d2t" in weights:
        vocab = DraftVocab.from_maps(weights.pop("d2t"), weights.pop("t2d", None))
    else:  # a head over the whole vocabulary
        weights.pop("t2d", None)
        vocab = DraftVocab(torch.arange(target.config.vocab_size), target.config.vocab_size)
    if vocab.target_size != target.get_output_embeddings().weight.shape[0] and vocab.target_size != target.config.vocab_size:
        raise ValueError(f"the EAGLE-3 head at {folder} maps into {vocab.target_size} target tokens, the target has "
                         f"{target.config.vocab_size}: it was trained for another target")
    weights.pop("embed_tokens.weight", None)  # some releases store the target's embedding: ours is used
    with no_random_start():  # every weight is loaded below (a missing one is refused): a random start is waste
        head = _build(config, vocab, target)
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb") and not (k.startswith("lm_head") and
                                                                             not head.stores_lm_head)]
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 head at {folder} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    head = head.to(device=target.device, dtype=target.dtype).eval()
    head.vocab = vocab.to(target.device)
    return head
