"""The default job on a profile whose narrow passes a slow spell left priced too high, with and without the plans that
measure a 1-token chain's pass afresh (``engine.REFRESH``).

The embedded target at its own 4-bit bytes answers everyday prompts (prompts no drafter trained on), greedy:

1. the default job answers the first ``--settle`` prompts from an empty profile, which settles it;
2. that profile is copied with its 1- to 4-token passes priced ``--slow`` times what it holds (what a profiler's
   pauses left in one, 2026-11-28: 1-4 token passes at about twice their cost, a 5-token pass at its own);
3. every prompt is answered by each variant in balanced turns, each keeping its own profile from one answer to the
   next: ``ar``; ``clean`` (the job on the settled profile); ``refresh`` (the job on the slow-priced copy, as
   shipped); ``norefresh`` (the same with no re-measuring plans, as before ``engine.REFRESH``).

Prints tokens/s and its ratio to AR, tokens per target pass, and each profile's 1-, 2- and 5-token prices at the end;
and the CPU's instruction sets and the kernel's (an AVX2-class run emulated on an AVX-512 CPU says avx2 there).

Usage: python benchmarks/ab_stale_prices.py [--mode eager|compiled] [--prompts 32] [--settle 8] [--slow 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import everyday  # noqa: E402 (this folder's modules)
from turns import balanced_turns  # noqa: E402

from fuzzyspec import tuning  # noqa: E402
from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core import engine, kernels  # noqa: E402
from fuzzyspec.core.cost import Profile  # noqa: E402

NEW_TOKENS = 128
VARIANTS = ("ar", "clean", "refresh", "norefresh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--settle", type=int, default=8)
    parser.add_argument("--slow", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    compiled = args.mode == "compiled"
    pair = ModelPair.load(weights="int4", compile=compiled)
    print(f"ab_stale_prices: {tuning.machine()}; int4 kernel for {kernels.isa()}; int4 {args.mode}; "
          f"{args.prompts} everyday prompts x {NEW_TOKENS} tokens, greedy; settled on {args.settle}, 1-4 token passes "
          f"then priced x{args.slow}; {time.strftime('%Y-%m-%d')}", flush=True)
    if compiled:
        tuning.prepare(pair, pair.config(max_new_tokens=NEW_TOKENS, eos_token_ids=()))
    prompts = [pair.encode(prompt) for _, prompt in everyday(args.prompts)]
    shipped = engine.REFRESH

    def answer(ids: torch.Tensor, variant: str) -> tuple[int, float, int]:
        engine.REFRESH = 10**9 if variant == "norefresh" else shipped
        pair.step.profile = profiles[variant]
        start = time.perf_counter()
        result = pair.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_ids=(),
                               **({"method": "ar"} if variant == "ar" else {}))
        return result.stats.new_tokens, time.perf_counter() - start, result.stats.target_forwards

    profiles = {"clean": Profile()}
    for ids in prompts[: args.settle]:
        answer(ids, "clean")
    settled = profiles["clean"].to_dict()
    slow = {**settled, "target": {w: ms * (args.slow if int(w) <= 4 else 1.0) for w, ms in settled["target"].items()}}
    profiles = {"ar": Profile(), "clean": Profile.from_dict(settled), "refresh": Profile.from_dict(slow),
                "norefresh": Profile.from_dict(slow)}
    totals = {variant: [0, 0.0, 0] for variant in VARIANTS}  # tokens, seconds, passes
    for index, (ids, order) in enumerate(zip(prompts, balanced_turns(VARIANTS, len(prompts)))):
        for variant in order:
            for i, value in enumerate(answer(ids, variant)):
                totals[variant][i] += value
        print(f"ab_stale_prices: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    engine.REFRESH = shipped
    ar = totals["ar"][0] / totals["ar"][1]
    for variant in VARIANTS:
        tokens, seconds, passes = totals[variant]
        prices = ", ".join(f"{w}: {profiles[variant].target_ms(w):.2f}" for w in (1, 2, 5))
        print(f"{variant:10s} {tokens / seconds:7.1f} tok/s  x AR {tokens / seconds / ar:.3f}  "
              f"tok/pass {tokens / passes:.2f}  priced at the end (ms by width) {prices}")


if __name__ == "__main__":
    main()
