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
