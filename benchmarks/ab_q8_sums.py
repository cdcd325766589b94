"""An 8-bit product with and without each block's code sums in its bytes, in one process.

The AVX-512 build's 8-bit products take each row's code sums back off, so its blocks carry them (608 bytes a group
of 16 rows and 32 inputs); the AVX2 and AVX-VNNI builds never read them, and pack without them (544 bytes). This
builds this checkout's ``int4_kernel.cpp`` twice, with kernels.h's ``Q8_BYTES`` each way (the code sums are left
unread either way on this machine's build), and times the embedded target's 8-bit LM head (49,152 x 576, three
copies, more than the caches hold) in turns whose order alternates: best and median over the rounds.

Usage: python benchmarks/ab_q8_sums.py [--tokens 1,2,6] [--rounds 16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ab_kernels import build, product  # (this folder's modules)
from bench_step import ROOT

from fuzzyspec.core import kernels
from fuzzyspec.tuning import machine

N, K = 49152, 576
WITH_SUMS = "constexpr int64_t Q8_BYTES = 8 * 64 + 16 * 2 + 16 * 4;"
WITHOUT = "constexpr int64_t Q8_BYTES = 8 * 64 + 16 * 2;"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,6", help="token counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    if kernels.isa() == "avx512-vnni":
        sys.exit("ab_q8_sums: this machine's build reads the code sums; nothing to compare")
    torch.set_num_threads(2)
    here = ROOT / "fuzzyspec" / "core"
    header, source = (here / "kernels.h").read_text(), (here / "int4_kernel.cpp").read_text()
    if WITHOUT not in header:
        sys.exit("ab_q8_sums: kernels.h's Q8_BYTES is not as this script expects")
    print(f"fuzzyspec ab_q8_sums: {machine()}; kernels built for {kernels.isa()}; {args.rounds} rounds", flush=True)
    sides = {}
    for name, bytes_, text in (("with sums", 608, header.replace(WITHOUT, WITH_SUMS)), ("without", 544, header)):
        folder = Path(tempfile.mkdtemp(prefix="fuzzyspec-ab-q8-"))
        (folder / "kernels.h").write_text(text)
        sides[name] = (product(build(source, folder, "q8"), "q8"), bytes_)
    generator = torch.Generator().manual_seed(0)
    weights = {name: [torch.randint(0, 256, (N // 16, K // 32, bytes_), dtype=torch.uint8, generator=generator)
                      for _ in range(3)] for name, (_, bytes_) in sides.items()}
    counts = [int(count) for count in args.tokens.split(",")]
    inputs = {m: torch.randn(m, K, generator=generator) for m in counts}
    out = {m: torch.empty(m, N) for m in counts}
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for m in counts:
            for name in (list(sides) if round_ % 2 else list(sides)[::-1]):
                function = sides[name][0]
                start = time.perf_counter()
                for weight in weights[name]:
                    function(inputs[m].data_ptr(), m, K, weight.data_ptr(), N // 16, out[m].data_ptr())
                times[name, m] = times.get((name, m), []) + [1000 * (time.perf_counter() - start) / 3]
    for name in sides:
        print(f"  {name:10s} ms a product, best (median):",
              "  ".join(f"{m}: {min(times[name, m]):.3f} ({statistics.median(times[name, m]):.3f})" for m in counts))
    for label, pick in (("best", min), ("median", statistics.median)):
        print(f"  without / with sums ({label}):",
              "  ".join(f"{m}: {pick(times['without', m]) / pick(times['with sums', m]):.3f}" for m in counts))


if __name__ == "__main__":
    main()
