"""EAGLE draft heads (Li et al. 2024): the model, its checkpoints, and a chain drafter.

The head predicts the target's next feature (its last hidden state, after the
final norm) from the current feature and the next token:

    f_hat[j+1] = layer( fc([embed(s[j+1]) ; f[j]]) )        logits = lm_head(f_hat[j+1])

``fc`` is Linear(2H -> H); ``layer`` is one decoder layer of the target's family
whose input norm is dropped (the input is already a sum of normed features),
as in the EAGLE-1/2 releases. The embedding and LM head are the target's own,
frozen and not stored. Like the releases, no final norm is applied before the
LM head: the head regresses features that the target has already normed.

Checkpoints use the layout of the official releases (yuhuili/EAGLE-*): a folder
with ``config.json`` (the target family's config with one layer, plus ``bias``
for ``fc``) and weights ``fc.*`` and ``layers.0.*`` in ``model.safetensors``
(``pytorch_model.bin`` is read too; an ``embed_tokens.weight`` is ignored).
"""
from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from .drafters import Proposal, common_prefix, draft_chain
from .kvcache import crop_to
from .sampling import Sampling

_MASK_TAKES_CACHE_POSITION = "cache_position" in inspect.signature(create_causal_mask).parameters


def head_config(target_config: PretrainedConfig, bias: bool = True) -> PretrainedConfig:
    """The target's config cut to one layer: the config a head for that target is saved with."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    config.bias = bias
    config.architectures = ["LlamaForCausalLM"] if config.model_type == "llama" else config.architectures
    return config


class EagleHead(nn.Module):
    """fc over [token embedding ; feature], then one decoder layer; returns predicted features."""

    def __init__(self, config: PretrainedConfig, layer_class: type[nn.Module], rotary_class: type[nn.Module]) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=getattr(config, "bias", True))
        self.layers = nn.ModuleList([layer_class(config, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_class(config=config)

    @classmethod
    def for_target(cls, target: PreTrainedModel, config: PretrainedConfig | None = None) -> "EagleHead":
        """A head whose decoder layer is of the target's own family (Llama, Qwen2, Mistral, ...)."""
        decoder = target.get_decoder()
        head = cls(config or head_config(target.config), type(decoder.layers[0]), type(decoder.rotary_emb))
        return head.to(target.device)

    def forward(self, embeds: Tensor, features: Tensor, cache: DynamicCache | None = None) -> Tensor:
        """embeds, features: [B, T, H] for positions past, ..., past + T - 1 -> predicted features [B, T, H]."""
        hidden = self.fc(torch.cat([embeds, features], -1))
        past = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        extra = {"cache_position": positions[0]} if _MASK_TAKES_CACHE_POSITION else {}
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=cache, position_ids=positions, **extra)
        return self.layers[0](hidden, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=cache is not None, position_embeddings=self.rotary_emb(hidden, positions),
                              **extra)

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the EAGLE release layout."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.to_json_file(folder / "config.json")
        weights = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb")}
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def load_head(folder: str | Path, target: PreTrainedModel) -> EagleHead:
    """Load a head saved by ``EagleHead.save`` or an official EAGLE-1/2 release, for ``target``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no EAGLE head at {folder}: config.json is missing")
    raw = json.loads((folder / "config.json").read_text())
    config = AutoConfig.for_model(**raw) if "model_type" in raw else head_config(target.config)
    config.bias = raw.get("bias", True)
    config._attn_implementation = target.config._attn_implementation  # else the mask is built for no kernel
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(f"the EAGLE head at {folder} has hidden size {config.hidden_size}, "
                         f"the target {target.config.hidden_size}: it was trained for another target")
    if (folder / "model.safetensors").is_file():
        weights = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"no EAGLE head weights in {folder} (model.safetensors or pytorch_model.bin)")
    weights.pop("embed_tokens.weight", None)  # some releases store the target's embedding: ours is used
    head = EagleHead.for_target(target, config)
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"EAGLE head at {folder} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return head.to(dtype=target.dtype).eval()


class EagleDrafter:
    """Drafts a chain with an EAGLE head, fed the target's true features as they arrive.

    The loop hands it the target's last hidden states (``observe``) after each
    verification. Head positions computed from true features stay in its KV
    cache; those computed from its own predictions are recomputed next time.
    """

    wants_target_features = True

    def __init__(self, head: EagleHead, target: PreTrainedModel, vocab_size: int,
                 min_confidence: float = 0.0) -> None:
        self.head = head
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = vocab_size
        self.min_confidence = min_confidence
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.features: Tensor | None = None  # true target features of positions 0 .. F - 1
        self.tokens: Tensor | None = None  # the sequence those features belong to
        self.true_positions = 0  # head cache positions computed from true features and tokens

    def observe(self, start: int, features: Tensor) -> None:
        """True target features ([1, n, H]) of positions start .. start + n - 1."""
        known = self.features[:, :start] if self.features is not None else features[:, :0]
        self.features = torch.cat([known, features], 1)
        self.true_positions = min(self.true_positions, start)

    @torch.inference_mode()
    def propose(self, sequence: Tensor, num: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        if num < 1 or self.features is None:
            return Proposal.empty(sequence.shape[0], self.vocab_size, sequence.device)
        # Head position j reads token j + 1 and feature j: positions 0 .. F - 1, with F <= len - 1.
        count = min(self.features.shape[1], sequence.shape[1] - 1)
        if self.tokens is not None:
            self.true_positions = min(self.true_positions, common_prefix(self.tokens, sequence) - 1)
        kept = max(0, min(self.true_positions, count - 1))  # always feed at least one position
        crop_to(self.cache, kept)
        embeds = self.embed(sequence[:, kept + 1: count + 1])
        hidden = self.head(embeds, self.features[:, kept:count].to(embeds.dtype), self.cache)[:, -1:]
        self.forwards += 1
        self.true_positions, self.tokens = count, sequence

        def advance(token: Tensor) -> Tensor:
            nonlocal hidden
            hidden = self.head(self.embed(token), hidden, self.cache)
            self.forwards += 1
            return self._logits(hidden)

        return draft_chain(self._logits(hidden), advance, num, sampling, generator, self.min_confidence)

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden[:, -1]).float()[:, : self.vocab_size]
