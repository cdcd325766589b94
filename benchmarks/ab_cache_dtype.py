"""A 4-bit target's cache in float16 (as shipped since 2026-11-27, and as llama.cpp keeps it) against float32 (as
before), A/B in one process: the embedded target's step of k tokens after a context of n cached positions, the two
caches' steps taking turns. A step reads every cached position's keys and values (46 KB a position in float32, for
the embedded target's 30 layers), so what float16 saves grows with the context.

Usage: python benchmarks/ab_cache_dtype.py [--modes eager,compiled] [--contexts 128,512,1024,2000] [--widths 1,6]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_int4_kernel import interleaved  # noqa: E402 (this folder's module)

from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core import kernels  # noqa: E402
from fuzzyspec.core.kvcache import StaticCache, attention_mask, chain_tree, write_positions  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

DTYPES = {"float16": torch.float16, "float32": torch.float32}


def prefilled(step: TargetStep, tokens: torch.Tensor, context: int, capacity: int) -> StaticCache:
    """A one-row cache of ``capacity`` positions in the step's cache dtype, holding the first ``context`` of
    ``tokens`` [1, n] (a prefill runs eagerly)."""
    cache = StaticCache.for_model(step.model.config, 1, capacity, step.cache_dtype, "cpu")
    zero = torch.zeros(1, dtype=torch.long)
    positions = write_positions(zero, context)
    step(cache, tokens[:, :context], positions, positions,
         attention_mask(zero, chain_tree(1, context, "cpu"), capacity), None, 1)
    cache.lengths = [context]
    return cache


def after_context(tokens: torch.Tensor, context: int, width: int, capacity: int) -> tuple[torch.Tensor, ...]:
    """The tokens, positions and mask of a step of ``width`` of ``tokens`` written after ``context`` positions (again
    and again: each run writes the same positions)."""
    start = torch.tensor([context])
    return (tokens[:, context: context + width], write_positions(start, width),
            attention_mask(start, chain_tree(1, width, "cpu"), capacity))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--contexts", default="128,512,1024,2000")
    parser.add_argument("--widths", default="1,6")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(n) for n in args.contexts.split(",")]
    widths = [int(k) for k in args.widths.split(",")]
    model = ModelPair.load(draft=None, weights="int4").target
    print(f"ab_cache_dtype: CPU {cpu_isa()} (torch's kernels for {torch.backends.cpu.get_cpu_capability()}, ours for "
          f"{kernels.isa()}); {args.threads} threads; torch {torch.__version__}; the embedded target in int4 (float32 "
          f"activations); ms of one step, median of {args.repeats}, the two caches interleaved; {time.strftime('%Y-%m-%d')}")
    generator = torch.Generator().manual_seed(0)
    for mode in args.modes.split(","):
        steps = {}
        for name, dtype in DTYPES.items():
            steps[name] = TargetStep(model, compile=mode == "compiled")
            steps[name].cache_dtype = dtype
        for context in contexts:
            capacity = max(256, 1 << (context + max(widths)).bit_length())  # as the engine doubles its cache
            tokens = torch.randint(0, model.config.vocab_size, (1, context + max(widths)), generator=generator)
            with torch.inference_mode():
                caches = {name: prefilled(step, tokens, context, capacity) for name, step in steps.items()}
                line = f"  {mode:8s} context {context:5d}:"
                for width in widths:
                    feed, positions, mask = after_context(tokens, context, width, capacity)

                    def run(name: str) -> None:
                        steps[name](caches[name], feed, positions, positions, mask, None, 0, (),
                                    compiled=mode == "compiled")
                    for name in steps:  # (compiling, or warming)
                        for _ in range(2):
                            run(name)
                    medians = interleaved(run, tuple(steps), args.repeats)
                    half, full = (1e3 * medians[name] for name in DTYPES)
                    line += f"   {width} token{'s' if width > 1 else ' '}: float16 {half:6.2f}, float32 {full:6.2f} " \
                            f"({full / half:.3f}x)"
                print(line, flush=True)


if __name__ == "__main__":
    main()
