"""The int4 kernel's products from this checkout against an earlier commit's, in one process.

A shared machine's pace moves by half within minutes, so builds timed in separate processes, or always in the same
order, differ by more than a kernel change does (in a fixed order, three builds that then measured alike in turns
had each run 3-10% faster than the one timed first). So both ``int4_kernel.cpp`` sources are built here as plain
shared libraries (no torch ops: their registrations would clash), with the flags the kernels get on this machine,
loaded side by side through ctypes, checked to give the same bits, and timed in turns whose order rotates every
round: a model's products at each token count, best and median over the rounds.

The model is the embedded target's shapes: 30 layers' distinct 4-bit weights (q|k|v 960 x 576, o 576 x 576,
gate|up 3,072 x 576, down 576 x 1,536: 66 MB, more than the caches hold, so they stream from memory as in decoding),
or with ``--format q8`` its 8-bit LM head (49,152 x 576), three copies. Random bytes: speed does not depend on them.

Usage: python benchmarks/ab_kernels.py --before COMMIT [--format q4|q8] [--tokens 1,2,4,6,8,17] [--rounds 20]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from bench_step import ROOT  # (this folder's modules)

from fuzzyspec.core import kernels
from fuzzyspec.core.int4 import q8_sums
from fuzzyspec.core.kernels import ROWS
from fuzzyspec.tuning import machine

BYTES = {"q4": 4 * 64 + 16 * 2 + 16 * 2, "q8": 8 * 64 + 16 * 2 + (16 * 4 if q8_sums() else 0)}  # (kernels.h)
SYMBOL = {"q4": "_ZN9fuzzyspec10product_q4EPKfllPKhlPf", "q8": "_ZN9fuzzyspec10product_q8EPKfllPKhlPf"}
SHAPES = {"q4": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30, "q8": [(49152, 576)] * 3}


def build(source: str, folder: Path, name: str) -> Path:
    """``source`` (int4_kernel.cpp's text) built as ``folder/name.so``, beside the header it includes."""
    (folder / f"{name}.cpp").write_text(source)
    library = folder / f"{name}.so"
    torch_lib = Path(torch.__file__).parent / "lib"
    # (-fopenmp: a source from before 2026-11-29 runs on torch's threads through ATen/Parallel.h's inline OpenMP)
    command = ["g++", "-shared", "-fPIC", "-std=c++17", "-fopenmp", *kernels.build_flags(), str(folder / f"{name}.cpp"),
               "-o", str(library), *(f"-I{path}" for path in cpp_extension.include_paths()),
               f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    try:
        built = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit("ab_kernels: no C++ compiler (g++) here")
    if built.returncode:
        sys.exit(f"ab_kernels: building {name} failed: {(built.stderr.strip().splitlines() or ['no compiler?'])[-1]}")
    return library


def product(library: Path, form: str):
    function = getattr(ctypes.CDLL(str(library)), SYMBOL[form])
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_void_p]
    return function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit whose int4_kernel.cpp this checkout's meets")
    parser.add_argument("--format", choices=sorted(SHAPES), default="q4")
    parser.add_argument("--tokens", default="1,2,4,6,8,17", help="token counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(count) for count in args.tokens.split(",")]
    here = ROOT / "fuzzyspec" / "core"
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:fuzzyspec/core/int4_kernel.cpp"],
                           capture_output=True, text=True)
    if shown.returncode:
        sys.exit(f"ab_kernels: no int4_kernel.cpp at {args.before}: {shown.stderr.strip().splitlines()[-1]}")
    before = shown.stdout
    folder = Path(tempfile.mkdtemp(prefix="fuzzyspec-ab-kernels-"))
    (folder / "kernels.h").write_text((here / "kernels.h").read_text())
    print(f"fuzzyspec ab_kernels: {machine()}; kernels built for {kernels.isa()}; {args.format} products; "
          f"{args.rounds} rounds", flush=True)
    sides = {f"at {args.before}": product(build(before, folder, "before"), args.format),
             "this checkout": product(build((here / "int4_kernel.cpp").read_text(), folder, "here"), args.format)}
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randint(0, 256, (n // ROWS, k // 32, BYTES[args.format]), dtype=torch.uint8, generator=generator)
               for n, k in SHAPES[args.format]]
    inputs = {m: {k: torch.randn(m, k, generator=generator) for _, k in SHAPES[args.format]} for m in counts}
    outputs = {m: {n: torch.empty(m, n) for n, _ in SHAPES[args.format]} for m in counts}

    def model(function, m: int) -> float:
        start = time.perf_counter()
        for (n, k), weight in zip(SHAPES[args.format], weights):
            function(inputs[m][k].data_ptr(), m, k, weight.data_ptr(), n // ROWS, outputs[m][n].data_ptr())
        return 1000 * (time.perf_counter() - start)

    for m in counts:  # the same bits (random scales hold NaNs: compared as integers)
        (n, k), weight = SHAPES[args.format][-1], weights[-1]
        results = []
        for function in sides.values():
            out = torch.empty(m, n)
            function(inputs[m][k].data_ptr(), m, k, weight.data_ptr(), n // ROWS, out.data_ptr())
            results.append(out.view(torch.int32))
        if not torch.equal(results[0], results[1]):
            sys.exit(f"ab_kernels: the two builds' products differ at {m} tokens")
    times = {(side, m): [] for side in sides for m in counts}
    order = list(sides.items())
    for round_ in range(args.rounds):
        for m in counts:
            turn = order[round_ % 2:] + order[: round_ % 2]
            for side, function in turn:
                times[side, m].append(model(function, m))
        print(f"ab_kernels: round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    for side in sides:
        print(f"  {side:24s} ms, best:", "  ".join(f"{m}: {min(times[side, m]):.2f}" for m in counts))
    new, old = "this checkout", f"at {args.before}"
    for name, pick in (("best", min), ("median", statistics.median)):
        print(f"  this checkout's time / before's ({name}):",
              "  ".join(f"{m}: {pick(times[new, m]) / pick(times[old, m]):.3f}" for m in counts))


if __name__ == "__main__":
    main()
