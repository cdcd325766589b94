"""Drawing tokens: the target's distribution exactly, never a token it gives no probability."""
import torch

from fuzzyspec.core.sampling import argmax, sample


def test_draws_follow_the_distribution_and_skip_zero_probabilities():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    draws = sample(probs.expand(200_000, 6).contiguous(), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=6) / draws.numel()
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(counts, probs, atol=0.005)


def test_shapes_and_unnormalised_rows():
    generator = torch.Generator().manual_seed(1)
    assert sample(torch.tensor([0.0, 0.0, 3.0]), generator).shape == ()
    assert sample(torch.tensor([[[0.0, 2.0], [5.0, 0.0]]]), generator).tolist() == [[1, 0]]


def test_a_uniform_that_rounds_up_to_the_total_draws_the_last_possible_token(monkeypatch):
    """u * total can round to total: the draw is then the last token of positive probability, not one past
    it (or a zero-probability token after it)."""
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.full(args[0], 1.0, dtype=torch.float64))
    assert sample(torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.1, 0.0, 0.0, 0.9]]), None).tolist() == [1, 3]


def test_argmax_is_torchs_first_maximum_for_every_float_and_shape():
    torch.manual_seed(0)
    wide = torch.randn(3, 4, 70)
    cases = [wide, wide[..., :64], wide[:, 1], wide[0, 0], wide.bfloat16(), wide.half(), wide.double()]
    ties = torch.zeros(2, 9)
    ties[0, [2, 5]] = 1.0  # equal maxima: the first is taken
    nan = torch.randn(2, 9)
    nan[1, [3, 6]] = float("nan")  # a NaN counts as the largest, the first of them
    for logits in cases + [ties, nan, torch.full((5,), float("-inf"))]:
        picked = argmax(logits)
        assert picked.dtype == torch.long and picked.shape == logits.shape[:-1]
        assert torch.equal(picked, logits.argmax(-1))
    assert argmax(ties).tolist() == [2, 0] and argmax(nan)[1] == 3
