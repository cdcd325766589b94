"""Acceptance rules on draft trees: walk down from the root, one node at a time.

Rows of ``p`` ([n + 1, V]): row 0 is the root (the newest accepted token), row
i + 1 is tree node i; ``p[r]`` is the target's distribution of the token after
row r. The draft's children of row r were chosen deterministically (EAGLE-2
takes the top-k tokens of the draft's q[r], so they are distinct), and
``d[r]`` = D(p[r], q[r]).

At a row u with drafted children c_1..c_m (in drafting order):

- ``sd`` (exact): test the children in turn against a residual r, starting at
  r = p_u: accept c_j with probability r(c_j) / sum(r); on rejection set
  r(c_j) = 0. If none is accepted, emit a draw from r. This is recursive
  rejection sampling with each child's draft distribution a point mass on it
  (the right q for a deterministic top-k choice): P(c_1) = p_u(c_1),
  P(c_2) = (1 - p_u(c_1)) p_u(c_2) / (1 - p_u(c_1)) = p_u(c_2), and so on, so the
  emitted token is distributed exactly as p_u: lossless.
  Greedy: move to the child equal to argmax p_u, else emit argmax p_u.
- ``fsd``: if D(p_u, q_u) <= T accept the child the target rates highest,
  argmax_j p_u(c_j); otherwise emit a draw from p_u (argmax p_u in greedy mode).
- ``fsd-hybrid``: the exact test first; if it accepts no child and
  D(p_u, q_u) <= T, accept the child the target rates highest; otherwise emit a
  draw from the exact test's residual. It draws the same random numbers as
  ``sd``, so at T = 0 (D = 0 only when p_u = q_u) it is exactly ``sd``.

A row with no children is a leaf: the walk emits a draw from p_u there (the
bonus token). Every rule returns (path, token): the accepted node indices from
the root's child down, and the token emitted after them.

A row's exact test depends on nothing but that row (p_u, its children, fresh
random numbers), so sampled ``sd`` and ``fsd-hybrid`` run it at every row of
the tree at once (``exact_tests``, ``decide_exactly``), ahead of the walk, which
then follows the decisions: the device is read once, not at every level. The
rows a path visits use random numbers no other visited row uses, so the output
is distributed as a test made row by row along the path.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .draft import Draft
from .host import upload
from .sampling import sample


def walk(rule: str, tree: Draft, p: Tensor, d: Any, threshold: float, greedy: bool,
         generator: torch.Generator | None = None, argmax: list[int] | None = None,
         tokens: list[int] | None = None, decisions: list[int] | None = None) -> tuple[list[int], int]:
    """Apply ``rule`` (``sd``, ``fsd`` or ``fsd-hybrid``) down ``tree``; see the module docstring. ``d``: None
    for ``sd``, else anything whose ``d[row]`` is D at that row (a tensor, or values computed when first read).
    Sampled ``sd`` and ``fsd-hybrid`` take every row's exact test from ``decide_exactly`` (``decisions``, its
    values as a host list; made and read here when not given), so that the two draw the same random numbers.
    ``argmax`` (p's argmax at every row) and ``tokens`` (the tree's tokens), when given as host lists, spare
    the walk its reads of the device: greedy and sampled ``sd`` then read nothing else."""
    if rule not in ("sd", "fsd", "fsd-hybrid"):
        raise ValueError(f"unknown tree rule {rule!r}")
    exact = rule != "fsd" and not greedy
    if exact and decisions is None:
        decisions = decide_exactly(tree, p, generator).tolist()
    children, rows = tree.children, len(tree) + 1
    tokens = tree.tokens.tolist() if tokens is None else tokens
    path: list[int] = []
    row = 0
    while True:
        p_u, kids = p[row], children[row]
        best = (argmax[row] if argmax is not None else int(p_u.argmax())) if greedy else None
        choice = None
        if rule != "fsd" and kids:
            if greedy:
                choice = next((kid for kid in kids if tokens[kid] == best), None)
            elif decisions[row] >= 0:
                choice = kids[decisions[row]]
        if (choice is None and kids and rule != "sd" and float(d[row]) <= threshold
                and (threshold > 0 or rule == "fsd")):
            choice = max(kids, key=lambda kid: float(p_u[tokens[kid]]))
        if choice is None:  # the bonus token at a leaf, else a draw from the exact test's residual, or from p_u
            if greedy:
                return path, best
            return path, decisions[rows + row] if exact else int(sample(p_u, generator))
        path.append(choice)
        row = choice + 1


def exact_tests(p: Tensor, kid_tokens: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """SD's test of each row's children, for many rows at once: ``p`` [R, V], ``kid_tokens`` [R, m] the
    children's (distinct) tokens in drafting order, -1 past a row's last child.

    Child j is accepted with probability p(c_j) / (total - p(c_1) - ... - p(c_{j-1})), the first accepted
    wins; that is the residual test of the module docstring, with the residual's mass written out. Returns
    (``choice`` [R]: the accepted child's position, -1 where none is; ``residual`` [R, V]: p with every
    child's token zeroed, or p itself where that leaves nothing, to draw from where none is accepted)."""
    valid = kid_tokens >= 0
    index = kid_tokens.clamp(min=0)
    mass = p.gather(1, index) * valid
    left = p.sum(1, keepdim=True) - (mass.cumsum(1) - mass)
    u = torch.rand(kid_tokens.shape, generator=generator, device=p.device)
    accepted = valid & (u * left < mass)
    choice = torch.where(accepted.any(1), accepted.int().argmax(1), -1)
    # scatter_add: padding and a child may share an index, and adding zero there changes nothing
    tested = torch.zeros_like(p).scatter_add_(1, index, valid.to(p.dtype))
    residual = p.masked_fill(tested > 0, 0)
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)
    return choice, residual


def kids_matrix(tree: Draft) -> Tensor:
    """[n + 1, m] on the host: row r's children as node indices in drafting order, -1 past the last."""
    children = tree.children
    width = max(map(len, children))
    return torch.tensor([kids + [-1] * (width - len(kids)) for kids in children], dtype=torch.long)


def kids_on_device(parents: Tensor, breadth: int) -> Tensor:
    """``kids_matrix`` of a tree whose ``parents`` [n] are on the device (a tree grown there), made there: [n + 1,
    ``breadth``], the most children a node may have."""
    n = parents.shape[0]
    rows = parents + 1
    # a node's place among its parent's children: how many earlier nodes share its parent
    same = torch.nn.functional.one_hot(rows, n + 1)
    place = (same.cumsum(0) * same).sum(1) - 1
    kids = torch.full((n + 1, breadth), -1, dtype=torch.long, device=parents.device)
    kids[rows, place] = torch.arange(n, device=parents.device)
    return kids


def decide_exactly(tree: Draft, p: Tensor, generator: torch.Generator | None) -> Tensor:
    """The exact test at every row of ``tree`` at once, on the device: [2 (n + 1)], the accepted child's
    position at each row (-1: none), then the token drawn from the row's residual (what is emitted there if
    none is accepted; at a leaf, a draw from p). ``walk`` follows them from the root."""
    # (a tree grown on the device: its children made there, whether or not the host has read its shape, so that
    # every rule that tests them draws the same random numbers)
    kids = upload(kids_matrix(tree), p.device) if tree.grown is None else kids_on_device(tree.grown.parents,
                                                                                          tree.grown.breadth)
    kid_tokens = torch.where(kids >= 0, tree.tokens[kids.clamp(min=0)], -1)
    choice, residual = exact_tests(p, kid_tokens, generator)
    return torch.cat([choice, sample(residual, generator)])
