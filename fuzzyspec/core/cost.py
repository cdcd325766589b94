"""Cost-aware speculation: how many tokens each row drafts, chosen from what the hardware charges.

A step of B rows that draft g_b tokens each costs a target forward over M = sum(1 + n_b) tokens (n_b: the
nodes g_b drafts give: g_b for a chain, the tree's size for a tree of depth g_b) plus each row's drafting,
and yields sum E_b(g_b) tokens, where a row whose drafts pass depth j with probability a_j (its own running
acceptance) expects

    E(g) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_g          (the target's token, then accepted drafts).

The planner picks every row's g to maximise tokens per second, sum E_b / (T(M) + sum D_b(g_b)), with T
and D from a ``Profile`` of measured times; g = 0 (propose nothing) is always a candidate, so a row for
which speculation does not pay runs as autoregressive decoding: a default job is never slower than AR
by the profile's own measure. The choice is a pure function of the profile and the rows' statistics.

The profile is measured by the engine as it runs (every forward and every drafting is timed) and can be
measured ahead (``fuzzyspec tune``); ``tuning`` keeps it per target, weights, dtype, device, thread count and
compilation. A width never measured is assumed to cost what the nearest measured narrower width costs
(optimism: it gets tried, and after a few measurements their minimum decides), a draft size below every
measured one its share of the smallest measured (drafting nothing costs nothing), and acceptances start from
an optimistic prior that a row's own steps soon outweigh.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .config import tree_nodes

PRIOR_ACCEPTANCE = 0.6  # a_j before a row has data: close to what the shipped drafters reach
PRIOR_WEIGHT = 2.0      # in steps: how soon a row's own data outweighs the prior
MEMORY = 0.95           # a row's counts fade by this per step, so its estimate follows the text it writes
TRIALS = 3              # measurements of a new size before the planner trusts its cost
TARGET = ""             # the target's key among the drafters' (whose keys name a drafter and shape)


@dataclass
class Profile:
    """Measured milliseconds: ``target[m]`` a forward over m tokens (all rows together), ``draft[key][g]`` a
    drafter's proposal of size g (``key`` names the drafter and its shape: chain or tree).

    A size's first ``TRIALS`` measurements are tentative: the planner does not see them (the size stays
    untried to it, so it is tried again) and the size's cost is their minimum, since a shared machine's noise
    only adds time. One slow first measurement had priced a size out for good: the planner re-measures only
    what it runs. Sizes given at construction or loaded are taken as measured."""

    target: dict[int, float] = field(default_factory=dict)
    draft: dict[str, dict[int, float]] = field(default_factory=dict)
    updates: int = 0  # measurements folded in since the profile was loaded
    trials: dict[tuple[str, int], int] = field(default_factory=dict)  # tentative sizes: measurements so far

    def target_ms(self, tokens: int) -> float:
        return _lookup(self._settled(TARGET, self.target), tokens)

    def draft_ms(self, key: str, size: int) -> float:
        # Drafting nothing costs nothing: a size below every measured one is interpolated from zero, not taken
        # at the smallest measured size's cost (once the cap was measured dear, every smaller size looked as
        # dear and was never tried).
        return _lookup({0: 0.0} | self._settled(key, self.draft.get(key, {})), size) if size else 0.0

    def observe_target(self, tokens: int, ms: float) -> None:
        self._observe(TARGET, self.target, tokens, ms)

    def observe_draft(self, key: str, size: int, ms: float) -> None:
        self._observe(key, self.draft.setdefault(key, {}), size, ms)

    def _observe(self, key: str, measured: dict[int, float], size: int, ms: float) -> None:
        self.updates += 1
        count = self.trials.get((key, size), 0 if size not in measured else None)
        if count is None:
            _fold(measured, size, ms)
            return
        measured[size] = min(measured.get(size, ms), ms)
        if count + 1 < TRIALS:
            self.trials[key, size] = count + 1
        else:
            self.trials.pop((key, size), None)

    def _settled(self, key: str, measured: dict[int, float]) -> dict[int, float]:
        return {size: ms for size, ms in measured.items() if (key, size) not in self.trials}

    def to_dict(self) -> dict:
        """The settled measurements (a tentative size is measured anew next time)."""
        return {"target": {str(k): v for k, v in sorted(self._settled(TARGET, self.target).items())},
                "draft": {key: {str(k): v for k, v in sorted(self._settled(key, sizes).items())}
                          for key, sizes in self.draft.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        return cls({int(k): float(v) for k, v in data.get("target", {}).items()},
                   {key: {int(k): float(v) for k, v in sizes.items()} for key, sizes in data.get("draft", {}).items()})


def _lookup(measured: dict[int, float], x: int) -> float:
    """Measured at x, else interpolated between neighbours, else the nearest narrower measurement (an
    untried larger size looks no dearer than a smaller one, so it gets tried); 0 with nothing measured."""
    if x in measured:
        return measured[x]
    below = [k for k in measured if k < x]
    above = [k for k in measured if k > x]
    if below and above:
        lo, hi = max(below), min(above)
        return measured[lo] + (measured[hi] - measured[lo]) * (x - lo) / (hi - lo)
    if below:
        return measured[max(below)]
    return measured[min(above)] if above else 0.0


def _fold(measured: dict[int, float], x: int, ms: float) -> None:
    """A running median-like estimate: new measurements move it by a fraction, outliers by little."""
    old = measured.get(x)
    measured[x] = ms if old is None else old + 0.2 * max(-old / 2, min(old / 2, ms - old))


@dataclass
class Acceptance:
    """A row's running chance that a draft at depth j is accepted given the drafts above it were, with
    fading counts and an optimistic prior."""

    reached: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def rate(self, depth: int) -> float:
        """a_depth (depth 1: the first draft)."""
        i = depth - 1
        reached = self.reached[i] if i < len(self.reached) else 0.0
        passed = self.passed[i] if i < len(self.passed) else 0.0
        return (passed + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)

    def expected(self, size: int) -> float:
        """E(size): tokens a step yields with drafts ``size`` deep."""
        total, chance = 1.0, 1.0
        for depth in range(1, size + 1):
            chance *= self.rate(depth)
            total += chance
        return total

    def record(self, proposed: int, accepted: int) -> None:
        """A step that drafted ``proposed`` deep and kept ``accepted``: depths 1 .. accepted + 1 were reached
        (if drafted), 1 .. accepted passed."""
        self.reached = [value * MEMORY for value in self.reached]
        self.passed = [value * MEMORY for value in self.passed]
        while len(self.reached) < proposed:
            self.reached.append(0.0)
            self.passed.append(0.0)
        for i in range(min(accepted + 1, proposed)):
            self.reached[i] += 1
        for i in range(accepted):
            self.passed[i] += 1


@dataclass(frozen=True)
class Option:
    """What a row can draft at size g: ``nodes(g)`` tokens for the target to check, under ``key``'s costs."""

    key: str
    cap: int                   # the largest g (gamma, or the tree's depth)
    tree: tuple[int, int] | None = None  # (total nodes, children per node) for trees

    def nodes(self, size: int) -> int:
        return tree_nodes(size, *self.tree) if self.tree is not None else size


def plan(options: list[Option], acceptances: list[Acceptance], profile: Profile,
         shape: Callable[[int, int], tuple[int, int]] = lambda width, rows: (width, rows), others: int = 0,
         rounds: int = 3) -> list[int]:
    """Every row's draft size g (0: none) maximising the step's expected tokens per millisecond (see the
    module docstring): each row in turn takes its best g given the others', a few rounds over the rows.
    ``shape(width, rows)``: the padded shape a step of that many tokens per row and rows runs at (every row is
    verified at the widest row's width); ``others``: rows of the step that are not planned here."""
    sizes = [0] * len(options)

    def rate(chosen: list[int]) -> float:
        tokens = others + sum(acceptance.expected(g) for acceptance, g in zip(acceptances, chosen))
        width, rows = shape(1 + max(option.nodes(g) for option, g in zip(options, chosen)), len(options) + others)
        ms = profile.target_ms(width * rows) + sum(profile.draft_ms(option.key, g)
                                                   for option, g in zip(options, chosen))
        return tokens / ms if ms > 0 else math.inf

    for _ in range(rounds):
        changed = False
        for b, option in enumerate(options):
            best = max(range(option.cap + 1), key=lambda g: (rate(sizes[:b] + [g] + sizes[b + 1:]), -g))
            changed |= best != sizes[b]
            sizes[b] = best
        if not changed:
            break
    return sizes
