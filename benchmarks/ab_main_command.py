"""The README's main command from this checkout against the same command from an earlier commit, as whole processes.

Each side runs ``python -m fuzzyspec generate MAIN_PROMPT --json`` with its own sources first on ``sys.path`` (the
earlier commit's ``fuzzyspec`` folder, taken with ``git archive`` into a folder named by the commit, so a second
use reuses it and its kernels' build). Both share everything else: the installed packages, the fuzzyspec cache
(converted model, profiles, inductor's code). The default job and ``--method ar`` each way, alternating in balanced
turns after one uncounted run of each (a side's first run builds its kernels); each process's wall time, medians.
With ``--first``, every counted run is a machine's first: on a fuzzyspec cache of its own holding only the GGUF, so
it builds the kernels, converts the tokenizer and makes the 4-bit model and the head's bytes.

Usage: python benchmarks/ab_main_command.py --before COMMIT [--repeats 7] [--threads 2] [--first]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_step import MAIN_PROMPT, ROOT, sources_at  # (this folder's modules)
from turns import balanced_turns

from fuzzyspec.loading import embedded_gguf
from fuzzyspec.tuning import machine

JOBS = {"default job": [], "ar": ["--method", "ar"]}


def checkout(commit: str) -> Path:
    """The sources of ``commit`` (its fuzzyspec folder), in a folder of their own that a later run reuses."""
    resolved = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", commit], capture_output=True,
                              text=True, check=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"fuzzyspec-before-{resolved}"
    return folder if (folder / "fuzzyspec" / "__init__.py").is_file() else sources_at(resolved, folder)


def run_from(folder: Path) -> dict:
    """``subprocess.run``'s cwd and env for a process importing fuzzyspec from ``folder`` (``checkout``'s) first."""
    return {"cwd": folder, "env": {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder),
                                                                                os.environ.get("PYTHONPATH", "")])}}


def child_json(code: str, where: dict, timeout: int = 1800) -> dict:
    """Run ``python -c code`` in a process of its own (``where``: subprocess.run's cwd and env) and return the JSON
    its last line of output prints; its error output, as the exit, where it fails."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **where)
    if done.returncode:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def once(command: list[str], job: list[str], threads: int, first: bool = False, **where) -> tuple[float, dict]:
    """One run of the main command, ``python COMMAND --threads N generate MAIN_PROMPT --json JOB``, in a process of
    its own (``where``: subprocess.run's cwd and env; ``first``: on a fresh cache holding only the GGUF): its wall
    time, and its JSON's statistics."""
    with tempfile.TemporaryDirectory(prefix="fuzzyspec-first-") as fresh:
        if first:
            (Path(fresh) / "gguf").mkdir()
            shutil.copy(embedded_gguf(), Path(fresh) / "gguf" / embedded_gguf().name)
            where = {**where, "env": {**where.get("env", os.environ), "FUZZYSPEC_CACHE": fresh}}
        clock = time.perf_counter()
        done = subprocess.run([sys.executable, *command, "--threads", str(threads), "generate", MAIN_PROMPT, "--json",
                               *job], capture_output=True, text=True, timeout=600, **where)
        seconds = time.perf_counter() - clock
    if done.returncode:
        raise SystemExit(done.stderr)
    return seconds, json.loads(done.stdout)["stats"]


def compare(ways: dict[str, tuple[list[str], dict]], repeats: int, threads: int, first: bool = False
            ) -> dict[tuple[str, str], list[tuple[float, dict]]]:
    """Every way (a name -> its command and ``once``'s ``where``) with every job in ``JOBS``, in balanced turns,
    after one uncounted run of each (a checkout's first run builds its kernels; every run warms the file cache):
    each case's (seconds, statistics), and each run shown as it ends. ``first``: every counted run a first run."""
    cases = [(way, job) for way in ways for job in JOBS]
    for way, job in cases:
        once(ways[way][0], JOBS[job], threads, **ways[way][1])
    runs: dict[tuple[str, str], list[tuple[float, dict]]] = {case: [] for case in cases}
    for turn in balanced_turns(cases, repeats):
        for way, job in turn:
            taken, stats = once(ways[way][0], JOBS[job], threads, first, **ways[way][1])
            runs[way, job].append((taken, stats))
            print(f"  {way:38s} {job:12s} {taken:6.2f} s (decoding {stats['wall_s']:.2f} s, "
                  f"{stats['new_tokens']} tokens)", file=sys.stderr, flush=True)
    print(f"\nwhole processes, medians of {repeats} (seconds; decoding alone beside)")
    for (way, job), done in runs.items():
        print(f"  {way:38s} {job:12s} {statistics.median(t for t, _ in done):6.2f} s  decoding "
              f"{statistics.median(stats['wall_s'] for _, stats in done):.2f} s  runs "
              f"{', '.join(f'{t:.2f}' for t, _ in done)}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--first", action="store_true", help="every counted run on a fresh cache: a first run")
    args = parser.parse_args()
    ways = {"this checkout": (["-m", "fuzzyspec"], {"cwd": ROOT}),
            f"at {args.before}": (["-m", "fuzzyspec"], run_from(checkout(args.before)))}
    print(f"fuzzyspec ab_main_command: {machine()} (the children run {args.threads} threads); "
          f"{'first runs, each on a fresh cache; ' if args.first else ''}{time.strftime('%Y-%m-%d')}", flush=True)
    runs = compare(ways, args.repeats, args.threads, args.first)
    for job in JOBS:
        now, then = (statistics.median(t for t, _ in runs[way, job]) for way in ways)
        print(f"  {job}: this checkout {then / now:.3f}x as fast")


if __name__ == "__main__":
    main()
