"""The plain Python API: a target, its tokenizer and a draft, ready to generate text."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .core.decoding import DecodeConfig, decode
from .drafters import Drafter
from .hf import eos_token_ids
from .loading import load_model, shared_vocab_size
from .options import DEFAULT_JOB
from .registry import DEFAULT_DRAFT, DrafterSource, load_drafter
from .core.sampling import Sampling
from .core.stats import Stats
from .text import TextStream

SAMPLING_KEYS = {f.name for f in dataclasses.fields(Sampling)}


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def make_config(**options: Any) -> DecodeConfig:
    """A DecodeConfig from flat keyword options; ``temperature``, ``top_k``, ``top_p`` go to its Sampling."""
    sampling = {k: options.pop(k) for k in list(options) if k in SAMPLING_KEYS}
    unknown = set(options) - {f.name for f in dataclasses.fields(DecodeConfig)}
    if unknown:
        raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
    return DecodeConfig(sampling=Sampling(**sampling), **options)


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The model's generation-config EOS ids and the tokenizer's EOS token."""
    ids = set(eos_token_ids(model.generation_config))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def input_device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


class ModelPair:
    """A target model, its tokenizer and an optional drafter (``registry.DrafterSource``)."""

    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 draft: DrafterSource | None = None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        widths = [draft.width] if draft is not None and draft.width is not None else []
        self.vocab_size = shared_vocab_size(target, widths, tokenizer)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = DEFAULT_DRAFT,
             dtype: str = "auto", device: str = "cpu") -> "ModelPair":
        """Load by name (see ``loading.load_model`` and ``registry``). ``target=None`` is the embedded
        SmolLM2-135M-Instruct; ``draft="default"`` the drafter of its default job, ``None`` no drafter
        (AR only)."""
        target_model, tokenizer = load_model(target, dtype, device)
        pair = cls(target_model, tokenizer)
        if draft is not None:
            pair.draft = load_drafter(draft, target_model, tokenizer, pair.vocab_size, target, dtype, device)
            pair.vocab_size = shared_vocab_size(target_model, [pair.draft.width] if pair.draft.width else [],
                                                tokenizer)
        return pair

    def with_drafter(self, name: str, target_name: str | None = None, dtype: str = "auto",
                     device: str = "cpu") -> "ModelPair":
        """The same target with another drafter (loaded by name; the target stays shared)."""
        return ModelPair(self.target, self.tokenizer,
                         load_drafter(name, self.target, self.tokenizer, self.vocab_size, target_name, dtype, device))

    def drafter(self, config: DecodeConfig) -> Drafter | None:
        """A fresh drafter for one sequence: none for AR."""
        if config.method == "ar":
            return None
        if self.draft is None:
            raise ValueError(f"method {config.method!r} needs a drafter (--draft)")
        if config.tree and not self.draft.drafts_trees:
            raise ValueError("tree drafting needs an EAGLE head as the drafter (--draft eagle or eagle:DIR)")
        return self.draft.new()

    def encode(self, prompt: str | Sequence[dict], chat: bool = True) -> Tensor:
        """Token ids [1, L] of a prompt: a string, or chat messages; chat templates apply when ``chat``."""
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError("the prompt is empty")
        if chat and self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                                     return_tensors="pt")["input_ids"]
        else:
            if not isinstance(prompt, str):
                raise ValueError("chat messages need a tokenizer with a chat template")
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        return ids.to(input_device(self.target))

    def generate(self, prompt: str | Sequence[dict] | Tensor, *, chat: bool = True, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None, config: DecodeConfig | None = None,
                 **options: Any) -> Result:
        """Generate a completion. ``options`` are DecodeConfig fields plus temperature, top_k, top_p
        (or pass ``config``). ``on_text`` receives text as tokens are accepted (streaming)."""
        if config is None:
            options.setdefault("eos_token_ids", eos_ids(self.target, self.tokenizer))
            config = make_config(**options)
        elif options:
            raise ValueError("pass either config or keyword options, not both")
        input_ids = prompt if isinstance(prompt, Tensor) else self.encode(prompt, chat)
        drafter = self.drafter(config)
        stream = TextStream(self.tokenizer, stop)

        def on_tokens(new: Tensor) -> bool:
            delta = stream.push(new[0].tolist())
            if delta and on_text is not None:
                on_text(delta)
            return stream.stopped

        tokens, stats = decode(self.target, drafter, input_ids, config, self.vocab_size, on_tokens)
        tail = stream.finish()
        if tail and on_text is not None:
            on_text(tail)
        token_list = tokens[0].tolist()
        ended = stream.stopped or (bool(token_list) and token_list[-1] in config.eos_token_ids)
        return Result(stream.text, token_list, stats, "stop" if ended else "length")
