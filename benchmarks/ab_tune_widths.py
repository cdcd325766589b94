"""How steady `fuzzyspec tune`'s prices of the target's widths are: timed one width after another (five calls each,
as tune did before 2026-11-27's night) against in rounds (``tuning.measure_target``: every width once a round, the
order turned each round), several runs of each in one process, alternating; and a long interleaved reference of
widths 1 and 2 alone.

Prints each run's milliseconds by width and its 2-token pass over its 1-token one, which decides whether a 1-token
chain pays (the planner's arithmetic: ``tuning.pays_from``).

Usage: python benchmarks/ab_tune_widths.py [--mode compiled] [--runs 4] [--reference 300]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.loading import cpu_isa

WIDTHS = (1, 2, 4, 6, 8, 17)


def one_after_another(calls: dict, repeats: int = 5) -> dict[int, float]:
    """Each width of ``calls`` (``tuning.target_calls``) warmed and timed ``repeats`` times before the next (tune's way
    before rounds)."""
    found = {}
    with torch.inference_mode():
        for width, call in calls.items():
            call()
            times = []
            for _ in range(repeats):
                clock = time.perf_counter()
                call()
                times.append(1000 * (time.perf_counter() - clock))
            found[width] = statistics.median(times)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("eager", "compiled"), default="compiled")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--reference", type=int, default=300, help="rounds of widths 1 and 2 alone")
    args = parser.parse_args()
    torch.set_num_threads(2)
    pair = ModelPair.load(draft=None, weights="int4", compile=args.mode == "compiled")
    print(f"ab_tune_widths: CPU {cpu_isa()}; 2 threads; torch {torch.__version__}; int4 {args.mode}; passes after 128 "
          f"positions, widths {WIDTHS}")
    calls, _ = tuning.target_calls(pair.step, WIDTHS, compiled=pair.step.compile)
    for run in range(args.runs):
        for way in (("one after another", "in rounds") if run % 2 == 0 else ("in rounds", "one after another")):
            found = one_after_another(calls) if way == "one after another" else \
                tuning.measure_target(pair.step, WIDTHS, compiled=pair.step.compile)[0]
            print(f"  run {run + 1}, {way:17s}: " + " ".join(f"{w}:{ms:.2f}" for w, ms in found.items()) +
                  f"   2 tokens x{found[2] / found[1]:.3f} 1")
    times: dict[int, list[float]] = {1: [], 2: []}
    with torch.inference_mode():
        for round_ in range(args.reference):
            for width in ((1, 2) if round_ % 2 else (2, 1)):
                clock = time.perf_counter()
                calls[width]()
                times[width].append(1000 * (time.perf_counter() - clock))
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"  reference, {args.reference} rounds of 1 and 2 in turn: 1:{one:.2f} 2:{two:.2f}   2 tokens x{two / one:.3f} 1")


if __name__ == "__main__":
    main()
