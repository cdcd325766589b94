import numpy as np
import pytest
import torch

from fuzzyspec.core.vocab import DraftVocab, most_frequent, reduced_lm_head, token_counts


def test_maps_round_trip_in_the_eagle3_convention():
    vocab = DraftVocab(torch.tensor([1, 4, 5, 9]), 12)
    maps = vocab.maps()
    assert maps["d2t"].tolist() == [1, 3, 3, 6]  # target id = draft id + d2t
    assert maps["t2d"].nonzero().flatten().tolist() == [1, 4, 5, 9]
    again = DraftVocab.from_maps(maps["d2t"], maps["t2d"])
    assert again.target_ids.tolist() == [1, 4, 5, 9] and again.target_size == 12
    with pytest.raises(ValueError, match="disagree"):
        DraftVocab.from_maps(maps["d2t"], torch.zeros(12, dtype=torch.bool))


def test_expand_and_restrict():
    vocab = DraftVocab(torch.tensor([0, 2, 3]), 5)
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    torch.testing.assert_close(vocab.expand(probs), torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]]))
    logits = vocab.expand(torch.tensor([1.0, 2.0, 3.0]), float("-inf"))
    assert logits.softmax(-1)[[1, 4]].tolist() == [0.0, 0.0]
    assert vocab.restrict(torch.arange(5.0)).tolist() == [0.0, 2.0, 3.0]
    assert vocab.to_target(torch.tensor([[2, 0]])).tolist() == [[3, 0]]


def test_the_ids_are_copied_to_another_device_once():
    """Drafting maps ids at every tree level; a copy from host memory to a GPU each time would wait for the device."""
    vocab = DraftVocab(torch.tensor([1, 4, 6]), 8)
    meta = torch.device("meta")
    assert vocab.ids_on(torch.device("cpu")) is vocab.target_ids
    assert vocab.ids_on(meta).device == meta and vocab.ids_on(meta) is vocab.ids_on(meta)
    assert vocab.to_target(torch.tensor([[2, 0]])).tolist() == [[6, 1]]


@pytest.mark.parametrize("ids, size", [([], 4), ([2, 1], 4), ([1, 1], 4), ([0, 4], 4), ([-1, 2], 4)])
def test_bad_vocabularies(ids, size):
    with pytest.raises(ValueError):
        DraftVocab(torch.tensor(ids, dtype=torch.long), size)


def test_most_frequent_keeps_the_forced_tokens_and_breaks_ties_by_id():
    counts = token_counts([np.array([3, 3, 3, 1, 1, 2, 5]), np.array([5, 2])], 7)
    assert counts.tolist() == [0, 2, 2, 3, 0, 2, 0]
    assert most_frequent(counts, 3).target_ids.tolist() == [1, 2, 3]  # 3, then 1 and 2 before 5 (ties)
    assert most_frequent(counts, 3, always=[6]).target_ids.tolist() == [1, 3, 6]
    with pytest.raises(ValueError):
        most_frequent(counts, 0)
    vocab = most_frequent(counts, 2)
    assert vocab.coverage([3, 1, 1, 5]) == 0.75


def test_reduced_lm_head_is_the_targets_rows():
    full = torch.nn.Linear(4, 6, bias=False)
    vocab = DraftVocab(torch.tensor([1, 5]), 6)
    head = reduced_lm_head(full, vocab)
    x = torch.randn(3, 4)
    torch.testing.assert_close(head(x), full(x)[:, [1, 5]])
    assert not head.weight.requires_grad
