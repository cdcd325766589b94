"""The plain Python API: a target, its tokenizer and a drafter, ready to generate text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import Tensor

from .core import parallel
from .core.config import DecodeConfig
from .core.draft import Drafter
from .core.engine import decode
from .core.stats import Stats
from .core.step import TargetStep
from .drafters.registry import DrafterSource, load_drafter
from .loading import load_model, shared_vocab_size
from .options import DEFAULT_DRAFT
from .text import TextStream, check_prompt, check_text

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def eos_token_ids(generation_config: Any) -> tuple[int, ...]:
    """EOS ids from the prepared ``_eos_token_tensor``, else ``eos_token_id`` (an int or a list)."""
    tensor = getattr(generation_config, "_eos_token_tensor", None)
    if tensor is not None:
        ids = tensor.reshape(-1).tolist()
    else:
        eos = generation_config.eos_token_id
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(sorted({int(i) for i in ids}))


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The model's generation-config EOS ids and the tokenizer's EOS token."""
    ids = set(eos_token_ids(model.generation_config))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def input_device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


class ModelPair:
    """A target model, its tokenizer and an optional drafter (``drafters.registry.DrafterSource``).

    ``generate(prompt)`` with no options runs the same job as ``fuzzyspec generate PROMPT``: both decide
    through ``DecodeConfig.from_options``.
    """

    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 draft: DrafterSource | None = None, step: TargetStep | None = None,
                 profile_key: str | None = None) -> None:
        """``step``: how the target's steps run (eager or compiled) and what they cost; pairs sharing a target
        share it. ``profile_key``: where its measured costs are kept (``tuning``; None: not kept)."""
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.step = step if step is not None else TargetStep(target)
        self.profile_key = profile_key
        self.vocab_size = shared_vocab_size(target, draft.width if draft is not None else None, tokenizer)
        self.eos_token_ids = eos_ids(target, tokenizer)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = DEFAULT_DRAFT, dtype: str = "auto",
             device: str = "cpu", weights: str = "auto", compile: bool = False, tp: bool = False) -> "ModelPair":
        """Load by name (see ``loading.load_model`` and ``drafters.registry``). ``target=None`` is the embedded
        SmolLM2-135M-Instruct; ``draft="default"`` the drafter of its default job, ``None`` no drafter
        (AR only). ``weights``: ``auto``, ``int4`` (a GGUF at its own 4-bit bytes), ``bf16`` or ``fp32``.
        ``compile``: run the target's decoding steps compiled (``torch.compile``; see ``core.step``). The
        costs measured while it decodes are kept in the cache for this machine (``tuning``). ``tp``: under
        ``torchrun``, shard the target over the launch's ranks (``core.parallel``); every rank must then make
        the same calls, and the drafter runs on each."""
        from . import tuning

        shards = parallel.world_size() if tp else 1
        # (the options are checked before the weights load: ``load_model`` decides the form first)
        target_model, tokenizer = load_model(target, dtype, device, weights, tp=tp)
        key = tuning.profile_key(target, weights, dtype, device, compile, shards)
        source = load_drafter(draft, target_model, tokenizer, target, dtype, device, weights) \
            if draft is not None else None
        step = TargetStep(target_model, compile=compile)
        step.profile = tuning.load(key)
        return cls(target_model, tokenizer, source, step, key)

    def save_profile(self) -> None:
        """Keep what this pair's steps were measured to cost (done after each ``generate``)."""
        from . import tuning

        # The ranks of a sharded target share rank 0's plans, so rank 0's measurements are the ones kept.
        if self.profile_key is not None and self.step.profile.updates and parallel.rank() == 0:
            tuning.save(self.profile_key, self.step.profile)

    def with_drafter(self, name: str, target_name: str | None = None, dtype: str = "auto",
                     device: str = "cpu", weights: str = "auto") -> "ModelPair":
        """The same target with another drafter (loaded by name; the target stays shared)."""
        return ModelPair(self.target, self.tokenizer,
                         load_drafter(name, self.target, self.tokenizer, target_name, dtype, device, weights),
                         self.step, self.profile_key)

    def config(self, target_acceptance: float | None = None, eos_token_ids: Sequence[int] | None = None,
               **options: Any) -> DecodeConfig:
        """The decoding of a request with these options (``options.OPTIONS`` names; None or absent: unset),
        decided as every interface decides it; generation ends at this pair's EOS tokens unless
        ``eos_token_ids`` says otherwise (``()``: never)."""
        eos = self.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        return DecodeConfig.from_options(options, drafter=self.draft, eos_token_ids=eos,
                                         target_acceptance=target_acceptance)

    def drafter(self, config: DecodeConfig) -> Drafter | None:
        """A fresh drafter for one sequence: none for AR."""
        config.check_drafter(self.draft)
        return self.draft.new(self.vocab_size) if config.method != "ar" else None

    def encode(self, prompt: str | Sequence[dict], chat: bool = True) -> Tensor:
        """Token ids [1, L] of a prompt: a string, or chat messages; chat templates apply when ``chat``."""
        if isinstance(prompt, str):
            check_prompt(prompt)
        else:
            for message in prompt:
                if isinstance(message.get("content"), str):
                    check_text(message["content"], "a message")
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
        """Generate a completion. ``options`` are decoding options (``options.OPTIONS``: method, threshold,
        temperature, ...) and ``eos_token_ids``, decided as ``config(**options)`` does; or pass a ``config``.
        ``on_text`` receives text as tokens are accepted (streaming)."""
        if config is None:
            config = self.config(**options)
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

        # Where no one reads the text as it comes and no stop string can end it, it is decoded once at the end:
        # a step's two detokenizations are host time that a GPU step, queued ahead, would otherwise wait for.
        watched = on_text is not None or bool(stream.stop)
        tokens, stats = decode(self.step, drafter, input_ids, config, self.vocab_size, on_tokens if watched else None)
        self.save_profile()
        token_list = tokens[0].tolist()
        if not watched:
            stream.push(token_list)
        tail = stream.finish()
        if tail and on_text is not None:
            on_text(tail)
        ended = stream.stopped or (bool(token_list) and token_list[-1] in config.eos_token_ids)
        return Result(stream.text, token_list, stats, "stop" if ended else "length")

