import pytest
import torch

from fuzzyspec.drafters.draftlm import self_draft


def test_self_draft_shares_weights_and_runs(target):
    draft = self_draft(target, 1)
    assert len(draft.model.layers) == 1
    assert draft.model.layers[0] is target.model.layers[0]
    assert draft.lm_head.weight is target.lm_head.weight
    with torch.no_grad():
        logits = draft(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, target.config.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="between 1 and 1 layers"):
        self_draft(target, 2)


def test_layers_made_without_their_random_start_keep_what_they_hold_and_torch_gets_its_initialisers_back():
    """A loader that fills every weight skips the random start (``no_random_start``): an initialiser leaves its
    tensor as it is meanwhile, also if the loading fails, and does its work again after."""
    from fuzzyspec.drafters.draftlm import INITIALISERS, no_random_start

    before = {name: getattr(torch.nn.init, name) for name in INITIALISERS}
    with pytest.raises(ValueError), no_random_start():
        held = torch.full((4, 4), 7.0)
        torch.nn.init.kaiming_uniform_(held)
        torch.nn.init.normal_(held)
        assert torch.equal(held, torch.full((4, 4), 7.0))
        raise ValueError("a weight is missing")
    assert {name: getattr(torch.nn.init, name) for name in INITIALISERS} == before
    torch.nn.init.normal_(held)
    assert not torch.equal(held, torch.full((4, 4), 7.0))
