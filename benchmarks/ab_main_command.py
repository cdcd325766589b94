"""The README's main command from this checkout against the same command from an earlier commit, as whole processes.

Each side runs ``python -m fuzzyspec generate MAIN_PROMPT --json`` with its own sources first on ``sys.path`` (the
earlier commit's ``fuzzyspec`` folder, taken with ``git archive`` into a folder named by the commit, so a second
use reuses it and its kernels' build). Both share everything else: the installed packages, the fuzzyspec cache
(converted model, profiles, inductor's code). The default job and ``--method ar`` each way, alternating in balanced
turns after one uncounted run of each (a side's first run builds its kernels); each process's wall time, medians.

Usage: python benchmarks/ab_main_command.py --before COMMIT [--repeats 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_step import MAIN_PROMPT, ROOT  # (this folder's modules)
from turns import balanced_turns

from fuzzyspec.tuning import machine

JOBS = {"default job": [], "ar": ["--method", "ar"]}


def checkout(commit: str) -> Path:
    """The sources of ``commit`` (its fuzzyspec folder), in a folder of their own that a later run reuses."""
    resolved = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", commit], capture_output=True,
                              text=True, check=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"fuzzyspec-before-{resolved}"
    if not (folder / "fuzzyspec" / "__init__.py").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", resolved, "fuzzyspec"], capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def once(sources: Path, job: list[str], threads: int) -> tuple[float, dict]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sources), os.environ.get("PYTHONPATH", "")])}
    clock = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fuzzyspec", "--threads", str(threads), "generate", MAIN_PROMPT,
                           "--json", *job], capture_output=True, text=True, timeout=600, cwd=sources, env=environment)
    seconds = time.perf_counter() - clock
    if done.returncode:
        raise SystemExit(done.stderr)
    return seconds, json.loads(done.stdout)["stats"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sides = {"this checkout": ROOT, f"at {args.before}": checkout(args.before)}
    print(f"fuzzyspec ab_main_command: {machine()} (the children run {args.threads} threads); "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    cases = [(side, job) for side in sides for job in JOBS]
    for side, job in cases:  # (a side's first use builds its kernels; not counted)
        once(sides[side], JOBS[job], args.threads)
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for turn in balanced_turns(cases, args.repeats):
        for side, job in turn:
            taken, stats = once(sides[side], JOBS[job], args.threads)
            seconds[side, job].append(taken)
            print(f"  {side:24s} {job:12s} {taken:6.2f} s (decoding {stats['wall_s']:.2f} s, "
                  f"{stats['new_tokens']} tokens)", file=sys.stderr, flush=True)
    print(f"\nwhole processes, medians of {args.repeats} (seconds)")
    median = {case: statistics.median(values) for case, values in seconds.items()}
    for side, job in cases:
        print(f"  {side:24s} {job:12s} {median[side, job]:6.2f} s  runs "
              f"{', '.join(f'{value:.2f}' for value in seconds[side, job])}")
    before = f"at {args.before}"
    for job in JOBS:
        print(f"  {job}: this checkout {median[before, job] / median['this checkout', job]:.3f}x as fast")


if __name__ == "__main__":
    main()
