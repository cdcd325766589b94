"""Pick T for a requested acceptance rate (or tokens per target pass) instead of guessing a raw value.

The scale of T depends on the divergence (JS lives in [0, ln 2], KL is unbounded), so a user is better
served asking for "accept 80% of drafts" and letting the pair's own divergences decide T.

For a chain under ``fsd``, draft i of a step is accepted exactly when every D up to i is <= T, that
is when the running maximum m_i = max(D_1..D_i) is <= T. So from one run's recorded D vectors,

    acceptance(T) = #{m_i <= T} / #drafts      (a T for acceptance a is the a-quantile of m)
    tokens per target pass(T) ≈ 1 + #{m_i <= T} / #steps

Changing T changes what is generated, and with it the D values, so ``calibrate`` alternates: run the
sample at T, read off the T the recorded D values ask for, run again, until the measured figure is
within ``tolerance`` of the request. Measured acceptance only grows with T, so every run also narrows
a bracket around the answer, and a bisection inside it takes over after a few runs or whenever the
estimate leaves it (as it can for ``fsd-hybrid`` or trees, where the estimate above is only approximate).
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.config import DecodeConfig
from ..options import FUZZY, OptionError, check_acceptance

if TYPE_CHECKING:
    from ..api import ModelPair

OBJECTIVES = ("acceptance", "mean_accepted")
QUANTILES = (0.1, 0.5, 0.9)
ESTIMATED_RUNS = 3
TOLERANCE = {"acceptance": 0.02, "mean_accepted": 0.1}


@dataclass
class Measurement:
    """What one run over the calibration sample measured at one threshold."""

    threshold: float
    acceptance: float       # accepted drafts / drafted tokens
    mean_accepted: float    # new tokens / target passes
    steps: list[Tensor]     # the D vector of every verification step

    def value(self, objective: str) -> float:
        return getattr(self, objective)


@dataclass
class Calibration:
    divergence: str
    objective: str
    requested: float
    threshold: float
    acceptance: float        # measured on the sample at ``threshold``
    mean_accepted: float     # likewise, tokens per target pass
    converged: bool          # the measured objective is within tolerance of the request
    runs: int
    quantiles: dict[str, float]   # of the per-position D, from the run at ``threshold``

    @property
    def measured(self) -> float:
        return getattr(self, self.objective)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def running_max(steps: Sequence[Tensor]) -> Tensor:
    """Per drafted position, the largest D at or before it in its step (a chain accepts it iff this <= T)."""
    if not steps:
        return torch.zeros(0)
    return torch.cat([torch.cummax(d.float(), 0).values for d in steps])


def estimate(steps: Sequence[Tensor], threshold: float, objective: str) -> float:
    """The ``fsd`` chain acceptance (or tokens per pass) that ``threshold`` gives on recorded D vectors."""
    accepted = int((running_max(steps) <= threshold).sum())
    if objective == "acceptance":
        return accepted / max(sum(d.numel() for d in steps), 1)
    return 1 + accepted / max(len(steps), 1)


def estimate_threshold(steps: Sequence[Tensor], objective: str, value: float) -> float:
    """The T whose ``estimate`` is closest to ``value``, placed midway between two distinct running
    maxima so that rounding cannot move a position across it."""
    values, counts = torch.unique(running_max(steps), return_counts=True)  # sorted
    if values.numel() == 0:
        return 0.0
    total = sum(d.numel() for d in steps) if objective == "acceptance" else max(len(steps), 1)
    wanted = value * total if objective == "acceptance" else (value - 1) * total  # positions to accept
    accepted = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])  # at T below each value
    j = int(torch.argmin((accepted.double() - wanted).abs()))  # accept values[:j]
    if j == 0:
        return float(values[0]) / 2
    if j == values.numel():
        return float(values[-1]) * 1.5 + 1e-6
    return (float(values[j - 1]) + float(values[j])) / 2


def check_request(objective: str, value: float, gamma: int) -> None:
    """Raise OptionError (naming ``objective``) unless ``value`` can be asked of it."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown calibration objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    if objective == "acceptance":
        check_acceptance(value, objective)
    elif not 1 < value < gamma + 1:
        raise OptionError(objective, f"must be in (1, gamma + 1 = {gamma + 1}), got {value}")


def calibrate(measure: Callable[[float], Measurement], objective: str, value: float, divergence: str = "",
              tolerance: float | None = None, max_runs: int = 10, start: float = 0.0) -> Calibration:
    """Search T so that ``measure(T)`` hits ``value`` of ``objective`` within ``tolerance``.

    Returns the closest run's T (``converged`` says whether it is within tolerance, by default 0.02
    of acceptance or 0.1 tokens per pass). Each call of
    ``measure`` is a full run over the sample, so the search keeps them few: typically 2 to 5.
    """
    tolerance = TOLERANCE[objective] if tolerance is None else tolerance
    lo, hi = -math.inf, math.inf  # thresholds measured below / above the request
    best: Measurement | None = None
    tried: set[float] = set()
    threshold, runs = start, 0
    while runs < max_runs:
        result = measure(threshold)
        runs += 1
        tried.add(threshold)
        error = result.value(objective) - value
        if best is None or abs(error) < abs(best.value(objective) - value):
            best = result
        if abs(error) <= tolerance:
            break
        if error < 0:
            lo = max(lo, threshold)
        else:
            hi = min(hi, threshold)
        guess = estimate_threshold(result.steps, objective, value)
        # The estimate gets close fast but can circle a jump (where a small change of T changes what
        # is generated); after ESTIMATED_RUNS runs, or when it leaves the bracket, bisect instead.
        if runs >= ESTIMATED_RUNS or not lo < guess < hi or guess in tried:
            if hi == math.inf:
                guess = max(2 * lo, lo + 1e-3)
            elif lo == -math.inf:  # even T = start accepts too much: only a smaller T could help
                guess = hi / 2 if hi > 0 else None
            else:
                guess = (lo + hi) / 2
        if guess is None or guess in tried:
            break
        threshold = guess
    quantiles = {} if not best.steps else {
        f"q{int(q * 100)}": float(v) for q, v in zip(QUANTILES, torch.quantile(
            torch.cat(best.steps).float(), torch.tensor(QUANTILES)))}
    return Calibration(divergence, objective, value, best.threshold, best.acceptance, best.mean_accepted,
                       abs(best.value(objective) - value) <= tolerance, runs, quantiles)


def sample_measure(generate: Callable[[Tensor, DecodeConfig], object], prompt_ids: Sequence[Tensor],
                   config: DecodeConfig, progress: bool = True) -> Callable[[float], Measurement]:
    """``measure`` for ``calibrate``: decode every prompt at T with ``config`` (seeded per prompt, so a
    rerun at the same T measures the same) through ``generate(ids, config) -> Result``."""
    if config.method not in FUZZY:
        raise ValueError(f"calibrating T needs a fuzzy rule (fsd or fsd-hybrid), not {config.method!r}")

    def measure(threshold: float) -> Measurement:
        accepted = proposed = new_tokens = forwards = 0
        steps: list[Tensor] = []
        seed = 0 if config.seed is None else config.seed
        for i, ids in enumerate(tqdm(prompt_ids, desc=f"calibrating {config.divergence} T={threshold:.4g}",
                                     leave=False, disable=not progress)):
            stats = generate(ids, dataclasses.replace(config, threshold=threshold, seed=seed + i)).stats
            accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
            new_tokens, forwards = new_tokens + stats.new_tokens, forwards + stats.target_forwards
            steps += [d.cpu() for d in stats.divergences]
        return Measurement(threshold, accepted / max(proposed, 1), new_tokens / max(forwards, 1), steps)

    return measure


def calibrate_pair(pair: "ModelPair", config: DecodeConfig, objective: str, value: float,
                   prompts: Sequence[str | list[dict]], stop: Sequence[str] = (), progress: bool = True
                   ) -> Calibration:
    """Calibrate T for ``config`` (its method, divergence, sampling, max_new_tokens) on ``prompts``."""
    check_request(objective, value, config.gamma)
    ids = [pair.encode(p) for p in prompts]
    measure = sample_measure(lambda x, c: pair.generate(x, stop=stop, config=c), ids, config, progress)
    return calibrate(measure, objective, value, config.divergence)


CALIBRATION_PROMPTS = 8     # a calibration's sample: prompts (held-out ShareGPT for ``cached_calibration``)
CALIBRATION_TOKENS = 64     # and tokens decoded per prompt
_cache_lock = threading.Lock()


def cached_calibration(pair: "ModelPair", config: DecodeConfig, acceptance: float, names: dict) -> dict:
    """T for ``config`` at ``acceptance``, calibrated on held-out ShareGPT prompts once per setting
    (``names`` identifies the models) and kept in ``calibrations.json`` in the fuzzyspec cache."""
    from ..loading import cache_dir
    from .tasks import get_task

    config = dataclasses.replace(config, max_new_tokens=CALIBRATION_TOKENS, seed=0, threshold=0.0)
    key = json.dumps(names | {"acceptance": acceptance, "prompts": CALIBRATION_PROMPTS, "config": repr(config)})
    path = cache_dir() / "calibrations.json"
    with _cache_lock:  # one calibration at a time: a second identical request then finds the first's result
        known = json.loads(path.read_text()) if path.is_file() else {}
        if key not in known:
            prompts = [e.prompt for e in get_task("freeform").examples(CALIBRATION_PROMPTS)]
            found = calibrate_pair(pair, config, "acceptance", acceptance, prompts).to_dict()
            known[key] = found | {"prompts": len(prompts)}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1) + "\n")
        return known[key]
