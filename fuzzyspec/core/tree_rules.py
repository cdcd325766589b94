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
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .draft import Draft
from .sampling import sample


def walk(rule: str, tree: Draft, p: Tensor, d: Any, threshold: float, greedy: bool,
         generator: torch.Generator | None = None, argmax: list[int] | None = None,
         tokens: list[int] | None = None) -> tuple[list[int], int]:
    """Apply ``rule`` (``sd``, ``fsd`` or ``fsd-hybrid``) down ``tree``; see the module docstring. ``d``: None
    for ``sd``, else anything whose ``d[row]`` is D at that row (a tensor, or values computed when first read).
    ``argmax`` (p's argmax at every row) and ``tokens`` (the tree's tokens), when given as host lists, spare
    the walk its reads of the device: greedy ``sd`` then reads nothing else."""
    if rule not in ("sd", "fsd", "fsd-hybrid"):
        raise ValueError(f"unknown tree rule {rule!r}")
    children = tree.children
    tokens = tree.tokens.tolist() if tokens is None else tokens
    path: list[int] = []
    row = 0
    while True:
        p_u, kids = p[row], children[row]
        best = (argmax[row] if argmax is not None else int(p_u.argmax())) if greedy else None
        if not kids:
            return path, best if greedy else int(sample(p_u, generator))
        choice, residual = None, p_u
        if rule != "fsd":
            if greedy:
                choice = next((kid for kid in kids if tokens[kid] == best), None)
            else:
                residual = p_u.clone()
                for kid in kids:
                    mass = residual.sum()
                    u = torch.rand((), generator=generator, device=p_u.device)
                    if u * mass < residual[tokens[kid]]:
                        choice = kid
                        break
                    residual[tokens[kid]] = 0
        if choice is None and rule != "sd" and float(d[row]) <= threshold and (threshold > 0 or rule == "fsd"):
            choice = max(kids, key=lambda kid: float(p_u[tokens[kid]]))
        if choice is None:
            if greedy:
                return path, best
            return path, int(sample(residual if residual.sum() > 0 else p_u, generator))
        path.append(choice)
        row = choice + 1
