"""Small draft LMs that share the target's embedding and LM head.

A draft of this kind is a causal LM of the target's family with a few decoder
layers of its own; its token embedding and LM head are the target's, frozen,
so only the layers and the final norm are stored (a few MB). Its folder holds
``config.json`` (the target family's config with ``num_hidden_layers`` cut and a
``fuzzyspec_shares`` entry naming the shared parts) and ``model.safetensors``.

With a reduced draft vocabulary (``vocab.DraftVocab``; ``draft_vocab_size`` in
the config, ``d2t``/``t2d`` maps beside the weights) the LM head is the
target's rows for those N tokens only, so a draft step reads N rows, not V.
"""
from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from safetensors.torch import load_file, save_file

from ..core.vocab import DraftVocab, reduced_lm_head
from ..train.config import trained_length

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PretrainedConfig, PreTrainedModel

SHARED = ("embed_tokens", "lm_head")


@dataclass
class DraftLM:
    """A draft LM and the id map of its LM head: ``vocab`` is None when the head covers the target's whole
    vocabulary, else the N tokens whose target rows it holds."""

    model: PreTrainedModel
    vocab: DraftVocab | None = None
    window: int | None = None  # the positions it reads at most: what it trained on (``trained_length``)

    @property
    def width(self) -> int:
        """Logit columns over the target's vocabulary this draft can speak for."""
        return self.vocab.target_size if self.vocab is not None else self.model.get_output_embeddings().weight.shape[0]


def is_shared_draft(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    return config.is_file() and "fuzzyspec_shares" in json.loads(config.read_text())


def cut_layers(config: PretrainedConfig, layers: list[int]) -> PretrainedConfig:
    """A copy of a model's config keeping only the decoder layers numbered ``layers``."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    return config


def config_like(raw: dict, target_config: PretrainedConfig) -> PretrainedConfig:
    """The config a saved ``config.json``'s fields (``raw``, with a ``model_type``) describe: of the target's own
    config class where the model types agree (so a target of ``core.llama``'s modules needs none of transformers'
    Llama classes), else of the class transformers registers for that type."""
    fields = {key: value for key, value in raw.items() if key != "model_type"}
    if raw["model_type"] == target_config.model_type:
        return type(target_config)(**fields)
    from transformers import AutoConfig

    return AutoConfig.for_model(raw["model_type"], **fields)


# torch's initialisers, which new layers call for their random start (nn.Linear, nn.Embedding and the like)
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                "xavier_normal_", "orthogonal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def no_random_start() -> Iterator[None]:
    """Layers made meanwhile skip their random start (torch's initialisers leave a tensor as it is), for a loader
    that fills every weight: an EAGLE head's 8 layers took 41 ms to start randomly on a 2-core EPYC, the drafter's
    largest load cost after its LM head rows. As transformers' ``no_init_weights`` does for its own layers, without
    importing its model code (seconds, ``core.llama``). Process-wide while it lasts: only loaders use it."""
    saved = {name: getattr(torch.nn.init, name) for name in INITIALISERS}
    for name in saved:
        setattr(torch.nn.init, name, _as_it_is)
    try:
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(torch.nn.init, name, initialiser)


def _as_it_is(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return tensor


def make_draft_lm(target: PreTrainedModel, num_layers: int, init_layers: list[int] | None = None,
                  vocab: DraftVocab | None = None) -> DraftLM:
    """A draft with ``num_layers`` layers copied from the target (its first ones, or ``init_layers``),
    a copy of its final norm, and the target's own embedding and LM head (shared, frozen; cut to
    ``vocab``'s rows when given)."""
    source = init_layers if init_layers is not None else list(range(num_layers))
    if len(source) != num_layers or not all(0 <= i < target.config.num_hidden_layers for i in source):
        raise ValueError(f"init_layers must name {num_layers} of the target's {target.config.num_hidden_layers} layers")
    config = cut_layers(target.config, source)
    config.fuzzyspec_shares = list(SHARED)
    config.tie_word_embeddings = False
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype).to(target.device)
    decoder, target_decoder = draft.get_decoder(), target.get_decoder()
    for mine, theirs in zip(decoder.layers, source):
        mine.load_state_dict(target_decoder.layers[theirs].state_dict())
    decoder.norm.load_state_dict(target_decoder.norm.state_dict())
    if vocab is not None:
        draft.config.draft_vocab_size = len(vocab)
    _share(draft, target, vocab)
    return DraftLM(draft, vocab)


def _share(draft: PreTrainedModel, target: PreTrainedModel, vocab: DraftVocab | None = None) -> None:
    draft.set_input_embeddings(target.get_input_embeddings())
    if vocab is None:
        draft.set_output_embeddings(target.get_output_embeddings())
    else:
        draft.set_output_embeddings(reduced_lm_head(target.get_output_embeddings(), vocab))


def own_weights(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's stored weights: everything but the shared embedding and LM head."""
    return {k: v for k, v in draft.state_dict().items()
            if not any(part in k for part in SHARED) and "rotary_emb" not in k}


def save_draft_lm(draft: DraftLM, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(draft.model.config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.to_json_file(folder / "config.json")
    weights = {k: v.detach().to(dtype).contiguous() for k, v in own_weights(draft.model).items()}
    if draft.vocab is not None:
        weights.update(draft.vocab.maps())
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def load_draft_lm(folder: str | Path, target: PreTrainedModel) -> DraftLM:
    """Load a shared-weight draft saved by ``save_draft_lm`` for ``target``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    if config.hidden_size != target.config.hidden_size or config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft at {folder} was made for another target "
                         f"(hidden {config.hidden_size}, vocab {config.vocab_size})")
    config._attn_implementation = target.config._attn_implementation
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    weights = load_file(folder / "model.safetensors")
    vocab = DraftVocab.from_maps(weights.pop("d2t"), weights.pop("t2d", None)) if "d2t" in weights else None
    if vocab is not None and vocab.target_size != config.vocab_size:
        raise ValueError(f"the draft at {folder} maps into {vocab.target_size} tokens, its config says {config.vocab_size}")
    draft.load_state_dict({k: v.to(target.device, target.dtype) for k, v in weights.items()}, strict=False,
                          assign=True)
    vocab = vocab.to(target.device) if vocab is not None else None
    _share(draft, target, vocab)
    rotary = draft.get_decoder().rotary_emb  # its buffers were made on the meta device: rebuild them
    draft.get_decoder().rotary_emb = type(rotary)(config=config).to(target.device)
    missing = [name for name, p in draft.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the draft at {folder} lacks weights: {', '.join(missing[:3])}")
    return DraftLM(draft.eval(), vocab, trained_length(folder))


def self_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A draft made of the target's first ``num_layers`` decoder layers, final norm and LM head.

    Shares every weight with the target (nothing is copied). Needs no training,
    so it is a weak draft: it agrees with the target far less than a trained one.
    """
    layers = target.model.layers
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"a self draft needs between 1 and {len(layers) - 1} layers, got {num_layers}")
    config = cut_layers(target.config, list(range(num_layers)))
    with torch.device("meta"):
        draft = type(target)(config)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(layers[:num_layers])
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    draft.generation_config = target.generation_config
    return draft.eval()
