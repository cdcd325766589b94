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


def test_each_push_decodes_only_the_newest_tokens(tokenizer):
    """A long answer streams as decoding it whole reads, in chunks of any size, while each push decodes a window
    of the newest tokens, not the whole answer again (which grew quadratically with the answer's length)."""
    text = ("Héllo, wörld! 東京 is big 🎉 and so on. " * 8 + "def f(x):\n    return x ** 2  # ok\n" * 8) * 3
    ids = tokenizer(text)["input_ids"]
    decoded = []
    original = tokenizer.decode

    class Counting:  # the tokenizer, recording how many ids each decode reads
        def decode(self, tokens, **options):
            decoded.append(len(tokens))
            return original(tokens, **options)

    stream = TextStream(Counting())
    shown, start, size = "", 0, 1
    while start < len(ids):
        shown += stream.push(ids[start: start + size])
        start, size = start + size, size % 4 + 1
    shown += stream.finish()
    assert shown == stream.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 400 and max(decoded[:-1]) <= 16  # (the last decode is finish's, of everything once)


def test_a_sentencepiece_style_tokenizer_streams_its_leading_spaces():
    """A Metaspace decoder (Llama's, SentencePiece's) drops a text's first leading space: decoded alone, a window
    of the newest tokens would lose the space between words, so each is decoded after the tokens before it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample = "The quick brown fox, Héllo wörld 東京 🎉 is big. "
    model = Tokenizer(models.Unigram())
    model.normalizer = normalizers.Replace(" ", "▁")
    model.pre_tokenizer, model.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    model.train_from_iterator([sample] * 50, trainers.UnigramTrainer(vocab_size=120, special_tokens=["<unk>"],
                                                                     unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    ids = tokenizer(sample * 5)["input_ids"]
    # the hazard is real here: tokens decoded one by one lose the spaces between words
    assert "".join(tokenizer.decode([i]) for i in ids) != tokenizer.decode(ids, skip_special_tokens=True)
    for size in (1, 2, 3):
        stream = TextStream(tokenizer)
        shown = "".join(stream.push(ids[i: i + size]) for i in range(0, len(ids), size)) + stream.finish()
        assert shown == tokenizer.decode(ids, skip_special_tokens=True)
