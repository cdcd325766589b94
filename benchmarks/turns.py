"""The order in which a benchmark's variants take their turns, prompt after prompt.

A variant can run faster or slower because of the one that ran just before it: caches it left warm or cold,
memory it left to free. ``ab_planner.py`` showed it (2026-11-27): its variants took turns in an order rotated from
prompt to prompt, which keeps every variant behind the same neighbour, and the variant listed last, which always
ran right after another speculative job, decoded 6-7% faster than the same variant listed before it. So the orders
here spread each variant's predecessors instead: across the whole run, every variant runs after every variant
(itself included, across a prompt's boundary) about equally often.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

Variant = TypeVar("Variant")


def balanced_turns(variants: Sequence[Variant], rounds: int) -> list[list[Variant]]:
    """``rounds`` orders of ``variants``, one a prompt, each variant once in each, that run every variant after
    every other about equally often over the whole run (a first-order carryover balance, built greedily: each next
    variant is the one that has followed the previous variant least so far; ties go to the order rotated by the
    round). Deterministic."""
    count = len(variants)
    followed = [[0] * count for _ in range(count)]  # followed[a][b]: how often b ran right after a
    previous: int | None = None
    orders = []
    for round_ in range(rounds):
        left = list(range(count))
        order = []
        while left:
            chosen = min(left, key=lambda v: (followed[previous][v] if previous is not None else 0,
                                              (v - round_) % count))
            if previous is not None:
                followed[previous][chosen] += 1
            left.remove(chosen)
            order.append(variants[chosen])
            previous = chosen
        orders.append(order)
    return orders
