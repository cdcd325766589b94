"""What decides how one sequence is decoded: ``DecodeConfig``, and ``from_options``, the one place that turns
a request's options into it (the default job, the defaults, every check) for every interface."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from ..options import (BY_NAME, DEFAULT_DRAFT, DEFAULT_JOB, FUZZY, METHODS, SCHEDULES, OptionError,
                       check_acceptance)
from .divergences import canonical_name
from .draft import Budget, Drafter
from .sampling import Sampling

_DEFAULT = {name: option.default for name, option in BY_NAME.items()}  # declared in options.OPTIONS
_SAMPLING = {f.name for f in dataclasses.fields(Sampling)}


class DrafterInfo(Protocol):
    """What a request's checks need to know of its drafter before (or after) it loads: its registry name
    and whether it drafts trees (``drafters.registry.describe``, or a loaded ``DrafterSource``)."""

    name: str
    drafts_trees: bool


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how one sequence is decoded (each option's help: ``options.OPTIONS``).

    method: ``ar``, ``sd``, ``fsd`` or ``fsd-hybrid``.
    gamma: drafts per step (the start value under the ``heuristic`` schedule,
        which adds 2 after a fully accepted step and takes 1 away otherwise).
    draft_confidence: stop drafting when the draft's top probability is below it.
    divergence, threshold: D and T of the fuzzy rules; ``divergence_top_k`` and
        ``divergence_top_p`` configure its truncated forms.
    raw_divergence: compute D on unprocessed softmax distributions, as the FSD
        reference code did, instead of on the processed ones.
    greedy_drafts: draft the draft's argmax even when sampling, as the reference code did.
    eos_token_ids: generation ends at the first of these (which is kept).
    tree: draft EAGLE-2 trees (total nodes, depth, children per node) instead of chains.

    Constructed directly it takes the table's defaults; ``from_options`` applies the default job too.
    """

    method: str = _DEFAULT["method"]
    gamma: int = _DEFAULT["gamma"]
    gamma_schedule: str = _DEFAULT["gamma_schedule"]
    draft_confidence: float = _DEFAULT["draft_confidence"]
    divergence: str = _DEFAULT["divergence"]
    threshold: float = _DEFAULT["threshold"]
    divergence_top_k: int = _DEFAULT["divergence_top_k"]
    divergence_top_p: float = _DEFAULT["divergence_top_p"]
    raw_divergence: bool = _DEFAULT["raw_divergence"]
    greedy_drafts: bool = _DEFAULT["greedy_drafts"]
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = _DEFAULT["max_new_tokens"]
    seed: int | None = _DEFAULT["seed"]
    eos_token_ids: tuple[int, ...] = ()
    tree: bool = _DEFAULT["tree"]
    tree_total_tokens: int = _DEFAULT["tree_total_tokens"]
    tree_depth: int = _DEFAULT["tree_depth"]
    tree_top_k: int = _DEFAULT["tree_top_k"]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise OptionError("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("gamma", "max_new_tokens", "tree_total_tokens", "tree_depth", "tree_top_k"):
            if getattr(self, name) < 1:
                raise OptionError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.gamma_schedule not in SCHEDULES:
            raise OptionError("gamma_schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.gamma_schedule!r}")
        if not 0 <= self.draft_confidence <= 1:
            raise OptionError("draft_confidence", f"must be in [0, 1], got {self.draft_confidence}")
        canonical_name(self.divergence)
        if math.isnan(self.threshold) or self.threshold < 0:
            raise OptionError("threshold", f"must be a number >= 0 (inf allowed), got {self.threshold}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise OptionError("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.divergence_top_k < 1:
            raise OptionError("divergence_top_k", f"must be >= 1, got {self.divergence_top_k}")
        if not 0 < self.divergence_top_p <= 1:
            raise OptionError("divergence_top_p", f"must be in (0, 1], got {self.divergence_top_p}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, *, drafter: DrafterInfo | None,
                     eos_token_ids: tuple[int, ...] = (), target_acceptance: float | None = None) -> "DecodeConfig":
        """The config of one request: every interface (CLI, Python API, hook, lm-eval, bench, server) decides
        through here, so the same request means the same decoding everywhere.

        ``options``: option names of ``options.OPTIONS`` (flat: temperature, top_k and top_p too) to values;
        an absent or None value is unset. ``drafter``: the drafter the request runs with (None: none).
        Unset options take the default job where it applies, else the table's default:

        - method: ``fsd`` when ``target_acceptance`` asks for a calibrated threshold, ``ar`` without a
          drafter, else ``sd``;
        - tree: on for the default drafter (the default job drafts EAGLE-2 trees), off for any other;
        - gamma_schedule: ``cost`` (each step's draft size chosen from measured costs; see ``cost``);
        - everything else: ``options.OPTIONS``.

        Raises ``OptionError`` naming the option at fault, before anything loads.
        """
        given = {name: value for name, value in (options or {}).items() if value is not None}
        unknown = sorted(set(given) - set(BY_NAME))
        if unknown:
            raise OptionError(unknown[0], f"is not a decoding option (options: {', '.join(BY_NAME)})")
        if "method" not in given:
            given["method"] = "fsd" if target_acceptance is not None else "ar" if drafter is None else "sd"
        if "tree" not in given and drafter is not None and drafter.name == DEFAULT_DRAFT:
            given["tree"] = DEFAULT_JOB["tree"]
        given.setdefault("gamma_schedule", DEFAULT_JOB["gamma_schedule"])
        if target_acceptance is not None:
            check_acceptance(target_acceptance)
            if given["method"] not in FUZZY:
                raise OptionError("target_acceptance", f"needs a fuzzy method (fsd or fsd-hybrid), not {given['method']}")
            if "threshold" in given:
                raise OptionError("target_acceptance", "excludes a threshold: give one or the other")
        sampling = Sampling(**{name: given.pop(name) for name in list(given) if name in _SAMPLING})
        config = cls(sampling=sampling, eos_token_ids=tuple(eos_token_ids), **given)
        config.check_drafter(drafter)
        return config

    def check_drafter(self, drafter: DrafterInfo | Drafter | None) -> None:
        """Raise OptionError unless ``drafter`` (anything with ``drafts_trees``) can serve this config: every
        method but ar needs one, and trees need one that drafts trees (an EAGLE head)."""
        if self.method == "ar":
            return
        if drafter is None:
            raise OptionError("method", f"{self.method} needs a drafter")
        if self.tree and not drafter.drafts_trees:
            raise OptionError("tree", "needs a drafter that drafts trees (an EAGLE head)")

    @property
    def fuzzy(self) -> bool:
        return self.method in FUZZY

    @property
    def draft_only(self) -> bool:
        """FSD with T = inf accepts every drafted chain: the target has nothing to decide.
        (In a tree the target still picks which child to follow.)"""
        return self.method == "fsd" and self.threshold == math.inf and not self.tree

    def describe(self) -> dict[str, Any]:
        """What a result reports of how it was decoded: the rule, and D and T only where a fuzzy rule reads
        them (JSON has no infinity: an infinite T is ``"inf"``)."""
        threshold = self.threshold if math.isfinite(self.threshold) else "inf"
        return {"method": self.method, "divergence": self.divergence if self.fuzzy else None,
                "threshold": threshold if self.fuzzy else None, "gamma": self.gamma, "tree": self.tree}

    @property
    def size_cap(self) -> int:
        """The largest draft size a row of this config uses: a tree's depth, or a chain's gamma."""
        return self.tree_depth if self.tree else self.gamma

    def budget(self, size: int, remaining: int, breadth: int | None = None, copy: int | None = None
               ) -> Budget | None:
        """What the drafter may propose at draft size ``size`` (a chain's tokens, a tree's depth) with
        ``remaining`` tokens to go: None when nothing (AR, or one token left, which the target gives); at size 0,
        a copy from the text alone (``Budget.tokens`` 0), which only a drafter that ``copies`` is asked for.
        A verified step adds one token after the drafts. A tree of ``breadth`` children per node (default: the
        config's ``tree_top_k``) at most; a tree one wide is drafted as the chain it is (of likeliest tokens, as
        the tree's are). A copy holds ``copy`` tokens at most (the cost schedule's ``cost.copy_length``), and never
        more than ``gamma``."""
        if self.method == "ar":
            return None
        if self.draft_only:  # nothing judges the draft (so nothing is copied either)
            return Budget(min(size, remaining), None, self.draft_confidence, self.greedy_drafts, False) \
                if size >= 1 else None
        if remaining < 2:
            return None
        copy = min(self.gamma if copy is None else copy, self.gamma, remaining - 1)
        if size < 1:  # no draft planned: a copy from the text alone (``Drafter.copies``)
            return Budget(0, None, self.draft_confidence, self.greedy_drafts, self.fuzzy, copy)
        breadth = min(breadth or self.tree_top_k, self.tree_top_k) if self.tree else 1
        if breadth == 1:  # a tree's drafts are its draft's likeliest tokens, so are a one-wide tree's
            greedy = self.greedy_drafts or self.tree
            # SD's test reads a chain's distributions where it was drawn from them (``Draft.sampled``)
            sampled = not (greedy or self.sampling.greedy)
            return Budget(min(size, remaining - 1), None, self.draft_confidence, greedy, self.fuzzy or sampled, copy)
        tree = (tree_nodes(size, self.tree_total_tokens, breadth), size, breadth)
        # SD on a tree tests its tokens against the target's distribution alone
        return Budget(min(self.gamma, remaining - 1), tree, self.draft_confidence, self.greedy_drafts, self.fuzzy,
                      copy)


@functools.lru_cache(maxsize=4096)  # (the planner asks for every shape it weighs, every step)
def tree_nodes(depth: int, total: int, top_k: int) -> int:
    """The nodes an EAGLE-2 tree of this depth keeps: ``top_k`` children per expanded node and level,
    reranked down to ``total``."""
    return min(total, sum(top_k ** level for level in range(1, depth + 1)))
