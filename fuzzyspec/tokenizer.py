"""A saved tokenizer of transformers' ``TokenizersBackend`` class (what a GGUF's tokenizer converts to), read without
importing transformers.

Such a tokenizer is a Rust ``tokenizers.Tokenizer`` (tokenizer.json) with special tokens and a chat template around
it. Importing transformers to build one took 0.75 s of the README's main command's 3.3 s on a 2-core AVX2 EPYC
(2026-11-29), and a 4-bit target's answer needs nothing else of transformers (``core.llama``). ``SavedTokenizer``
reads the same folder and does what decoding asks of a tokenizer (encoding text and chats, decoding, the vocabulary,
the special tokens) as transformers does it (tested against it); anything else a transformers tokenizer offers, and
any chat call beyond plain messages, goes to one built from the same folder on first use
(``SavedTokenizer.transformers``).
"""
from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import torch

from .files import write_whole

log = logging.getLogger(__name__)

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PLAIN_KEYS = {"role", "content"}  # a message the template renders here holds only these, as text


class SavedTokenizer:
    """A ``TokenizersBackend`` folder's tokenizer (see the module docstring)."""

    @staticmethod
    def serves(folder: Path, settings: dict) -> bool:
        """Whether this class reads the tokenizer saved in ``folder`` (``settings``: its tokenizer_config.json) as
        transformers does: one of ``TokenizersBackend`` class, with its tokenizer.json, and without
        ``add_bos_token`` or ``add_eos_token`` settings, from which transformers builds its post-processor anew."""
        return settings.get("tokenizer_class") == "TokenizersBackend" and (folder / "tokenizer.json").is_file() and \
            not {"add_bos_token", "add_eos_token"} & settings.keys()

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.name_or_path = str(folder)
        try:
            self.backend = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        except Exception as error:  # (tokenizers raises a bare Exception for a file it cannot parse)
            raise ValueError(f"{self.folder / 'tokenizer.json'}: {error}") from error
        settings = json.loads((self.folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        # (a special token is saved as its text, or as an added token's fields)
        self.special_tokens_map = {name: value["content"] if isinstance(value, dict) else value
                                   for name in SPECIAL if isinstance(value := settings.get(name), (str, dict))}
        template = self.folder / "chat_template.jinja"
        self.chat_template = template.read_text(encoding="utf-8") if template.is_file() else \
            settings.get("chat_template")
        self.clean_up_tokenization_spaces = bool(settings.get("clean_up_tokenization_spaces", False))
        self._transformers = None

    def __repr__(self) -> str:
        return f"SavedTokenizer({str(self.folder)!r}, vocabulary={len(self)})"

    def __getattr__(self, name: str) -> Any:
        """What this class does not do itself, as the transformers tokenizer of the same folder does it."""
        if name.startswith("_") or name in ("folder", "backend", "special_tokens_map"):
            raise AttributeError(name)  # (not set yet: being copied or unpickled)
        return getattr(self.transformers(), name)

    def transformers(self):
        """The transformers tokenizer of the same folder (importing transformers, once)."""
        if self._transformers is None:
            self._transformers = transformers_tokenizer(self.folder)
        return self._transformers

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None,
                 **options: Any) -> dict[str, Any]:
        """One text's ``input_ids`` and ``attention_mask``: lists, or [1, L] tensors with ``return_tensors="pt"``;
        anything else (a batch of texts, padding, other tensors) as transformers' tokenizer gives it."""
        if options or not isinstance(text, str) or return_tensors not in (None, "pt"):
            return self.transformers()(text, add_special_tokens=add_special_tokens, return_tensors=return_tensors,
                                       **options)
        ids = self.encode(text, add_special_tokens)
        as_given = (lambda values: torch.tensor([values])) if return_tensors == "pt" else list  # noqa: E731
        return {"input_ids": as_given(ids), "attention_mask": as_given([1] * len(ids))}

    def decode(self, ids: int | Sequence[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.transformers().clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, conversation: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, return_tensors: str | None = None,
                            **options: Any) -> Any:
        """transformers' ``apply_chat_template``: plain messages (a role and a text each) with no further options are
        rendered here, as transformers renders them; anything else goes to transformers, as does a template this
        compiler does not take (one marking the assistant's tokens with transformers' ``{% generation %}``)."""
        plain = not options and self.chat_template and isinstance(conversation, (list, tuple)) and conversation and \
            all(isinstance(m, dict) and set(m) <= PLAIN_KEYS and all(isinstance(v, str) for v in m.values())
                for m in conversation)
        if not plain or _template(self.chat_template) is None:
            return self.transformers().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                           tokenize=tokenize, return_dict=return_dict,
                                                           return_tensors=return_tensors, **options)
        text = _template(self.chat_template).render(messages=[dict(m) for m in conversation], tools=None,
                                                    documents=None, add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens_map)
        if not tokenize:
            return text
        encoded = self(text, add_special_tokens=False, return_tensors=return_tensors)
        return encoded if return_dict else encoded["input_ids"]


@functools.lru_cache(maxsize=8)
def _template(source: str):
    """A chat template compiled as transformers compiles one: a sandbox, blocks trimmed, loop controls, JSON without
    HTML escapes, ``raise_exception`` and ``strftime_now``; None for one it does not take."""
    from jinja2 import TemplateError, TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(source)
    except TemplateSyntaxError:
        return None


def transformers_tokenizer(folder: Path):
    """transformers' ``TokenizersBackend`` of a saved folder. Its first load writes the tokenizer's added tokens into
    the folder's ``tokenizer_config.json`` (``added_tokens_decoder``, a field transformers reads there; its
    ``save_pretrained`` leaves it out): without it, every load parsed the whole 3.5 MB tokenizer.json in Python to
    find them, before the Rust tokenizer parsed it again (0.10-0.17 s a load with it, 0.26-0.31 s without; the same
    tokenizer). A cache this process cannot write is left as it is."""
    from transformers import TokenizersBackend

    tokenizer = TokenizersBackend.from_pretrained(folder)
    settings = folder / "tokenizer_config.json"
    saved = json.loads(settings.read_text(encoding="utf-8")) if settings.is_file() else {}
    if "added_tokens_decoder" not in saved and tokenizer.added_tokens_decoder:
        noted = {**saved, "added_tokens_decoder": {str(index): token.__getstate__()
                                                   for index, token in tokenizer.added_tokens_decoder.items()}}
        try:
            write_whole(settings, lambda temp: temp.write_text(json.dumps(noted, indent=2, ensure_ascii=False) + "\n",
                                                               encoding="utf-8"))
        except OSError as error:
            log.debug("could not note the added tokens in %s: %s", settings, error)
    return tokenizer
