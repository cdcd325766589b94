import math

import pytest
import torch

from fuzzyspec.core.divergences import divergence
from fuzzyspec.train.objectives import LOSSES, distill_loss, loss_mask
from fuzzyspec.core.vocab import DraftVocab


def random_pair(seed, v=12):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(5, v, generator=g) * 2).softmax(-1)
    logits = torch.randn(5, v, generator=g) * 2
    return p, logits


@pytest.mark.parametrize("name", ["tv", "js"])
def test_pooled_losses_equal_the_divergence_over_the_whole_vocabulary(name):
    """With a reduced draft vocabulary, TV and JS computed on its N tokens plus one pooled bin equal the
    divergence between p and the zero-extended q over all V tokens: the loss is the judge."""
    p, logits = random_pair(0)
    vocab = DraftVocab(torch.tensor([0, 3, 4, 7, 10]), 12)
    log_q = vocab.restrict(logits).log_softmax(-1)
    q_full = vocab.expand(log_q.exp())
    expected = divergence(p, q_full, name)
    torch.testing.assert_close(distill_loss(name, vocab.restrict(p), log_q), expected, rtol=1e-4, atol=1e-5)


def test_ce_is_kl_plus_the_targets_entropy_on_a_full_vocabulary():
    p, logits = random_pair(1)
    log_q = logits.log_softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(distill_loss("ce", p, log_q) - entropy, divergence(p, log_q.exp(), "kl_pq"))


@pytest.mark.parametrize("name", LOSSES)
def test_losses_are_smallest_at_the_target_and_have_gradients(name):
    p, logits = random_pair(2)
    logits.requires_grad_(True)
    loss = distill_loss(name, p, logits.log_softmax(-1)).mean()
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    at_target = distill_loss(name, p, p.log()).mean()
    assert at_target < loss
    if name != "ce":
        assert at_target.abs() < 1e-5


def test_js_has_no_nan_where_q_underflows():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    log_q = torch.tensor([[0.0, -200.0, -1e4]]).log_softmax(-1)
    assert torch.isfinite(distill_loss("js", p, log_q)).all()
    assert distill_loss("js", p, log_q).item() <= math.log(2) + 1e-6


def test_loss_mask_covers_the_answer_only():
    lengths, loss_from = torch.tensor([6, 4]), torch.tensor([3, 0])
    # Entry t reads the distribution at r = t + 1, which predicts token r + 1.
    mask = loss_mask(lengths, loss_from, 6, 1)
    assert mask.int().tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError):
        distill_loss("kl", torch.ones(1, 2) / 2, torch.zeros(1, 2))
