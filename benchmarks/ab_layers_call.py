"""A 4-bit target's eager pass with all its layers in one call (``fuzzyspec_layer.decoder_layers``) against a call a
layer (``step.decoder_layer``, as before 2026-11-29), in one process.

The default job answers everyday prompts on the embedded pair; the first target pass of each width it makes (its
verification passes; and AR's one-token pass, from AR answers) is kept with its inputs, then timed both ways in
alternating turns (``--rounds`` turns of ``--calls`` passes each way), the cache as that pass left it. Medians.

Usage: python benchmarks/ab_layers_call.py [--prompts 4] [--rounds 12] [--calls 20] [--widths 1,2,3,4,5,6,8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import everyday  # noqa: E402 (this folder's module)

from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.tuning import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--widths", default="1,2,3,4,5,6,8")
    args = parser.parse_args()
    widths = {int(w) for w in args.widths.split(",")}
    pair = ModelPair.load()
    forward = pair.step.forward
    stacked = forward.stacked
    if stacked is None:
        raise SystemExit("the target's layers do not run whole here (a 4-bit target and our kernels are needed)")
    passes: dict[int, tuple] = {}
    call = TargetStep.__call__

    def keep(step, *inputs, **named):  # (the first pass of each width, with its inputs)
        width = inputs[1].shape[1]
        if width in widths and width not in passes:
            passes[width] = (inputs, named)
        return call(step, *inputs, **named)

    TargetStep.__call__ = keep
    for _, prompt in everyday(args.prompts):
        pair.generate(prompt)
        pair.generate(prompt, method="ar")
    TargetStep.__call__ = call
    print(f"fuzzyspec ab_layers_call: {machine()}; {args.prompts} everyday prompts' passes, {args.rounds} turns of "
          f"{args.calls} passes a way; {time.strftime('%Y-%m-%d')}")
    print("  width  one call (ms)  a call a layer (ms)  saved (ms)  ratio")
    with torch.inference_mode():
        for width in sorted(passes):
            inputs, named = passes[width]
            times: dict[bool, list[float]] = {True: [], False: []}
            for turn in range(args.rounds + 1):
                for whole in ((True, False) if turn % 2 else (False, True)):
                    forward.stacked = stacked if whole else None
                    clock = time.perf_counter()
                    for _ in range(args.calls):
                        pair.step(*inputs, **named)
                    if turn:  # (the first turn warms both ways)
                        times[whole].append((time.perf_counter() - clock) / args.calls * 1000)
            one, each = statistics.median(times[True]), statistics.median(times[False])
            print(f"  {width:5d}  {one:13.3f}  {each:19.3f}  {each - one:10.3f}  {each / one:5.3f}x")
    forward.stacked = stacked


if __name__ == "__main__":
    main()
