"""How well the planner's cost profile (``fuzzyspec.core.cost.Profile``) keeps the ratio of two widths' costs on a
machine whose speed drifts, with and without its pace: a simulation, no model.

Three widths (true costs 6.0, 7.2 and 9.0 ms) run in phases of 30-200 passes, each phase one width, or a mix of two
or three, chosen at random (as the planner runs some sizes for a while and not others); the machine's speed drifts
(a slow swing up to 1.4x and stretches 1.3x slower on top) and one pass in about seven is a spike of 1.2-2.5x. After
every pass the error of the estimated ratios of width 2 to 1 and of 4 to 2 (the larger, in log) is recorded; the
figures are its mean and its largest over each run, averaged over 40 runs, from sizes started at their true costs,
at 0.85x (a tentative minimum's bias) and at 1.3x.

Usage: python benchmarks/sim_profile_drift.py
"""
from __future__ import annotations

import math
import random
import statistics

from fuzzyspec.core import cost
from fuzzyspec.core.cost import Profile

TRUE = {1: 6.0, 2: 7.2, 4: 9.0}


def run(seed: int, start: float) -> tuple[float, float]:
    rnd = random.Random(seed)
    profile = Profile(target={w: ms * (1 if w == 1 else start) for w, ms in TRUE.items()})
    errors, t = [], 0
    for _ in range(12):
        mix = rnd.choice([[1], [2], [4], [1, 2], [2, 4], [1, 2, 4]])
        for _ in range(rnd.randint(30, 200)):
            t += 1
            drift = 1 + 0.4 * math.sin(t / 80) ** 2 + (0.3 if (t // 150) % 3 == 1 else 0)
            width = rnd.choice(mix)
            noise = rnd.uniform(0.97, 1.05) if rnd.random() < 0.85 else rnd.uniform(1.2, 2.5)
            profile.observe_target(width, TRUE[width] * drift * noise)
            ms = {w: profile.target_ms(w) for w in TRUE}
            errors.append(max(abs(math.log(ms[2] / ms[1] / 1.2)), abs(math.log(ms[4] / ms[2] / 1.25))))
    return statistics.mean(errors), max(errors)


def main() -> None:
    shipped = cost.PACE_SHARE, cost.PACE_CLAMP
    print("error of two widths' cost ratio (log; mean over a run / largest in a run), averaged over 40 runs")
    for label, share, clamp in (("with the pace (as shipped)", *shipped), ("each size's own median (nopace)", 0.0,
                                                                          cost.STRIDE)):
        cost.PACE_SHARE, cost.PACE_CLAMP = share, clamp
        for start in (1.0, 0.85, 1.3):
            results = [run(seed, start) for seed in range(40)]
            print(f"  {label:32s} sizes started at {start:.2f}x: mean {statistics.mean(r[0] for r in results):.3f}"
                  f"  largest {statistics.mean(r[1] for r in results):.3f}")
    cost.PACE_SHARE, cost.PACE_CLAMP = shipped


if __name__ == "__main__":
    main()
