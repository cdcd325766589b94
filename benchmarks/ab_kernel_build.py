"""A first use's build of the CPU kernels from this checkout against an earlier commit's, in turns.

Each build runs in a process of its own, importing fuzzyspec from its side's sources (``ab_main_command.checkout``)
on a fresh fuzzyspec cache, so it compiles everything with that side's own sources and flags, as a machine's first
use does. Each reports the build's wall time (``kernels.unavailable``: compiling, linking, loading) and the
compilers' CPU time (user + system, from the child processes' usage). Sides alternate in balanced turns; medians.

On 2 cores the build's three compiles share both cores with each other and, in a first run, with the imports, the
tokenizer's conversion and the 4-bit model's making: there, CPU time saved is about half as much wall time saved.

Usage: python benchmarks/ab_kernel_build.py --before COMMIT [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ab_main_command import checkout, run_from  # (this folder's modules)
from bench_step import ROOT
from turns import balanced_turns

from fuzzyspec.tuning import machine

# What the child runs: the build, timed, and its compilers' CPU time (they are its children, waited for by then)
CHILD = """
import json, resource, time
from fuzzyspec.core import kernels
start = time.perf_counter()
why = kernels.unavailable()
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "error": why}))
"""


def build_once(where: dict) -> dict:
    """One first build, in a process of its own on a fresh cache: its wall and CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="fuzzyspec-build-") as fresh:
        env = {**where.get("env", os.environ), "FUZZYSPEC_CACHE": fresh}
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600,
                              **{**where, "env": env})
    if done.returncode:
        sys.exit(f"ab_kernel_build: a build failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["error"]:
        sys.exit(f"ab_kernel_build: {result['error']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit whose kernels this checkout's meet")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sides = {"this checkout": {"cwd": ROOT, "env": {**os.environ, "PYTHONPATH": str(ROOT)}},
             f"at {args.before}": run_from(checkout(args.before))}
    print(f"fuzzyspec ab_kernel_build: {machine()}; first builds, each on a fresh cache; {args.repeats} a side",
          flush=True)
    results = {side: [] for side in sides}
    for order in balanced_turns(list(sides), args.repeats):
        for side in order:
            result = build_once(sides[side])
            results[side].append(result)
            print(f"  {side:24s} wall {result['wall']:6.2f} s  compilers' CPU {result['cpu']:6.2f} s", flush=True)
    print("\nmedians (seconds)")
    for side, runs in results.items():
        print(f"  {side:24s} wall {statistics.median(r['wall'] for r in runs):6.2f}  "
              f"compilers' CPU {statistics.median(r['cpu'] for r in runs):6.2f}  "
              "walls " + ", ".join(f"{r['wall']:.2f}" for r in runs))
    new, old = results["this checkout"], results[f"at {args.before}"]
    for key, name in (("wall", "wall"), ("cpu", "compilers' CPU")):
        ratio = statistics.median(r[key] for r in new) / statistics.median(r[key] for r in old)
        print(f"  this checkout's {name} / before's: {ratio:.3f}")


if __name__ == "__main__":
    main()
