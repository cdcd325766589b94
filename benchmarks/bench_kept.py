"""Kept compiled steps (``core.kept``) against dynamo's graphs with frozen weights (as before 2026-11-28, evening),
for the embedded 4-bit target on this CPU:

1. **Start-up, process by process**: ``tuning.prepare`` for the default job (every width its drafts may take, and
   the EAGLE head's steps), in fresh processes one after another, kept and dynamo's taking turns. A kept graph is
   compiled by the first process on a machine and loaded by the later ones; dynamo's are traced in every process
   (inductor's code is kept for both). Then one short answer in each.
2. **Passes**: a compiled pass of 1, 2, 4 and 6 tokens after 128 cached positions, both ways in one process, in
   turns; medians. And the first kept pass at a cache of 2,048 positions (dynamo's graphs compile one per capacity).

Usage: python benchmarks/bench_kept.py [--processes 3] [--rounds 300]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import os, sys, time
from fuzzyspec.cli import _persist_compiled_code
_persist_compiled_code()
from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.core import kept
pair = ModelPair.load(weights="int4", compile=True)
config = pair.config(max_new_tokens=32)
clock = time.perf_counter()
tuning.prepare(pair, config)
prepared = time.perf_counter() - clock
clock = time.perf_counter()
pair.generate("Name three rivers in Europe.", config=config)
print(f"RESULT {prepared:.2f} {time.perf_counter() - clock:.2f}")
"""


def start_up(processes: int) -> None:
    print("1. start-up in fresh processes: tuning.prepare for the default job, then a 32-token answer (s)", flush=True)
    for n in range(processes):
        for way, flag in (("kept", "1"), ("dynamo", "0")):
            out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                 env={**os.environ, "FUZZYSPEC_KEPT_STEPS": flag})
            line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT")), None)
            if line is None:
                raise SystemExit(f"the {way} process failed:\n{out.stderr[-2000:]}")
            prepared, answered = line.split()[1:]
            print(f"  process {n + 1}, {way}: prepare {prepared} s, answer {answered} s", flush=True)


def passes(rounds: int) -> None:
    import torch

    from fuzzyspec import tuning
    from fuzzyspec.api import ModelPair
    from fuzzyspec.core.step import Compiled, Kept, TargetStep

    pair = ModelPair.load(weights="int4", draft=None)
    kept_step, dynamo_step = TargetStep(pair.target, compile=True), TargetStep(pair.target, compile=True)
    dynamo_step._compiled = Compiled(dynamo_step.forward, torch.device("cpu"))
    widths = (1, 2, 4, 6)
    with torch.inference_mode():
        calls = {"kept": tuning.target_calls(kept_step, widths, compiled=True)[0],
                 "dynamo": tuning.target_calls(dynamo_step, widths, compiled=True)[0]}
        assert isinstance(kept_step._compiled, Kept)
        times = {(way, w): [] for way in calls for w in widths}
        for round_ in range(rounds):
            for w in widths:
                for way in (("kept", "dynamo") if round_ % 2 else ("dynamo", "kept")):
                    clock = time.perf_counter()
                    calls[way][w]()
                    times[(way, w)].append(1000 * (time.perf_counter() - clock))
        print(f"2. a compiled pass after 128 positions, cache of {kept_step.min_capacity} (medians of {rounds}, ms):")
        for w in widths:
            kept_ms, dynamo_ms = statistics.median(times[("kept", w)]), statistics.median(times[("dynamo", w)])
            print(f"  {w} token{'s' if w > 1 else ' '}: kept {kept_ms:.3f}, dynamo's {dynamo_ms:.3f}: "
                  f"x{dynamo_ms / kept_ms:.3f}")
        clock = time.perf_counter()
        tuning.target_calls(kept_step, (1,), compiled=True, capacity=2048)
        print(f"  the kept step's first calls at a cache of 2048 positions (a prefill and two passes): "
              f"{time.perf_counter() - clock:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    from fuzzyspec.tuning import machine

    print(f"fuzzyspec bench_kept: {machine()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    start_up(args.processes)
    passes(args.rounds)


if __name__ == "__main__":
    main()
