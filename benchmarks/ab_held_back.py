"""Plans while the cost schedule holds every row back: every ``PLAN_EVERY`` steps (as before 2026-11-28) against
backing off to ``engine.HELD_PLAN_EVERY``, beside AR, in one process, in balanced turns.

- ``--set tiny``: a tiny random target and a random EAGLE head (which the planner soon holds back for good), compiled,
  one thread, each step run one ahead as on a GPU (``engine.LOOKAHEAD``). The step is then mostly the host's work,
  as a GPU step is where the host sets the pace: it prints a held-back step's time against AR's.
- ``--set embedded``: the embedded pair as the CPU runs it (4-bit, eager), drafted for by ``--draft eagle`` (the
  default job copies from the text, so its rows are never all held back and its plans never back off): what
  backing off costs or gains where drafting pays now and then. Tokens a second, x AR, and the categories' range.

Usage: python benchmarks/ab_held_back.py --set tiny|embedded [--prompts 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_gpu import random_pair  # (this folder's modules)
from bench_step import everyday
from turns import balanced_turns

from fuzzyspec.api import ModelPair
from fuzzyspec.core import engine as engine_module
from fuzzyspec.core.step import TargetStep
from fuzzyspec.tuning import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    held = engine_module.HELD_PLAN_EVERY
    if args.set == "tiny":
        torch.set_num_threads(1)
        engine_module.LOOKAHEAD = True
        made = random_pair(torch.device("cpu"), True, None)
        pair = ModelPair(made.target, made.tokenizer, made.drafts["eagle"], TargetStep(made.target, compile=True))
    else:
        pair = ModelPair.load(draft="eagle")
    tree = {"method": "sd", "tree": True}
    variants = {"ar": ({"method": "ar"}, held), f"plans every {engine_module.PLAN_EVERY} steps": (tree, 0),
                f"backing off to {held}": (tree, held)}
    prompts = everyday(args.prompts)
    form = "float32, compiled, run ahead" if args.set == "tiny" else "the GGUF's 4 bits (int4), eager"
    print(f"fuzzyspec ab_held_back ({args.set}; {form}): {machine()}; {len(prompts)} everyday prompts x 128 tokens; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)

    def answer(name: str, prompt: str) -> tuple[float, int, int]:
        options, every = variants[name]
        engine_module.HELD_PLAN_EVERY = every or engine_module.PLAN_EVERY
        clock = time.perf_counter()
        result = pair.generate(prompt, max_new_tokens=128, eos_token_ids=(), **options)
        return time.perf_counter() - clock, result.stats.new_tokens, result.stats.target_forwards

    # (not counted: compiles what the rows' drafts need, and a cache long enough for the longest prompts; fills the
    # profile)
    for _, prompt in sorted(prompts, key=lambda pair: len(pair[1]))[-3:]:
        for name in variants:
            answer(name, prompt)
    runs: dict[str, list[tuple[str, float, int, int]]] = {name: [] for name in variants}
    for (category, prompt), order in zip(prompts, balanced_turns(list(variants), len(prompts))):
        for name in order:
            runs[name].append((category, *answer(name, prompt)))
    engine_module.HELD_PLAN_EVERY = held

    def rate(rows: list[tuple[str, float, int, int]]) -> float:
        return sum(row[2] for row in rows) / sum(row[1] for row in rows)

    ar_step = statistics.median(seconds / passes for _, seconds, _, passes in runs["ar"])
    for name, rows in runs.items():
        step = statistics.median(seconds / passes for _, seconds, _, passes in rows)
        categories = {category: rate([row for row in rows if row[0] == category]) /
                      rate([row for row in runs["ar"] if row[0] == category]) for category, *_ in rows}
        print(f"  {name:28s} {rate(rows):8.1f} tok/s  {rate(rows) / rate(runs['ar']):.3f}x AR  "
              f"{sum(r[2] for r in rows) / sum(r[3] for r in rows):.2f} tok/pass  a step {1000 * step:.3f} ms "
              f"({step / ar_step:.3f}x AR's)  categories {min(categories.values()):.3f}-{max(categories.values()):.3f}")


if __name__ == "__main__":
    main()
