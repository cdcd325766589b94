"""Loading the embedded 4-bit target and the default job's drafter, this checkout against an earlier commit.

Fresh processes, each importing fuzzyspec from its own sources (the earlier commit's taken as
``ab_main_command.checkout`` takes them), then timing ``loading.load_model`` (the target and its tokenizer) and
``registry.load_drafter("default")``; balanced turns after one uncounted run of each; medians. ``--first`` empties
the cache's ``made/`` folder before every run: a first load, which makes what later loads read back.

Usage: python benchmarks/ab_load.py --before COMMIT [--repeats 9] [--first]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time

from ab_main_command import checkout, child_json, run_from  # (this folder's modules)
from bench_step import ROOT
from turns import balanced_turns

from fuzzyspec.files import cache_dir
from fuzzyspec.tuning import machine

CHILD = """
import json, time
clock = time.perf_counter()
import torch, transformers
from fuzzyspec.core import kernels
from fuzzyspec.loading import load_model
from fuzzyspec.drafters.registry import load_drafter
kernels.available()
imported = time.perf_counter()
target, tokenizer = load_model(None)
loaded = time.perf_counter()
load_drafter("default", target, tokenizer)
print(json.dumps({"imports": imported - clock, "target": loaded - imported, "drafter": time.perf_counter() - loaded}))
"""
PARTS = ("imports", "target", "drafter")


def once(where: dict, first: bool) -> dict[str, float]:
    if first:
        shutil.rmtree(cache_dir() / "made", ignore_errors=True)
    return child_json(CHILD, where, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--first", action="store_true", help="empty the cache's made/ folder before every run")
    args = parser.parse_args()
    ways = {"this checkout": {"cwd": ROOT}, f"at {args.before}": run_from(checkout(args.before))}
    print(f"fuzzyspec ab_load: {machine()}; {'first loads (made/ emptied before each)' if args.first else 'later loads'}"
          f"; {time.strftime('%Y-%m-%d')}", flush=True)
    for where in ways.values():
        once(where, args.first)
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for turn in balanced_turns(list(ways), args.repeats):
        for way in turn:
            runs[way].append(once(ways[way], args.first))
            print(f"  {way:24s} " + "  ".join(f"{part} {runs[way][-1][part]:.3f} s" for part in PARTS),
                  file=sys.stderr, flush=True)
    print(f"\nmedians of {args.repeats} (seconds)")
    median = {way: {part: statistics.median(run[part] for run in done) for part in PARTS} for way, done in runs.items()}
    for way in ways:
        print(f"  {way:24s} " + "  ".join(f"{part} {median[way][part]:.3f}" for part in PARTS))
    now, then = (median[way] for way in ways)
    print("  target and drafter: this checkout "
          f"{(then['target'] + then['drafter']) / (now['target'] + now['drafter']):.2f}x as fast")


if __name__ == "__main__":
    main()
