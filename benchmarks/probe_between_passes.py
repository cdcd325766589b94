"""Where a compiled default-job step's time goes between the target's passes, and what a pass leaves behind.

Three measurements in one process (the embedded 4-bit target, compiled; the shipped EAGLE head):

1. **Step anatomy in decoding**: AR and the default job answer the same everyday prompts in turn (128 greedy
   tokens), with the engine's parts timed from outside (wrappers around the target's pass, proposing, the head's
   calls, the draft's logits, judging, emitting): milliseconds per step of each part, and each pass width's median.
2. **A read before a pass**: a 1-token compiled pass right after reading N MB (as a drafter's bytes would evict the
   target's from the caches), against the same pass after nothing; rounds interleaved, medians.
3. **The head's calls after a pass**: the first to eighth one-token head call right after a target pass (medians),
   and the first call after reading the head's own bytes (its weights and draft rows) or a 100 MB buffer instead.

Usage: python benchmarks/probe_between_passes.py [--prompts 16] [--rounds 60]
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

from bench_drafters import load_prompts  # (this folder's modules)

from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.core import engine
from fuzzyspec.core.step import TargetStep
from fuzzyspec.core.kvcache import HEAD_CAPACITY
from fuzzyspec.core.vocab import reduced_lm_head
from fuzzyspec.drafters import eagle, head_step, lookup
from fuzzyspec.tuning import machine

PARTS = [(engine.Engine, "step", "the whole step"), (TargetStep, "__call__", "target pass"),
         (lookup.CopyFirst, "propose", "proposing (copy or EAGLE)"), (eagle.EagleDrafter, "propose", "EAGLE proposing"),
         (head_step.HeadStep, "__call__", "head calls"), (eagle.EagleDrafter, "_logits", "draft logits"),
         (engine, "judge", "judging"), (engine.Engine, "_emit", "emitting"), (engine.Engine, "_plan", "planning")]


def timed_parts() -> tuple[collections.Counter, collections.Counter, list[tuple[int, float]]]:
    """Wrap ``PARTS`` (seconds and calls of each, summed) and record every pass's (width, ms)."""
    seconds, calls, passes = collections.Counter(), collections.Counter(), []
    for owner, name, label in PARTS:
        function = getattr(owner, name)

        @functools.wraps(function)
        def wrapper(*args, _function=function, _label=label, **kwargs):
            clock = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                took = time.perf_counter() - clock
                seconds[_label] += took
                calls[_label] += 1
                if _label == "target pass":
                    passes.append((args[2].shape[1], 1000 * took))
        setattr(owner, name, wrapper)
    return seconds, calls, passes


def anatomy(pair: ModelPair, count: int) -> None:
    seconds, calls, passes = timed_parts()
    prompts = load_prompts("everyday", count)
    for prompt in prompts[:3]:  # (warm: the widths and cache sizes both jobs use compile here, not below)
        for method in ("ar", None):
            pair.generate(prompt, max_new_tokens=128, **({"method": method} if method else {}))
    for job in ("ar", "default job", "ar", "default job"):
        seconds.clear(), calls.clear(), passes.clear()
        clock = time.perf_counter()
        for prompt in prompts:
            pair.generate(prompt, max_new_tokens=128, **({"method": "ar"} if job == "ar" else {}))
        wall = time.perf_counter() - clock
        steps = calls["the whole step"]
        widths = collections.defaultdict(list)
        for width, ms in passes:
            if width <= 32:  # (not the prompts' prefills)
                widths[width].append(ms)
        print(f"  {job}: {wall:.2f} s, {steps} steps; ms a step: " + ", ".join(
            f"{label} {1000 * seconds[label] / steps:.3f}" for _, _, label in PARTS if calls[label]))
        print("    pass widths (count: median ms): " + ", ".join(
            f"{w} ({len(v)}: {statistics.median(v):.3f})" for w, v in sorted(widths.items()) if len(v) >= 5))


def buffer_of(megabytes: int) -> torch.Tensor:
    return torch.randint(0, 255, (megabytes << 20,), dtype=torch.uint8)


@torch.inference_mode()
def after_reads(run, rounds: int) -> None:
    buffers = {f"{n} MB": buffer_of(n) for n in (2, 5, 10, 20)}
    ways = ["nothing", *buffers]
    times = {way: [] for way in ways}
    for round_ in range(rounds):
        for way in ways if round_ % 2 else ways[::-1]:
            run(), run()
            if way != "nothing":
                buffers[way].sum(dtype=torch.int64)  # (reads every byte, on torch's threads)
            clock = time.perf_counter()
            run()
            times[way].append(1000 * (time.perf_counter() - clock))
    base = statistics.median(times["nothing"])
    print("  a 1-token pass after reading: " + ", ".join(
        f"{way} {statistics.median(t):.3f} ms ({statistics.median(t) - base:+.3f})" for way, t in times.items()))


@torch.inference_mode()
def head_after_pass(pair: ModelPair, run, rounds: int) -> None:
    head = pair.draft.module
    step = head_step.head_step(head, pair.target.get_input_embeddings())
    step.prepare(HEAD_CAPACITY)
    rows = reduced_lm_head(pair.target.get_output_embeddings(), head.vocab)  # (its draft rows, as drafting holds them)
    own = [b for b in head.buffers() if b.dtype == torch.uint8] + [rows.rows.packed]
    cache = step.new_cache(HEAD_CAPACITY)
    hidden = head.config.hidden_size
    step(cache, torch.zeros(1, 8, dtype=torch.long), torch.randn(1, 8, hidden), compiled=True)
    token, feature = torch.zeros(1, 1, dtype=torch.long), torch.randn(1, 1, hidden)

    def call() -> None:
        cache.length = 8
        step(cache, token, feature, compiled=True)

    sequence = [[] for _ in range(8)]
    for _ in range(rounds):
        run()
        for i in range(8):
            clock = time.perf_counter()
            call()
            sequence[i].append(1000 * (time.perf_counter() - clock))
    print("  one-token head calls right after a target pass, 1st to 8th (ms): "
          + ", ".join(f"{statistics.median(s):.3f}" for s in sequence))
    big = buffer_of(100)
    ways = {"after a pass": run,
            "after a pass and reading the head's bytes": lambda: (run(), [b.sum(dtype=torch.int64) for b in own]),
            "after reading 100 MB (no pass)": lambda: big.sum(dtype=torch.int64)}
    times = {way: [] for way in ways}
    for round_ in range(rounds):
        for way, before in (list(ways.items()) if round_ % 2 else list(ways.items())[::-1]):
            call()
            before()
            clock = time.perf_counter()
            call()
            times[way].append(1000 * (time.perf_counter() - clock))
    print(f"  the head's bytes: {sum(b.numel() for b in own) / 2**20:.1f} MB; its first call "
          + ", ".join(f"{way} {statistics.median(t):.3f} ms" for way, t in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    print(f"fuzzyspec probe_between_passes: {machine()}; {time.strftime('%Y-%m-%d')}", flush=True)
    pair = ModelPair.load(weights="int4", compile=True)
    alone = TargetStep(pair.target, compile=True)
    runs, _ = tuning.target_calls(alone, (1,), compiled=True)
    print("2. what a read before a compiled pass costs it", flush=True)
    after_reads(runs[1], args.rounds)
    print("3. the EAGLE head's calls after a target pass", flush=True)
    head_after_pass(pair, runs[1], args.rounds)
    print(f"1. step anatomy in decoding ({args.prompts} everyday prompts x 128 greedy tokens, compiled int4)",
          flush=True)
    anatomy(pair, args.prompts)


if __name__ == "__main__":
    main()
