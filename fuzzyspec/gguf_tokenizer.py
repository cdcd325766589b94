"""A GGUF file's byte-level BPE tokenizer (llama.cpp's ``gpt2`` model) written as a tokenizer folder, without
transformers.

The folder is what transformers' ``TokenizersBackend`` saves (tokenizer.json, tokenizer_config.json,
chat_template.jinja), so ``tokenizer.SavedTokenizer`` and transformers both read it. Two reasons not to let
transformers convert it:

- **The pre-tokenizer.** llama.cpp names how a vocabulary splits text before its merges (``tokenizer.ggml.pre``).
  For ``smollm`` (SmolLM and SmolLM2, the embedded target) it isolates every digit first, then splits as GPT-2
  does, as the model's own tokenizer did in training. transformers' GGUF converter (5.x) does not know that name
  and splits as GPT-2 alone: "\\n\\n1" became two newline tokens and a digit, where the model learnt one token for
  both newlines. 14.8% of 4,000 ShareGPT messages tokenized differently, and on 80 of them the embedded target's
  loss was lower with the digits isolated, on every one (0.4518 nats a character against 0.4586, 2026-11-29).
- **Time.** Importing transformers and converting took about 2.2 s of CPU of a first run (on 2 cores, beside the
  kernels' build); converting here takes about 0.5 s (0.07 s of it reading the vocabulary and merges).

Only the pre-tokenizers of ``SPLITS`` are written here; ``convertible`` says which files those are. Any other (and any
file asking for a BOS or EOS token added to every text) is converted by transformers, as before (``loading``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .gguf import GGUFFile

ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
# llama.cpp's pre-tokenizer name -> whether digits are isolated before GPT-2's split
SPLITS = {"gpt-2": False, "smollm": True}
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (3: special; 4: added, matched whole in text)
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}
NO_LIMIT = int(1e30)  # transformers' model_max_length where none is set


def read(path: str | Path) -> GGUFFile:
    """The file's metadata with its vocabulary, merges and token types read whole."""
    return GGUFFile(path, arrays=ARRAYS)


def convertible(gguf: GGUFFile) -> bool:
    """Whether ``write`` converts this file's tokenizer: byte-level BPE with merges, a pre-tokenizer of ``SPLITS``, no
    token added to every text, its vocabulary and merges as strings (and its token types one a token), and the
    special tokens it names spelt in the byte alphabet (transformers gives one spelt otherwise a new id)."""
    meta = gguf.metadata
    tokens, merges, kinds = (meta.get(f"tokenizer.ggml.{key}") for key in ("tokens", "merges", "token_type"))
    if not (meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") in SPLITS
            and not meta.get("tokenizer.ggml.add_bos_token") and not meta.get("tokenizer.ggml.add_eos_token")
            and isinstance(tokens, list) and all(isinstance(token, str) for token in tokens)
            and isinstance(merges, list) and all(isinstance(merge, str) for merge in merges)
            and (kinds is None or isinstance(kinds, (list, np.ndarray)) and len(kinds) == len(tokens))):
        return False
    alphabet = set(byte_alphabet().values())
    return all(set(tokens[index]) <= alphabet for index in named(gguf).values())


def named(gguf: GGUFFile) -> dict[str, int]:
    """The special tokens the file names (``SPECIAL_IDS``) that are in its vocabulary: name -> id."""
    meta, count = gguf.metadata, len(gguf.metadata["tokenizer.ggml.tokens"])
    return {name: meta[f"tokenizer.ggml.{key}"] for name, key in SPECIAL_IDS.items()
            if isinstance(meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= meta[f"tokenizer.ggml.{key}"] < count}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves, the other 68 for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte], extra = chr(256 + extra), extra + 1
    return spelling


def backend(gguf: GGUFFile):
    """The file's tokenizer as a ``tokenizers.Tokenizer`` (``convertible`` files)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = gguf.metadata
    tokens, kinds = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type")
    kinds = [NORMAL] * len(tokens) if kinds is None else [int(kind) for kind in kinds]
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # a token holding characters outside the byte alphabet is spelt byte by byte, as the merges spell it
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                                         ignore_merges=False))
    except Exception as error:  # (tokenizers raises a bare Exception: a merge of tokens not in the vocabulary)
        raise ValueError(f"{gguf.path}: its tokenizer's merges do not fit its vocabulary ({error})") from error
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if SPLITS[meta["tokenizer.ggml.pre"]] else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    # Control tokens and the tokens the file names (BOS, EOS, ...) are special: kept whole, skipped when decoding asks.
    # A control token spelt outside the byte alphabet is a mislabelled byte token, left to the merges. User-defined
    # tokens are matched whole but not special (but for a named one: adding a token again replaces it, special or not).
    special = {index for index, (token, kind) in enumerate(zip(tokens, kinds)) if kind == CONTROL and
               set(token) <= alphabet} | set(named(gguf).values())
    tokenizer.add_special_tokens([AddedToken(tokens[index], normalized=False, special=True)
                                  for index in sorted(special)])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for index, (token, kind)
                          in enumerate(zip(tokens, kinds)) if kind == USER_DEFINED and token in vocab
                          and index not in special])
    return tokenizer


def settings(gguf: GGUFFile) -> dict:
    """tokenizer_config.json's settings: the special tokens the file names, as transformers saves them."""
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    names = {name: tokens[index] for name, index in named(gguf).items()}
    return {"backend": "tokenizers", **names, "model_max_length": NO_LIMIT, "tokenizer_class": "TokenizersBackend"}


def write(gguf: GGUFFile, folder: Path) -> None:
    """The tokenizer folder of a ``convertible`` file."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = json.loads(backend(gguf).to_str())
    # Merges as "left right" strings (tokenizers' older form, which it still reads), not [left, right] pairs: the
    # embedded tokenizer read back in 107 ms against 132 (medians), at every load. Unambiguous here: a byte-level token
    # spells a space as "Ġ", never " ".
    saved["model"]["merges"] = [pair if isinstance(pair, str) else " ".join(pair) for pair in saved["model"]["merges"]]
    (folder / "tokenizer.json").write_text(json.dumps(saved, ensure_ascii=False, indent=2), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings(gguf), indent=2, sort_keys=True) + "\n",
                                                  encoding="utf-8")
    template = gguf.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
