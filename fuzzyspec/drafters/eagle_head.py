"""EAGLE-1/2 draft heads (Li et al. 2024): the model and its checkpoints.

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
A reduced draft vocabulary (``d2t``/``t2d`` beside the weights, as EAGLE-3 stores
them) makes the drafter read only those rows of the target's LM head.
The drafter that drives this head (and EAGLE-3's) is ``eagle.EagleDrafter``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..core.kvcache import DraftCache, cache_keyword, model_mask
from ..core.llama import causal_mask
from ..core.vocab import DraftVocab
from .draftlm import config_like, cut_layers, no_random_start

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PretrainedConfig, PreTrainedModel


def head_config(target_config: PretrainedConfig, bias: bool = True) -> PretrainedConfig:
    """The target's config cut to one layer: the config a head for that target is saved with."""
    config = cut_layers(target_config, [0])
    config.bias = bias
    config.architectures = ["LlamaForCausalLM"] if config.model_type == "llama" else config.architectures
    return config


class EagleHead(nn.Module):
    """fc over [token embedding ; feature], then one decoder layer; returns predicted features."""

    feature_layers = [-1]  # it reads the target's last hidden state (after the final norm)

    def __init__(self, config: PretrainedConfig, layer_class: type[nn.Module], rotary_class: type[nn.Module]) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=getattr(config, "bias", True))
        self.layers = nn.ModuleList([layer_class(config, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_class(config=config)
        self.cache_keyword = cache_keyword(layer_class.forward)
        self.vocab: DraftVocab | None = None  # a reduced draft vocabulary: the target's LM head rows it reads

    @classmethod
    def for_target(cls, target: PreTrainedModel, config: PretrainedConfig | None = None) -> "EagleHead":
        """A head whose decoder layer is of the target's own family (Llama, Qwen2, Mistral, ...)."""
        decoder = target.get_decoder()
        head = cls(config or head_config(target.config), type(decoder.layers[0]), type(decoder.rotary_emb))
        return head.to(target.device)

    def forward(self, embeds: Tensor, features: Tensor, cache: DraftCache | None = None,
                mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """embeds, features: [B, T, H] -> predicted features [B, T, H]. By default the T inputs
        sit at positions past .. past + T - 1 after the cache, causally; a draft tree passes its own
        4D ``mask`` (True: may attend) and ``positions`` ([B, T])."""
        hidden = self.fc(torch.cat([embeds, features], -1))
        past = cache.get_seq_length() if cache is not None else 0
        width = hidden.shape[1]
        if positions is None:
            positions = torch.arange(past, past + width, device=hidden.device).unsqueeze(0)
        if mask is None:  # causal after the whole cache
            mask = causal_mask(width, past + width, hidden.device)
        return self.layers[0](hidden, attention_mask=model_mask(self, mask), position_ids=positions,
                              **{self.cache_keyword: cache}, use_cache=cache is not None,
                              position_embeddings=self.rotary_emb(hidden, positions))

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the EAGLE release layout."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.to_json_file(folder / "config.json")
        weights = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb")}
        if self.vocab is not None:
            weights.update(self.vocab.maps())
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def load_head(folder: str | Path, target: PreTrainedModel) -> EagleHead:
    """Load a head saved by ``EagleHead.save`` or an official EAGLE-1/2 release, for ``target``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no EAGLE head at {folder}: config.json is missing")
    raw = json.loads((folder / "config.json").read_text())
    config = config_like(raw, target.config) if "model_type" in raw else head_config(target.config)
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
    vocab = DraftVocab.from_maps(weights.pop("d2t"), weights.pop("t2d", None)) if "d2t" in weights else None
    with no_random_start():  # every weight is loaded below (a missing one is refused): a random start is waste
        head = EagleHead.for_target(target, config)
    head.vocab = vocab
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"EAGLE head at {folder} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return head.to(dtype=target.dtype).eval()
