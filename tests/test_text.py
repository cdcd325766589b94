import pytest

from fuzzyspec.text import TextStream


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


def feed_one_by_one(stream, ids):
    return "".join(stream.push([i]) for i in ids) + stream.finish()


def test_streaming_reassembles_the_text(tokenizer):
    text = "Héllo, wörld! 東京 is big 🎉 and so on."
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer)
    assert feed_one_by_one(stream, ids) == tokenizer.decode(ids) == stream.text


def test_incomplete_characters_are_held_back(tokenizer):
    ids = tokenizer("🎉")["input_ids"]
    assert len(ids) > 1  # an emoji spans several byte tokens
    stream = TextStream(tokenizer)
    assert all("\ufffd" not in stream.push([i]) for i in ids)
    assert stream.text == "🎉"


def test_stop_string_cuts_the_text(tokenizer):
    ids = tokenizer("The answer is 42. Question: next")["input_ids"]
    stream = TextStream(tokenizer, stop=["Question:"])
    shown = ""
    for i in ids:
        shown += stream.push([i])
        if stream.stopped:
            break
    assert stream.stopped and shown == stream.text == "The answer is 42. "
    assert stream.push(ids) == "" and stream.finish() == ""


def test_a_partial_stop_string_is_not_shown_early(tokenizer):
    stream = TextStream(tokenizer, stop=["STOP"])
    shown = stream.push(tokenizer("go ST")["input_ids"])
    assert "ST" not in shown
    assert stream.finish() == "ST"  # no stop came: the held text is released at the end
