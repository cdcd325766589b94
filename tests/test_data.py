"""fuzzyspec.data: reading ShareGPT, the held-out split, rendering, token datasets and their cache."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from fuzzyspec import data
from fuzzyspec.data import (
    Conversation, ReadStats, TokenDataset, build_token_dataset, cached_token_dataset, is_held_out, prompts,
    read_sharegpt, render, split,
)

RECORDS = [
    {"id": "plain_0", "conversations": [{"from": "human", "value": "What is 2 + 2?"},
                                        {"from": "gpt", "value": "2 + 2 is 4."}]},
    {"id": "unknown_0", "conversations": [{"from": "human", "value": "Hi"}, {"from": "bing", "value": "Hello"}]},
    {"id": "lonely_0", "conversations": [{"from": "human", "value": "Anyone there?"}]},
    {"id": "empty_0", "conversations": []},
    {"id": "trailing_0", "conversations": [{"from": "human", "value": "Name a colour."},
                                           {"from": "gpt", "value": "Blue."},
                                           {"from": "human", "value": "Another one?"}]},
    {"id": "system_0", "conversations": [{"from": "system", "value": "Be terse."},
                                         {"from": "human", "value": "  Why is the sky blue? "},
                                         {"from": "chatgpt", "value": "Rayleigh scattering."},
                                         {"from": "human", "value": "And sunsets?"},
                                         {"from": "bard", "value": "Longer path, so red."}]},
    {"id": "backwards_0", "conversations": [{"from": "gpt", "value": "I speak first."},
                                            {"from": "human", "value": "And I never get an answer."}]},
    {"id": "part_1", "conversations": [{"from": "gpt", "value": "...continued from part 0."},
                                       {"from": "human", "value": ""},
                                       {"from": "gpt", "value": "Anything else?"}]},
    {"id": "malformed_0", "conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]},
]
CUT_TAIL = '{\n    "id": "cut_0",\n    "conversations": [\n      {\n        "from": "human",\n        "value": "This ne'

EXPECTED = [
    Conversation("plain_0", ({"role": "user", "content": "What is 2 + 2?"},
                             {"role": "assistant", "content": "2 + 2 is 4."})),
    Conversation("trailing_0", ({"role": "user", "content": "Name a colour."},
                                {"role": "assistant", "content": "Blue."})),
    Conversation("system_0", ({"role": "system", "content": "Be terse."},
                              {"role": "user", "content": "  Why is the sky blue? "},
                              {"role": "assistant", "content": "Rayleigh scattering."},
                              {"role": "user", "content": "And sunsets?"},
                              {"role": "assistant", "content": "Longer path, so red."})),
    Conversation("part_1", ({"role": "assistant", "content": "...continued from part 0."},
                            {"role": "user", "content": ""},
                            {"role": "assistant", "content": "Anything else?"})),
]


@pytest.fixture
def sharegpt_file(tmp_path) -> Path:
    """A small file in ShareGPT's layout (an indented list), cut off inside its last object like the real one."""
    body = json.dumps(RECORDS, indent=2)
    assert body.endswith("\n]")
    path = tmp_path / "sharegpt.json"
    path.write_text(body[:-2] + ",\n  " + CUT_TAIL, encoding="utf-8")
    return path


def test_read_sharegpt_keeps_usable_conversations_exactly(sharegpt_file):
    stats = ReadStats()
    assert list(read_sharegpt(sharegpt_file, stats)) == EXPECTED
    assert stats == ReadStats(records=len(RECORDS), kept=4, empty=1, unknown_role=1, no_exchange=2, malformed=1,
                              broken_tail_chars=len(CUT_TAIL))


def test_read_sharegpt_complete_file_and_str_path(tmp_path):
    path = tmp_path / "complete.json"
    path.write_text(json.dumps(RECORDS[:1]), encoding="utf-8")  # compact, and properly closed
    stats = ReadStats()
    assert list(read_sharegpt(str(path), stats)) == EXPECTED[:1]
    assert stats.broken_tail_chars == 0
    path.write_text("[]", encoding="utf-8")
    assert list(read_sharegpt(path)) == []
    path.write_text('{"id": "x"}', encoding="utf-8")
    with pytest.raises(ValueError, match="not a JSON list"):
        list(read_sharegpt(path))


def test_split_is_deterministic_disjoint_and_near_the_fraction():
    ids = [f"{random.Random(i).getrandbits(40):010x}_0" for i in range(10_000)]
    conversations = [Conversation(i, ()) for i in ids]
    train, held_out = split(conversations, fraction=0.02)
    assert len(train) + len(held_out) == len(ids)
    assert {c.id for c in train}.isdisjoint({c.id for c in held_out})
    assert 150 <= len(held_out) <= 250  # 200 expected, standard deviation 14
    assert split(conversations, fraction=0.02) == (train, held_out)
    assert [is_held_out(i) for i in ids] == [c in held_out for c in conversations]
    # Any order or subset gives every conversation the same side.
    shuffled = conversations[::-1][:5000]
    random.Random(1).shuffle(shuffled)
    train2, held_out2 = split(shuffled)
    assert {c.id for c in held_out2} == {c.id for c in shuffled} & {c.id for c in held_out}
    assert {c.id for c in train2} == {c.id for c in shuffled} & {c.id for c in train}
    # A larger fraction only adds conversations to the held-out side.
    assert {c.id for c in held_out} <= {c.id for c in split(conversations, fraction=0.1)[1]}


PINNED_HELD_OUT = 211  # of "conv0" ... "conv9999" at fraction 0.02


def test_split_is_pinned_and_keeps_parts_together():
    # Pinned so that a change of hash, which would leak old held-out data into training, fails loudly.
    assert sum(is_held_out(f"conv{i}") for i in range(10_000)) == PINNED_HELD_OUT
    for i in range(2_000):
        sides = {is_held_out(f"conv{i}_{part}", 0.5) for part in range(4)}
        assert sides == {is_held_out(f"conv{i}", 0.5)}
    assert not any(is_held_out(f"conv{i}", 0.0) for i in range(1000))
    assert all(is_held_out(f"conv{i}", 1.0) for i in range(1000))
    with pytest.raises(ValueError):
        is_held_out("x", 1.5)


def test_render_matches_the_chat_template_and_truncates(embedded_tokenizer):
    for conversation in EXPECTED:
        text = embedded_tokenizer.apply_chat_template(list(conversation.messages), tokenize=False)
        expected = embedded_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert render(embedded_tokenizer, conversation.messages, 10_000) == expected
        assert render(embedded_tokenizer, conversation.messages, 7) == expected[:7]
        assert render(embedded_tokenizer, conversation.messages, 0) == []
    ids = render(embedded_tokenizer, EXPECTED[0].messages, 10_000)
    assert embedded_tokenizer.decode(ids).endswith("2 + 2 is 4.<|im_end|>\n")  # no generation prompt


class ListTokenizer:
    """Stands in for a tokenizer whose chat template returns a plain list (transformers 4) or a dict."""

    def __init__(self, wrap):
        self.wrap = wrap

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize and not add_generation_prompt
        return self.wrap([len(m["content"]) for m in messages])


@pytest.mark.parametrize("wrap", [list, lambda ids: {"input_ids": ids}, lambda ids: {"input_ids": [ids]},
                                  np.array])
def test_render_accepts_every_return_shape(wrap):
    messages = EXPECTED[2].messages
    assert render(ListTokenizer(wrap), messages, 3) == [9, 23, 20]


def test_prompts_takes_first_user_messages_and_skips_blank_or_long():
    assert prompts(EXPECTED, 10) == ["What is 2 + 2?", "Name a colour.", "  Why is the sky blue? "]
    assert prompts(EXPECTED, 2) == ["What is 2 + 2?", "Name a colour."]
    assert prompts(EXPECTED, 10, max_chars=14) == ["What is 2 + 2?", "Name a colour."]
    assert prompts(EXPECTED, 0) == []


def test_token_dataset_round_trip(tmp_path):
    sequences = [[1, 2, 3], [], [2**32 - 1], list(range(100))]
    dataset = TokenDataset.from_sequences(sequences, meta={"split": "train"})
    assert len(dataset) == 4 and dataset.num_tokens == 104
    path = tmp_path / "set.npz"
    dataset.save(path)
    loaded = TokenDataset.load(path)
    assert loaded.tokens.dtype == np.uint32 and loaded.offsets.dtype == np.int64
    assert [s.tolist() for s in loaded] == sequences
    assert loaded[-1].tolist() == sequences[-1] and loaded.meta == {"split": "train"}
    with pytest.raises(IndexError):
        loaded[4]
    with pytest.raises(ValueError):
        TokenDataset.from_sequences([[-1]])
    with pytest.raises(ValueError):
        TokenDataset(np.zeros(3), np.array([0, 2]))
    empty = tmp_path / "empty"  # no suffix: save must not add one
    TokenDataset.from_sequences([]).save(empty)
    assert len(TokenDataset.load(empty)) == 0 and TokenDataset.load(empty).num_tokens == 0


def test_build_token_dataset_renders_one_split(sharegpt_file, embedded_tokenizer, capsys):
    everything = build_token_dataset(embedded_tokenizer, "train", fraction=0.0, path=sharegpt_file, progress=False)
    assert [s.tolist() for s in everything] == [render(embedded_tokenizer, c.messages, 512) for c in EXPECTED]
    assert everything.meta["conversations"] == 4 and everything.meta["split"] == "train"
    assert len(build_token_dataset(embedded_tokenizer, "held_out", fraction=0.0, path=sharegpt_file,
                                   progress=False)) == 0
    assert len(build_token_dataset(embedded_tokenizer, "held_out", fraction=1.0, path=sharegpt_file,
                                   progress=False)) == 4
    halves = [build_token_dataset(embedded_tokenizer, name, fraction=0.5, path=sharegpt_file, progress=False)
              for name in ("train", "held_out")]
    assert sorted(s.tolist() for half in halves for s in half) == sorted(s.tolist() for s in everything)
    capped = build_token_dataset(embedded_tokenizer, fraction=0.0, max_tokens=20, limit=2, path=sharegpt_file)
    assert [s.tolist() for s in capped] == [s.tolist()[:20] for s in everything][:2]
    assert "tokenizing train" in capsys.readouterr().err
    too_short = build_token_dataset(embedded_tokenizer, max_tokens=data.MIN_TOKENS - 1, fraction=0.0,
                                    path=sharegpt_file, progress=False)
    assert len(too_short) == 0 and too_short.meta["conversations"] == 4
    with pytest.raises(ValueError, match="split"):
        build_token_dataset(embedded_tokenizer, "test", path=sharegpt_file)


def test_a_tokenizer_that_splits_digits_otherwise_is_another_tokenizer_to_the_cache(embedded_tokenizer):
    """The same vocabulary and template split otherwise (as the embedded target's did before 2026-11-29) is another
    fingerprint, so a kept dataset is built anew; the same tokenizer loaded again is the same."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    again, other = (AutoTokenizer.from_pretrained(embedded_tokenizer.name_or_path) for _ in range(2))
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert other.get_vocab() == embedded_tokenizer.get_vocab()
    assert data._tokenizer_fingerprint(again) == data._tokenizer_fingerprint(embedded_tokenizer)
    assert data._tokenizer_fingerprint(other) != data._tokenizer_fingerprint(embedded_tokenizer)


def test_cached_token_dataset_builds_once(sharegpt_file, embedded_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path / "cache"))
    kwargs = {"fraction": 0.0, "max_tokens": 64, "path": sharegpt_file, "progress": False}
    built = cached_token_dataset(embedded_tokenizer, "tiny", **kwargs)
    assert [p.name for p in (tmp_path / "cache" / "data").iterdir()] == ["tiny.npz"]

    def no_render(*args, **kwargs):
        raise AssertionError("should have loaded the cached file")

    monkeypatch.setattr(data, "render", no_render)
    loaded = cached_token_dataset(embedded_tokenizer, "tiny", **kwargs)
    assert [s.tolist() for s in loaded] == [s.tolist() for s in built] and len(loaded) == 4
    with pytest.raises(ValueError, match="other settings"):
        cached_token_dataset(embedded_tokenizer, "tiny", **(kwargs | {"max_tokens": 128}))
    with pytest.raises(TypeError, match="unknown"):
        cached_token_dataset(embedded_tokenizer, "tiny", max_token=64)


@pytest.mark.embedded
def test_real_sharegpt_file_recovers_its_conversations():
    stats = ReadStats()
    conversations = list(read_sharegpt(stats=stats))
    assert stats.records > 17_000 and len(conversations) == stats.kept > 17_000
    assert stats.broken_tail_chars > 0  # the packaged file is cut off
    assert all(c.messages and c.messages[-1]["role"] == "assistant" for c in conversations)
    train, held_out = split(conversations)
    assert 0.01 < len(held_out) / len(conversations) < 0.03
    assert prompts(held_out, 5) and all(isinstance(p, str) and p.strip() for p in prompts(held_out, 5))
