import pytest
import torch

from fuzzyspec.api import ModelPair
from fuzzyspec.loading import LoadError, load_model, resolve_dtype, self_draft, shared_vocab_size


def test_self_draft_shares_weights_and_runs(target):
    draft = self_draft(target, 1)
    assert len(draft.model.layers) == 1
    assert draft.model.layers[0] is target.model.layers[0]
    assert draft.lm_head.weight is target.lm_head.weight
    with torch.no_grad():
        logits = draft(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, target.config.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(LoadError):
        self_draft(target, 2)


def test_padding_rows_are_fine(tiny_dirs):
    target, tokenizer = load_model(tiny_dirs["target"], dtype="float32")
    padded, _ = load_model(tiny_dirs["draft"], dtype="float32")
    padded.resize_token_embeddings(len(tokenizer) + 64)  # unused padding rows
    assert shared_vocab_size(target, [padded.get_output_embeddings().weight.shape[0]], tokenizer) == len(tokenizer)


def test_pair_generates_with_chat_template(tiny_dirs):
    pair = ModelPair.load(tiny_dirs["target"], tiny_dirs["draft"], dtype="float32")
    assert pair.target.dtype == torch.float32
    chat = pair.encode("hello")
    plain = pair.encode("hello", chat=False)
    assert chat.shape[1] > plain.shape[1]  # the template wraps the message
    pieces = []
    result = pair.generate("hello", method="sd", max_new_tokens=9, on_text=pieces.append)
    assert "".join(pieces) == result.text
    assert result.stats.new_tokens == len(result.tokens) <= 9
    assert result.finish_reason in ("stop", "length")


def test_dtype_choice():
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "cpu") in (torch.bfloat16, torch.float32)
    with pytest.raises(LoadError):
        resolve_dtype("int3", "cpu")
