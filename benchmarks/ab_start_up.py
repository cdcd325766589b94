"""The README's main command as whole processes, with the garbage collector held off during start-up (``cli.run``,
what ``fuzzyspec`` and ``python -m fuzzyspec`` do) and as Python leaves it (``cli.main`` called plainly, as before).

Fresh processes, the default job and ``--method ar`` each way, alternating in balanced turns, on warm caches (run the
command once first: a first use builds the kernels); each process's own wall time, medians.

Usage: python benchmarks/ab_start_up.py [--repeats 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench_step import MAIN_PROMPT  # (this folder's modules)
from turns import balanced_turns

from fuzzyspec.tuning import machine

WAYS = {"collector held off (run)": ["-m", "fuzzyspec"],
        "collector as Python leaves it (main)": ["-c", "import sys; from fuzzyspec.cli import main; sys.exit(main())"]}
JOBS = {"default job": [], "ar": ["--method", "ar"]}


def once(way: list[str], job: list[str], threads: int) -> tuple[float, dict]:
    clock = time.perf_counter()
    done = subprocess.run([sys.executable, *way, "--threads", str(threads), "generate", MAIN_PROMPT, "--json", *job],
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - clock
    if done.returncode:
        raise SystemExit(done.stderr)
    return seconds, json.loads(done.stdout)["stats"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"fuzzyspec ab_start_up: {machine()} (the children run {args.threads} threads); "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    cases = [(way, job) for way in WAYS for job in JOBS]
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    decoding: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    once(WAYS["collector held off (run)"], [], args.threads)  # (warm the file cache; not counted)
    for turn in balanced_turns(cases, args.repeats):
        for way, job in turn:
            taken, stats = once(WAYS[way], JOBS[job], args.threads)
            seconds[way, job].append(taken)
            decoding[way, job].append(stats["wall_s"])
            print(f"  {way:38s} {job:12s} {taken:6.2f} s (decoding {stats['wall_s']:.2f} s, "
                  f"{stats['new_tokens']} tokens)", file=sys.stderr, flush=True)
    print(f"\nwhole processes, medians of {args.repeats} (seconds; decoding alone beside)")
    median = {case: statistics.median(values) for case, values in seconds.items()}
    for way, job in cases:
        print(f"  {way:38s} {job:12s} {median[way, job]:6.2f} s  decoding {statistics.median(decoding[way, job]):.2f} s"
              f"  runs {', '.join(f'{value:.2f}' for value in seconds[way, job])}")
    for job in JOBS:
        held, plain = (median[way, job] for way in WAYS)
        print(f"  {job}: held off {held:.2f} s against {plain:.2f} s: {plain / held:.2f}x faster")
    for way in WAYS:
        print(f"  {way}: the default job {median[way, 'default job']:.2f} s against AR's {median[way, 'ar']:.2f} s")


if __name__ == "__main__":
    main()
