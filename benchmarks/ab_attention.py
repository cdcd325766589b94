"""Our attention kernel (``fuzzyspec/core/layer_kernel.cpp``'s ``attend``) against another commit's, A/B in one
process, at the embedded target's shapes: 30 layers' calls for k queries after n cached positions (9 heads
sharing 3 kv heads, 64 dimensions, a cache of n + 128 positions, float16 as a 4-bit target keeps it or float32),
with the caches warm, and after 160 MB of other memory traffic (as in decoding, where the weights stream through
between two layers' attention). The two builds are checked first on a spread of shapes and random masks: they must
give close numbers, and it says whether they are the same bit for bit (where the arithmetic's order is unchanged,
only time differs).

With --steps, it also times the embedded 4-bit target's eager steps of 1 and 6 tokens after each context (over its
float16 cache), the two kernels taking turns: what a step gains.

Usage: python benchmarks/ab_attention.py [--before af51a4c] [--threads 2] [--positions 128,512,2000]
           [--queries 1,2,4,6,8,17] [--dtype float16] [--steps]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_cache_dtype import after_context, prefilled  # noqa: E402 (this folder's modules)
from ab_int4_kernel import before_and_after, interleaved  # noqa: E402

from fuzzyspec.api import ModelPair  # noqa: E402

from fuzzyspec.core import kernels  # noqa: E402
from fuzzyspec.core.kvcache import attention_mask, chain_tree  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

SOURCE = "fuzzyspec/core/layer_kernel.cpp"
# (rows, queries, heads, kv heads, dimensions, cache positions)
SHAPES = [(1, 1, 9, 3, 64, 256), (1, 6, 9, 3, 64, 256), (2, 5, 8, 2, 128, 64), (1, 3, 7, 1, 36, 40),
          (3, 4, 4, 4, 80, 33), (1, 17, 14, 2, 64, 300), (2, 2, 12, 3, 20, 16), (2, 3, 9, 3, 64, 2100),
          (1, 2, 6, 2, 12, 700)]


def same_numbers(before, after, generator: torch.Generator) -> bool:
    """Whether the two builds give the same numbers bit for bit on every shape tried (it stops where they are not
    even close)."""
    same = True
    for rows, queries, heads, kv_heads, dim, positions in SHAPES:
        for _ in range(3):
            q = torch.randn(rows, queries, heads, dim, generator=generator)
            k, v = (torch.randn(rows + 1, kv_heads, positions, dim, generator=generator) for _ in range(2))
            mask = torch.rand(rows, 1, queries, positions, generator=generator) < 0.6
            mask[..., 0] = True
            old, new = before.attend(q, k, v, mask, 0.3), after.attend(q, k, v, mask, 0.3)
            if not torch.allclose(old, new, rtol=1e-4, atol=1e-5):
                shape = (rows, queries, heads, kv_heads, dim, positions)
                raise SystemExit(f"ab_attention: the builds differ at {shape}")
            same = same and torch.equal(old, new)
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="af51a4c", help="the commit whose kernel is the baseline")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", default="128", help="cached positions before the queries, comma-separated")
    parser.add_argument("--queries", default="1,2,4,6,8,17", help="queries a pass, comma-separated")
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="the cache's")
    parser.add_argument("--steps", action="store_true", help="also time the embedded target's eager steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"ab_attention: {kernels.unavailable()}")
    ops = before_and_after(SOURCE, args.before, "fuzzyspec_attention", prefix="attention_")
    print(f"ab_attention: CPU {cpu_isa()}; {args.threads} threads; torch {torch.__version__}; before: {args.before}, "
          f"after: the working tree; {time.strftime('%Y-%m-%d')}")
    generator = torch.Generator().manual_seed(0)
    print("the same numbers bit for bit on every shape tried" if same_numbers(ops["before"], ops["after"], generator)
          else "close numbers on every shape tried, not the same bit for bit (the arithmetic's order changed)")
    kv_heads, dim, layers = 3, 64, 30
    other = torch.zeros(40_000_000, dtype=torch.int32)  # 160 MB
    for positions in (int(n) for n in args.positions.split(",")):
        capacity = positions + 128
        keys = [torch.randn(1, kv_heads, capacity, dim, generator=generator).to(getattr(torch, args.dtype))
                for _ in range(layers)]
        values = [torch.randn(1, kv_heads, capacity, dim, generator=generator).to(getattr(torch, args.dtype))
                  for _ in range(layers)]
        print(f"30 layers' attention of k queries after {positions} positions ({args.dtype} cache): ms, median of 30, "
              "interleaved")
        for queries in (int(k) for k in args.queries.split(",")):
            time_queries(ops, keys, values, other, positions, queries, generator)
    if args.steps:
        time_steps(ops, [int(n) for n in args.positions.split(",")], generator)


def time_steps(ops: dict, contexts: list[int], generator: torch.Generator) -> None:
    """The embedded 4-bit target's eager steps of 1 and 6 tokens after each context, each kernel's in turn."""
    model = ModelPair.load(draft=None, weights="int4").target
    step = TargetStep(model, compile=False)
    shipped = torch.ops.fuzzyspec_attention
    print(f"the embedded target's eager step (int4, a {step.cache_dtype} cache): ms, median of 40, interleaved")
    try:
        for context in contexts:
            capacity = max(256, 1 << (context + 6).bit_length())  # as the engine doubles its cache
            tokens = torch.randint(0, model.config.vocab_size, (1, context + 6), generator=generator)
            with torch.inference_mode():
                cache = prefilled(step, tokens, context, capacity)
                line = f"  context {context:5d}:"
                for width in (1, 6):
                    feed, positions, mask = after_context(tokens, context, width, capacity)

                    def run(tag: str) -> None:
                        torch.ops.fuzzyspec_attention = ops[tag]
                        step(cache, feed, positions, positions, mask, None, 0, (), compiled=False)
                    for tag in ops:
                        run(tag)
                    medians = interleaved(run, tuple(ops), 40)
                    before, after = (1e3 * medians[tag] for tag in ("before", "after"))
                    line += f"   {width} token{'s' if width > 1 else ' '}: before {before:6.2f}, after {after:6.2f} " \
                            f"({before / after:.2f}x)"
                print(line, flush=True)
    finally:
        torch.ops.fuzzyspec_attention = shipped


def time_queries(ops: dict, keys: list, values: list, other: torch.Tensor, positions: int, queries: int,
                 generator: torch.Generator) -> None:
    heads, dim, layers, capacity = 9, keys[0].shape[-1], len(keys), keys[0].shape[2]
    q = torch.randn(1, queries, heads, dim, generator=generator)
    mask = attention_mask(torch.tensor([positions]), chain_tree(1, queries, torch.device("cpu")), capacity)
    times = {(tag, state): [] for tag in ops for state in ("warm", "after traffic")}
    for repeat in range(30):
        for tag in (("before", "after") if repeat % 2 else ("after", "before")):
            for state in ("after traffic", "warm"):
                if state == "after traffic":
                    other.add_(1)
                start = time.perf_counter()
                for layer in range(layers):
                    ops[tag].attend(q, keys[layer], values[layer], mask, dim ** -0.5)
                times[tag, state].append(time.perf_counter() - start)
    ms = {key: statistics.median(value) * 1e3 for key, value in times.items()}
    print(f"  k = {queries:2d}  " + "   ".join(
        f"{state}: before {ms['before', state]:.3f} after {ms['after', state]:.3f} "
        f"({ms['before', state] / ms['after', state]:.2f}x)" for state in ("warm", "after traffic")), flush=True)


if __name__ == "__main__":
    main()
