"""EAGLE-2 trees grown on the device and read once (``EagleDrafter._tree``, 2026-11-28) against trees grown a level
at a time with a read of the device at each (the drafter's ``_tree`` at ``--before``), in one process, in balanced
turns, on the embedded pair with the shipped head: fixed tree shapes (``--gamma-schedule constant``), greedy exact SD.

It prints, per variant and shape: tokens a second and x the first variant, the median time of a tree proposal (the
drafter's ``propose``: the head's passes and the choices around them), and the device reads a proposal makes in the
drafter's own module (``.tolist()``, ``.item()``, ``int()``, ``bool()`` and ``float()`` of a tensor; since d07ea20 a
tree's shape stays on the device until the engine reads it with the step's outcome, so none).
The answers must be the same tokens (greedy SD is the target's greedy output): it says so, or stops.

Usage: python benchmarks/ab_tree_growth.py [--before 25f64e3] [--mode eager|compiled] [--prompts 12]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_step import everyday  # (this folder's modules)
from turns import balanced_turns

from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.drafters import eagle
from fuzzyspec.tuning import machine

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"16 nodes, depth 5, 4 wide": (16, 5, 4), "6 nodes, depth 3, 2 wide": (6, 3, 2)}


def tree_at(commit: str):
    """``EagleDrafter._tree`` as ``fuzzyspec/drafters/eagle.py`` had it at ``commit`` (its module loaded beside
    today's package, whose other modules it imports), and that module's file."""
    source = subprocess.run(["git", "show", f"{commit}:fuzzyspec/drafters/eagle.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "eagle_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fuzzyspec.drafters._eagle_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.EagleDrafter._tree, str(path)


class Reads:
    """Counts the reads of device values made from the drafter's modules, ``files`` (a read on a GPU waits for
    everything queued)."""

    def __init__(self, files: set[str]) -> None:
        self.files, self.count = files, 0
        self.patched = []

    def __enter__(self) -> "Reads":
        for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
            original = getattr(torch.Tensor, name)

            def counting(tensor, *args, _original=original, **kwargs):
                if sys._getframe(1).f_code.co_filename in self.files:
                    self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
            self.patched.append((name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.patched:
            setattr(torch.Tensor, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="25f64e3",
                        help="a commit whose trees grew level by level (25f64e3: the last)")
    parser.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    parser.add_argument("--prompts", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(2)
    before, before_file = tree_at(args.before)
    trees = {"grown on the device": eagle.EagleDrafter._tree, f"level by level ({args.before})": before}
    files = {eagle.__file__, before_file}
    pair = ModelPair.load(draft="eagle", compile=args.mode == "compiled")
    if args.mode == "compiled":
        tuning.prepare(pair, pair.config(method="sd", tree=True, gamma_schedule="constant"))
    prompts = everyday(args.prompts)
    print(f"fuzzyspec ab_tree_growth ({args.mode}, the GGUF's 4 bits): {machine()}; {len(prompts)} everyday prompts "
          f"x 128 tokens, greedy sd, fixed trees; {time.strftime('%Y-%m-%d')}", flush=True)
    proposals: list[float] = []
    original_propose = eagle.EagleDrafter.propose

    def timed_propose(self, *args, **kwargs):
        clock = time.perf_counter()
        draft = original_propose(self, *args, **kwargs)
        proposals.append(time.perf_counter() - clock)
        return draft

    eagle.EagleDrafter.propose = timed_propose

    def answer(tree, shape, prompt) -> tuple[float, int, list[int], list[float], int]:
        eagle.EagleDrafter._tree = tree
        proposals.clear()
        total, depth, top_k = shape
        clock = time.perf_counter()
        with Reads(files) as reads:
            result = pair.generate(prompt, max_new_tokens=128, eos_token_ids=(), method="sd", tree=True,
                                   gamma_schedule="constant", tree_total_tokens=total, tree_depth=depth,
                                   tree_top_k=top_k)
        return time.perf_counter() - clock, result.stats.new_tokens, result.tokens, list(proposals), reads.count

    for name, shape in SHAPES.items():
        for _, prompt in prompts[:2]:  # (warm-up: compiles what the shape needs, fills caches)
            for tree in trees.values():
                answer(tree, shape, prompt)
        runs: dict[str, list] = {variant: [] for variant in trees}
        for (_, prompt), order in zip(prompts, balanced_turns(list(trees), len(prompts))):
            tokens = None
            for variant in order:
                outcome = answer(trees[variant], shape, prompt)
                if tokens is not None and outcome[2] != tokens:
                    raise SystemExit(f"the variants' answers differ ({name}): greedy sd should give the same tokens")
                tokens = outcome[2]
                runs[variant].append(outcome)
        print(f"  {name}:")
        first = None
        for variant, rows in runs.items():
            rate = sum(row[1] for row in rows) / sum(row[0] for row in rows)
            first = first or rate
            times = [t for row in rows for t in row[3]]
            count = len(times)
            print(f"    {variant:34s} {rate:7.1f} tok/s  {rate / first:.3f}x  a proposal "
                  f"{1000 * statistics.median(times):.3f} ms (median of {count})  device reads a proposal "
                  f"{sum(row[4] for row in rows) / count:.1f}", flush=True)
    print("  the variants' answers were the same tokens")


if __name__ == "__main__":
    main()
