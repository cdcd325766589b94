import math

import pytest
import torch

from fuzzyspec.core.divergences import divergence
from fuzzyspec.core.rules import RULES, fsd, fsd_hybrid, leading_accepted, sd
from stats_util import chi_square_p_value

V = 6


def random_dists(batch, k, seed, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(batch, k + 1, V, generator=g) * sharp).softmax(-1)
    q = (torch.randn(batch, k, V, generator=g) * sharp).softmax(-1)
    return p, q, g


def draw(q, g):
    return torch.multinomial(q.reshape(-1, V), 1, generator=g).view(q.shape[:-1])


def test_leading_accepted():
    accept = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert leading_accepted(accept).tolist() == [2, 0, 4]
    assert leading_accepted(torch.ones(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


@pytest.mark.parametrize("position", [0, 1])
def test_sd_emits_the_target_distribution(position):
    """Lossless: the token emitted at each position is distributed as p there,
    whatever the draft (chi-square, 200k rows; p and q the same for every row)."""
    rows, k = 200_000, 2
    p1, q1, g = random_dists(1, k, seed=3)
    p, q = p1.expand(rows, -1, -1).contiguous(), q1.expand(rows, -1, -1).contiguous()
    tokens = draw(q, g)
    accepted, nxt = sd(tokens, p, q, None, 0.0, False, g)
    out = torch.cat([tokens, nxt[:, None]], 1)
    # Position ``position`` exists in the output when at least ``position`` drafts were accepted.
    reached = accepted >= position
    emitted = torch.where(accepted == position, nxt, out[:, position])[reached]
    counts = torch.bincount(emitted, minlength=V)
    assert chi_square_p_value(counts, p1[0, position]) > 1e-3
    # And the draft really was rejected sometimes, so the residual path was exercised.
    assert 0 < (accepted == 0).float().mean() < 1


def test_greedy_rules():
    p = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]])
    q = torch.tensor([[[0.1, 0.8, 0.1], [0.2, 0.7, 0.1]]])
    tokens = torch.tensor([[1, 1]])
    d = divergence(p[:, :2], q, "tv")  # [0.1, 0.4]
    accepted, nxt = sd(tokens, p, q, None, 0.0, True)
    assert (accepted.item(), nxt.item()) == (1, 0)  # second draft != argmax p_2 = 0
    accepted, nxt = fsd(tokens, p, q, d, 0.5, True)
    assert (accepted.item(), nxt.item()) == (2, 2)  # both D <= 0.5: bonus argmax p_3
    accepted, nxt = fsd(tokens, p, q, d, 0.05, True)
    assert (accepted.item(), nxt.item()) == (0, 1)  # D_1 = 0.1 > T: argmax p_1
    accepted, nxt = fsd_hybrid(tokens, p, q, d, 0.45, True)
    assert (accepted.item(), nxt.item()) == (2, 2)


def test_fsd_infinite_threshold_accepts_everything():
    p, q, g = random_dists(64, 5, seed=4)
    tokens = draw(q, g)
    d = divergence(p[:, :5], q, "kl_pq")
    accepted, _ = fsd(tokens, p, q, d, math.inf, False, g)
    assert (accepted == 5).all()


@pytest.mark.parametrize("rule", ["fsd", "fsd-hybrid"])
@pytest.mark.parametrize("greedy", [True, False])
def test_acceptance_never_falls_as_threshold_rises(rule, greedy):
    p, q, g = random_dists(512, 5, seed=5)
    tokens = draw(q, g)
    d = divergence(p[:, :5], q, "js")
    previous = None
    for threshold in [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, math.inf]:
        accepted, _ = RULES[rule](tokens, p, q, d, threshold, greedy, torch.Generator().manual_seed(9))
        if previous is not None:
            assert (accepted >= previous).all()
        previous = accepted
    assert (previous == 5).all()


def test_hybrid_at_zero_is_sd_under_one_seed():
    p, q, g = random_dists(4096, 4, seed=6)
    tokens = draw(q, g)
    d = divergence(p[:, :4], q, "kl_qp")
    a_sd, t_sd = sd(tokens, p, q, d, 0.0, False, torch.Generator().manual_seed(11))
    a_hy, t_hy = fsd_hybrid(tokens, p, q, d, 0.0, False, torch.Generator().manual_seed(11))
    assert torch.equal(a_sd, a_hy) and torch.equal(t_sd, t_hy)


def test_fsd_rejection_samples_from_p_not_the_residual():
    # A drafted token the target likes a lot, with a draft even more sure of it: the residual
    # puts zero mass on it, p does not. FSD (T = 0, always rejecting) must still emit it sometimes.
    rows = 20_000
    p = torch.tensor([0.6, 0.4]).expand(rows, 2, 2).contiguous()
    q = torch.tensor([1.0, 0.0]).expand(rows, 1, 2).contiguous()
    tokens = torch.zeros(rows, 1, dtype=torch.long)
    d = torch.ones(rows, 1)
    g = torch.Generator().manual_seed(0)
    accepted, nxt = fsd(tokens, p, q, d, 0.0, False, g)
    assert (accepted == 0).all()
    assert abs((nxt == 0).float().mean().item() - 0.6) < 0.02
    accepted, nxt = sd(tokens, p, q, d, 0.0, False, g)
    rejected = accepted == 0
    assert (nxt[rejected] == 1).all()  # the residual max(0, p - q) is all on token 1


def test_zero_drafts_is_a_plain_target_step():
    p, q, g = random_dists(8, 0, seed=7)
    tokens = torch.empty(8, 0, dtype=torch.long)
    for name, rule in RULES.items():
        accepted, nxt = rule(tokens, p, q, torch.empty(8, 0), 0.3, True, g)
        assert (accepted == 0).all() and torch.equal(nxt, p[:, 0].argmax(-1)), name


@pytest.mark.parametrize("position", [0, 1])
def test_sd_with_point_mass_drafts_emits_the_target_distribution(position):
    """A deterministic drafter (q = None: certain of each token) keeps SD exact: accept x with p(x), else
    draw from p without x (chi-square, 200k rows)."""
    rows = 200_000
    p1, _, g = random_dists(1, 2, seed=5)
    p = p1.expand(rows, -1, -1).contiguous()
    tokens = torch.tensor([[2, 4]]).expand(rows, -1).contiguous()
    accepted, nxt = sd(tokens, p, None, None, 0.0, False, g)
    out = torch.cat([tokens, nxt[:, None]], 1)
    reached = accepted >= position
    emitted = torch.where(accepted == position, nxt, out[:, position])[reached]
    assert chi_square_p_value(torch.bincount(emitted, minlength=V), p1[0, position]) > 1e-3
    assert 0 < (accepted == 0).float().mean() < 1


def test_hybrid_at_zero_is_sd_even_where_d_rounds_to_zero():
    """D of nearly equal distributions may round to 0; at T = 0 the hybrid must still be exactly sd."""
    p, q, _ = random_dists(64, 3, seed=9)
    tokens = draw(q, torch.Generator().manual_seed(1))
    d = torch.zeros(64, 3)  # as if every D had rounded to zero
    for greedy in (True, False):
        exact = sd(tokens, p, q, d, 0.0, greedy, torch.Generator().manual_seed(2))
        hybrid = fsd_hybrid(tokens, p, q, d, 0.0, greedy, torch.Generator().manual_seed(2))
        assert all(torch.equal(a, b) for a, b in zip(exact, hybrid))
