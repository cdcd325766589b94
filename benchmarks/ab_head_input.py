"""The EAGLE head's input in one call against its four operations, in one process, the default job's answers taking
turns.

Beside the embedded 4-bit target an eager head step computes fc([embedding ; feature]) + bias in one call
(``fuzzyspec_int4.head_input``) where it made four operations (lookup, concatenation, product, bias), each running
cold after a target pass. This loads the pair once, then answers everyday prompts (128 greedy tokens) with the one
call and without it (the step's ``_input`` taken away), the order alternating from prompt to prompt and round to
round, and prints the head's forward time a call and the answers' wall time each way. Both ways give the same
numbers (tests/drafters/test_head_step.py), so the answers are the same.

Usage: python benchmarks/ab_head_input.py [--prompts 24] [--rounds 2]
"""
from __future__ import annotations

import argparse
import collections
import time

from bench_drafters import load_prompts  # (this folder's modules)

from fuzzyspec.api import ModelPair
from fuzzyspec.drafters import head_step
from fuzzyspec.tuning import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"fuzzyspec ab_head_input: {machine()}; {time.strftime('%Y-%m-%d')}", flush=True)
    pair = ModelPair.load(weights="int4", compile=False)
    prompts = load_prompts("everyday", args.prompts)
    for prompt in prompts[:2]:  # (warm, and makes the head's step)
        pair.generate(prompt, max_new_tokens=128)
    step = next(iter(head_step._STEPS.values()))
    one_call = step._input
    if one_call is None:
        raise SystemExit("ab_head_input: this head's step does not take its input in one call here")
    seconds, calls, wall = collections.Counter(), collections.Counter(), collections.Counter()
    forward = head_step.HeadStep.forward

    def timed(self, *arguments):
        start = time.perf_counter()
        try:
            return forward(self, *arguments)
        finally:
            seconds[self._input is not None] += time.perf_counter() - start
            calls[self._input is not None] += 1

    head_step.HeadStep.forward = timed
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts[2:]):
            for way in ((True, False) if (i + round_) % 2 else (False, True)):
                step._input = one_call if way else None
                start = time.perf_counter()
                pair.generate(prompt, max_new_tokens=128)
                wall[way] += time.perf_counter() - start
    step._input = one_call
    for way, name in ((False, "four operations"), (True, "one call")):
        print(f"  {name:16s} head forward {1000 * seconds[way] / calls[way]:.3f} ms a call ({calls[way]} calls), "
              f"answers {wall[way]:.2f} s")
    forward_ratio = (seconds[True] / calls[True]) / (seconds[False] / calls[False])
    print(f"  one call / four operations: head forward {forward_ratio:.3f}, answers {wall[True] / wall[False]:.3f}")


if __name__ == "__main__":
    main()
