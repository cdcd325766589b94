import math

import pytest
import torch

from fuzzyspec.core.divergences import divergence
from fuzzyspec.core.tree_rules import exact_tests, walk
from fuzzyspec.core.draft import Draft as Tree
from stats_util import chi_square_p_value

V = 6
#   root -> children tokens 2, 0, 4 (nodes 0, 1, 2); node 0 -> children tokens 1, 3 (nodes 3, 4)
TREE = Tree(tokens=torch.tensor([2, 0, 4, 1, 3]), parents=torch.tensor([-1, -1, -1, 0, 0]))


def dists(seed):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(6, V, generator=g) * 1.5).softmax(-1)
    q = (torch.randn(6, V, generator=g) * 1.5).softmax(-1)
    return p, q


def test_exact_tree_sampling_is_lossless():
    """First token ~ p_root, and the token after node 0 (token 2) ~ p at node 0, whatever the tree (every
    row's test decided ahead of the walk, which follows the decisions)."""
    p, q = dists(0)
    g = torch.Generator().manual_seed(1)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(20_000):
        path, token = walk("sd", TREE, p, None, 0.0, False, g)
        out = [int(TREE.tokens[i]) for i in path] + [token]
        first[out[0]] += 1
        if out[0] == 2:
            second[out[1]] += 1
    assert chi_square_p_value(first, p[0]) > 1e-3
    assert chi_square_p_value(second, p[1]) > 1e-3


def test_exact_tests_of_many_rows():
    """A child of probability 1 is always accepted, one of probability 0 never; a row whose children hold all
    of p draws from p itself where none is accepted; -1 marks the end of a row's children."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.6, 0.4]])
    kid_tokens = torch.tensor([[0, 1], [1, -1], [1, 2]])
    choice, residual = exact_tests(p, kid_tokens, torch.Generator().manual_seed(0))
    assert choice[:2].tolist() == [1, -1]
    assert residual[1].tolist() == [0.5, 0.0, 0.5]
    residual = exact_tests(p[2:], torch.tensor([[-1, -1]]), None)[1]
    assert residual.tolist() == p[2:].tolist()


def test_greedy_walk_follows_the_targets_argmax():
    p = torch.full((6, V), 0.01)
    p[0, 2] = p[1, 3] = p[5, 5] = 1.0  # root wants 2 (node 0), node 0 wants 3 (node 4), node 4 wants 5
    p = p / p.sum(-1, keepdim=True)
    assert walk("sd", TREE, p, None, 0.0, True) == ([0, 4], 5)
    p[0] = torch.tensor([0.1, 0.1, 0.1, 0.5, 0.1, 0.1])  # the root wants 3: not drafted
    assert walk("sd", TREE, p, None, 0.0, True) == ([], 3)


def test_fsd_accepts_the_child_the_target_rates_highest():
    p, q = dists(2)
    d = divergence(p, q, "tv")
    path, token = walk("fsd", TREE, p, d, math.inf, True)
    best_root_child = max([0, 1, 2], key=lambda k: p[0, TREE.tokens[k]])
    assert path[0] == best_root_child
    assert walk("fsd", TREE, p, d, 0.0, True) == ([], int(p[0].argmax()))  # T = 0: nothing accepted


def test_hybrid_at_zero_is_exact_under_one_seed():
    p, q = dists(3)
    d = divergence(p, q, "js")
    for seed in range(200):
        exact = walk("sd", TREE, p, d, 0.0, False, torch.Generator().manual_seed(seed))
        hybrid = walk("fsd-hybrid", TREE, p, d, 0.0, False, torch.Generator().manual_seed(seed))
        assert exact == hybrid


def test_infinite_threshold_walks_to_a_leaf():
    p, q = dists(4)
    d = divergence(p, q, "js")
    for rule in ("fsd", "fsd-hybrid"):
        path, _ = walk(rule, TREE, p, d, math.inf, False, torch.Generator().manual_seed(0))
        assert path and path[-1] in (1, 2, 3, 4)  # nodes without children


def test_unknown_rule():
    p, q = dists(5)
    with pytest.raises(ValueError):
        walk("beam", TREE, p, None, 0.0, True)
