"""The README's main command as whole processes, with the garbage collector held off during start-up (``cli.run``,
what ``fuzzyspec`` and ``python -m fuzzyspec`` do) and as Python leaves it (``cli.main`` called plainly, as before).

Fresh processes, the default job and ``--method ar`` each way, alternating in balanced turns after one uncounted run
of each (``ab_main_command.compare``); each process's own wall time, medians.

Usage: python benchmarks/ab_start_up.py [--repeats 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from ab_main_command import JOBS, compare  # (this folder's modules)

from fuzzyspec.tuning import machine

WAYS = {"collector held off (run)": ["-m", "fuzzyspec"],
        "collector as Python leaves it (main)": ["-c", "import sys; from fuzzyspec.cli import main; sys.exit(main())"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"fuzzyspec ab_start_up: {machine()} (the children run {args.threads} threads); "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    runs = compare({way: (command, {}) for way, command in WAYS.items()}, args.repeats, args.threads)
    median = {case: statistics.median(t for t, _ in done) for case, done in runs.items()}
    for job in JOBS:
        held, plain = (median[way, job] for way in WAYS)
        print(f"  {job}: held off {held:.2f} s against {plain:.2f} s: {plain / held:.2f}x faster")
    for way in WAYS:
        print(f"  {way}: the default job {median[way, 'default job']:.2f} s against AR's {median[way, 'ar']:.2f} s")


if __name__ == "__main__":
    main()
