"""fuzzyspec.gguf_tokenizer: a GGUF's byte-level BPE tokenizer written without transformers."""
import json
from types import SimpleNamespace

import pytest

from fuzzyspec import gguf_tokenizer
from fuzzyspec.tokenizer import SavedTokenizer

CONTROL, NORMAL, USER = 3, 1, 4


def tiny_file(pre: str = "smollm", **more) -> SimpleNamespace:
    """A GGUF's metadata (what ``gguf_tokenizer`` reads of one): the 256 byte tokens, a few merges, two control
    tokens and a user-defined one."""
    alphabet = gguf_tokenizer.byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_end|>", *(alphabet[byte] for byte in range(256)), "Ġ1", "12", "ab", "Ġab", "ĊĊ",
              "<think>"]
    merges = ["Ġ 1", "1 2", "a b", "Ġ ab", "Ċ Ċ"]
    kinds = [CONTROL, CONTROL, *[NORMAL] * (len(tokens) - 3), USER]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": kinds,
                "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 0,
                "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}", **more}
    return SimpleNamespace(path="tiny.gguf", metadata=metadata)


def pieces(file, text: str) -> list[str]:
    return gguf_tokenizer.backend(file).encode(text).tokens


def test_the_byte_alphabet_spells_each_byte_once_printable_bytes_as_themselves():
    spelling = gguf_tokenizer.byte_alphabet()
    assert sorted(spelling) == list(range(256)) and len(set(spelling.values())) == 256
    assert spelling[ord("a")] == "a" and spelling[ord(" ")] == "Ġ" and spelling[ord("\n")] == "Ċ"
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert spelling == bytes_to_unicode()


def test_smollm_isolates_digits_before_the_merges_and_gpt2_does_not():
    """llama.cpp's ``smollm`` splits every digit off first, as SmolLM2's own tokenizer does: " 12" is a space and two
    digits there, where GPT-2's split would merge it whole."""
    assert pieces(tiny_file("smollm"), "ab 12\n\n1") == ["ab", "Ġ", "1", "2", "ĊĊ", "1"]
    assert pieces(tiny_file("gpt-2"), "ab 12\n\n1") == ["ab", "Ġ1", "2", "Ċ", "Ċ", "1"]  # (GPT-2: "\n", "\n", "1")


def test_control_tokens_are_special_and_user_defined_ones_matched_whole():
    tokenizer = gguf_tokenizer.backend(tiny_file())
    encoded = tokenizer.encode("ab<|im_end|> <think>")
    assert encoded.tokens == ["ab", "<|im_end|>", "Ġ", "<think>"]
    assert tokenizer.decode(encoded.ids) == "ab <think>"  # (special tokens skipped, the user-defined kept)
    assert tokenizer.decode(encoded.ids, skip_special_tokens=False) == "ab<|im_end|> <think>"


@pytest.mark.parametrize("types", ["eos typed normal", "eos typed user-defined", "no token types"])
def test_the_tokens_the_file_names_are_special_whatever_their_type(types):
    """EOS (and BOS, UNK, padding) named by the file are special, as transformers' converter makes them, though the
    file types them as normal or user-defined tokens or gives no types at all."""
    file = tiny_file()
    if types != "no token types":
        file.metadata["tokenizer.ggml.token_type"][1] = NORMAL if types == "eos typed normal" else USER
    else:
        del file.metadata["tokenizer.ggml.token_type"]
    tokenizer = gguf_tokenizer.backend(file)
    assert tokenizer.encode("ab<|im_end|>").tokens == ["ab", "<|im_end|>"]
    assert tokenizer.decode(tokenizer.encode("ab<|im_end|>").ids) == "ab"
    saved = json.loads(tokenizer.to_str())["added_tokens"]  # (as written to tokenizer.json, and read back)
    assert next(token for token in saved if token["content"] == "<|im_end|>")["special"]


def test_a_token_outside_the_byte_alphabet_is_spelt_byte_by_byte():
    spelling = gguf_tokenizer.byte_alphabet()
    first, second, third = (spelling[byte] for byte in "中".encode("utf-8"))  # (the last is outside Latin-1's print)
    file = tiny_file()
    meta = file.metadata
    meta["tokenizer.ggml.tokens"] += [first + second, "中"]  # (stored as text: the merges spell it as its bytes)
    meta["tokenizer.ggml.token_type"] += [NORMAL, NORMAL]
    meta["tokenizer.ggml.merges"] += [f"{first} {second}", f"{first + second} {third}"]
    tokenizer = gguf_tokenizer.backend(file)
    assert first + second + third in tokenizer.get_vocab() and "中" not in tokenizer.get_vocab()
    assert tokenizer.encode("中").tokens == [first + second + third] and tokenizer.decode(tokenizer.encode("中").ids) \
        == "中"


def test_only_byte_level_files_with_a_known_split_and_nothing_added_are_converted_here():
    assert gguf_tokenizer.convertible(tiny_file("smollm")) and gguf_tokenizer.convertible(tiny_file("gpt-2"))
    assert not gguf_tokenizer.convertible(tiny_file("llama-bpe"))  # (another split: transformers converts it)
    assert not gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.model": "llama"}))
    assert not gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.add_bos_token": True}))
    assert gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.add_bos_token": False}))
    assert not gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.merges": 4}))  # (skipped by the reader)
    # metadata of other types than the format's, or a named special token transformers would add anew
    assert not gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.merges": [1, 2]}))
    assert not gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.token_type": 0.5}))
    assert not gguf_tokenizer.convertible(tiny_file(**{"tokenizer.ggml.token_type": [1, 3]}))
    outside = tiny_file()
    outside.metadata["tokenizer.ggml.tokens"][1] = "<｜end｜>"
    assert not gguf_tokenizer.convertible(outside)


def test_merges_that_do_not_fit_the_vocabulary_are_a_value_error():
    file = tiny_file()
    file.metadata["tokenizer.ggml.merges"] = ["x y z q"]
    with pytest.raises(ValueError, match="merges do not fit"):
        gguf_tokenizer.backend(file)


def test_the_written_folder_reads_alike_here_and_in_transformers(tmp_path):
    gguf_tokenizer.write(tiny_file(), tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "<|im_end|>" and settings["unk_token"] == "<|endoftext|>"
    assert "bos_token" not in settings  # (the file names none)
    light = SavedTokenizer(tmp_path)
    from transformers import AutoTokenizer

    full = AutoTokenizer.from_pretrained(tmp_path)
    for text in ("ab 12\n\n1", "ab<|im_end|> <think>", ""):
        assert light.encode(text) == full.encode(text)
    chat = [{"role": "user", "content": "ab 1"}]
    assert light.apply_chat_template(chat, tokenize=False) == full.apply_chat_template(chat, tokenize=False) == \
        "ab 1<|im_end|>"
    assert light.eos_token_id == full.eos_token_id == 1


@pytest.mark.embedded
def test_the_embedded_tokenizer_is_transformers_conversion_but_for_the_digits(tmp_path):
    """Against transformers' own conversion of the embedded GGUF: the same vocabulary, merges, special tokens,
    decoder, settings and chat template; the pre-tokenizer isolates digits first (transformers' does not know
    llama.cpp's ``smollm``)."""
    from transformers import TokenizersBackend

    from fuzzyspec.loading import embedded_gguf

    path = embedded_gguf()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    gguf_tokenizer.write(gguf_tokenizer.read(path), ours)
    TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(theirs)
    mine, reference = (json.loads((folder / "tokenizer.json").read_text()) for folder in (ours, theirs))
    assert mine["pre_tokenizer"]["pretokenizers"] == [{"type": "Digits", "individual_digits": True},
                                                      reference["pre_tokenizer"]]
    assert mine["model"].pop("merges") == [" ".join(pair) for pair in reference["model"].pop("merges")]
    assert {key: value for key, value in mine.items() if key != "pre_tokenizer"} == \
        {key: value for key, value in reference.items() if key != "pre_tokenizer"}
    settings = json.loads((theirs / "tokenizer_config.json").read_text())
    for local in ("is_local", "local_files_only"):  # (where transformers loaded it from)
        settings.pop(local, None)
    assert json.loads((ours / "tokenizer_config.json").read_text()) == settings
    assert (ours / "chat_template.jinja").read_text() == (theirs / "chat_template.jinja").read_text()
