import pytest
import torch

from fuzzyspec.eval.quality import first_difference, greedy_agreement, target_nll


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([5], [1]) == 0
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert greedy_agreement([1, 2], [1, 2]) == {"exact_match": 1.0, "first_diff": 2.0}
    assert greedy_agreement([1, 3], [1, 2]) == {"exact_match": 0.0, "first_diff": 1.0}


def test_target_nll_matches_a_manual_computation(target):
    prompt, tokens = torch.tensor([[1, 5, 9]]), [4, 7, 7, 2]
    with torch.no_grad():
        logits = target(torch.tensor([[1, 5, 9, 4, 7, 7]])).logits[0, 2:]
    expected = -torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(tokens)].mean()
    assert target_nll(target, prompt, tokens) == pytest.approx(float(expected), rel=1e-5)
    assert target_nll(target, prompt, []) is None


def test_the_targets_greedy_text_scores_better_than_other_text(target):
    prompt = torch.tensor([[3, 1, 4]])
    greedy = target.generate(prompt, max_new_tokens=12, do_sample=False)[0, 3:].tolist()
    other = [(t + 7) % 32 for t in greedy]
    assert target_nll(target, prompt, greedy) < target_nll(target, prompt, other)
