"""Our attention kernel (``fuzzyspec/core/layer_kernel.cpp``'s ``attend``) against another commit's, A/B in one
process, at the embedded target's shapes: 30 layers' calls for k queries after 128 cached positions (9 heads
sharing 3 kv heads, 64 dimensions, a cache of 256), with the caches warm, and after 160 MB of other memory
traffic (as in decoding, where the weights stream through between two layers' attention). The two builds must give
the same numbers bit for bit on a spread of shapes and random masks (checked first), so only time differs.

Usage: python benchmarks/ab_attention.py [--before af51a4c] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_int4_kernel import before_and_after  # noqa: E402 (this folder's module)

from fuzzyspec.core import kernels  # noqa: E402
from fuzzyspec.core.kvcache import attention_mask, chain_tree  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

SOURCE = "fuzzyspec/core/layer_kernel.cpp"
# (rows, queries, heads, kv heads, dimensions, cache positions)
SHAPES = [(1, 1, 9, 3, 64, 256), (1, 6, 9, 3, 64, 256), (2, 5, 8, 2, 128, 64), (1, 3, 7, 1, 36, 40),
          (3, 4, 4, 4, 80, 33), (1, 17, 14, 2, 64, 300), (2, 2, 12, 3, 20, 16)]


def same_numbers(before, after, generator: torch.Generator) -> None:
    for rows, queries, heads, kv_heads, dim, positions in SHAPES:
        for _ in range(3):
            q = torch.randn(rows, queries, heads, dim, generator=generator)
            k, v = (torch.randn(rows + 1, kv_heads, positions, dim, generator=generator) for _ in range(2))
            mask = torch.rand(rows, 1, queries, positions, generator=generator) < 0.6
            mask[..., 0] = True
            if not torch.equal(before.attend(q, k, v, mask, 0.3), after.attend(q, k, v, mask, 0.3)):
                raise SystemExit(f"ab_attention: the builds differ at {(rows, queries, heads, kv_heads, dim, positions)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="af51a4c", help="the commit whose kernel is the baseline")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"ab_attention: {kernels.unavailable()}")
    ops = before_and_after(SOURCE, args.before, ("fuzzyspec_attention", "fuzzyspec_layer"), prefix="attention_")
    print(f"ab_attention: CPU {cpu_isa()}; {args.threads} threads; torch {torch.__version__}; before: {args.before}, "
          f"after: the working tree; {time.strftime('%Y-%m-%d')}")
    generator = torch.Generator().manual_seed(0)
    same_numbers(ops["before"], ops["after"], generator)
    print("the same numbers bit for bit on every shape tried")
    heads, kv_heads, dim, capacity, layers = 9, 3, 64, 256, 30
    keys = [torch.randn(1, kv_heads, capacity, dim, generator=generator) for _ in range(layers)]
    values = [torch.randn(1, kv_heads, capacity, dim, generator=generator) for _ in range(layers)]
    other = torch.zeros(40_000_000, dtype=torch.int32)  # 160 MB
    print("30 layers' attention of k queries after 128 positions: ms, median of 30, interleaved")
    for queries in (1, 2, 4, 6, 8, 17):
        q = torch.randn(1, queries, heads, dim, generator=generator)
        mask = attention_mask(torch.tensor([128]), chain_tree(1, queries, torch.device("cpu")), capacity)
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
