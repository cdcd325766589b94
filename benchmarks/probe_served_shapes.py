"""Which compiled shapes a served workload meets: requests joining and leaving one batch, as a server's scheduler
seats them, the embedded 4-bit target compiled (kept graphs, ``core.kept``).

Requests (everyday prompts, 16-64 new tokens each, EOS ignored) join at random steps: a busy spell of up to
``--max-rows`` at once, then a quiet one of up to 2 (a server's cache keeps the slots of its busiest moment), first
all AR, then all the default job. Printed: every compiled call's (rows, width, the cache's slots), how many
kept graphs served them, and the seconds it all took (their compilations included, where the folder holds none).

Usage: python benchmarks/probe_served_shapes.py [--prompts 12] [--max-rows 6] [--folder DIR (kept graphs; default:
the machine's own)]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench_drafters import load_prompts  # (this folder's modules)

from fuzzyspec.api import ModelPair
from fuzzyspec.core import kept
from fuzzyspec.core.engine import Engine
from fuzzyspec.core.step import TargetStep
from fuzzyspec.tuning import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-rows", type=int, default=6)
    parser.add_argument("--folder", type=Path, help="where kept graphs go (an empty one: every graph compiles)")
    args = parser.parse_args()
    if args.folder is not None:
        kept.folder = lambda: args.folder
    print(f"fuzzyspec probe_served_shapes: {machine()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    seen: set[tuple[int, int, int]] = set()
    call = TargetStep.__call__

    def recording(self, cache, tokens, *rest, compiled=False, **options):
        if compiled:
            seen.add((tokens.shape[0], tokens.shape[1], cache.keys[0].shape[0]))
        return call(self, cache, tokens, *rest, compiled=compiled, **options)
    TargetStep.__call__ = recording

    pair = ModelPair.load(weights="int4", compile=True)
    prompts = [pair.encode(prompt) for prompt in load_prompts("everyday", args.prompts)]
    chance = random.Random(0)
    clock = time.perf_counter()
    for method in ("ar", None):
        engine, waiting, live = Engine(pair.step, pair.vocab_size), list(prompts), 0
        while waiting or live:
            busy = len(waiting) > len(prompts) // 2
            if waiting and live < (args.max_rows if busy else 2) and chance.random() < 0.4:  # a request arrives
                config = pair.config(max_new_tokens=chance.choice([16, 32, 64]), eos_token_ids=(),
                                     **({"method": method} if method else {}))
                engine.add(waiting.pop(), config, pair.drafter(config))
                live += 1
            if live:
                live -= len(engine.step())
    print(f"{time.perf_counter() - clock:.1f} s; compiled calls' (rows, width, cache slots): {len(seen)} distinct, "
          f"served by {len(pair.step._compiled.calls)} kept graphs")
    print("  " + ", ".join(str(shape) for shape in sorted(seen)))


if __name__ == "__main__":
    main()
