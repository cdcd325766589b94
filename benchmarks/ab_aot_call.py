"""A compiled CPU step called as the engine calls it (``step.Compiled``: dynamo's frame evaluation and cache lookup on
every call) against the same forward compiled with dynamo's ``aot_compile`` and called with its guard check off (the
traced bytecode and inductor's code, nothing before them), one process, interleaved.

For the target it measures what a direct call could save: a lead, not shipped (``aot_compile`` refuses frozen
weights unless AOTAutograd's cache is off, so every process would compile each shape again; the GPU path captures
graphs over the dynamo-compiled function, ``core.graphs``). For the EAGLE head, whose calls ``HeadStep`` makes
direct since 2026-11-27 at the capacity ``prepare`` compiled, it measures that change.

Prints each way's milliseconds a call (median of 40 calls, six rounds, and their minimum), the compile time of the
direct way, whether both give the same logits, and the CPU's instruction sets; then the same for the shipped EAGLE
head's step (100 calls a round; the engine's way includes making its inputs, which the direct way is handed).

Usage: python benchmarks/ab_aot_call.py [--width 1] [--form int4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._functorch.config as functorch_config

from fuzzyspec.api import ModelPair
from fuzzyspec.core.kvcache import StaticCache, attention_mask, chain_tree, write_positions
from fuzzyspec.core.step import CPU_INDUCTOR, TargetStep
from fuzzyspec.loading import cpu_isa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--form", default="int4")
    args = parser.parse_args()
    pair = ModelPair.load(draft=None, weights=args.form)
    step = TargetStep(pair.target, compile=True)
    prefix = 128
    cache = StaticCache.for_model(pair.target.config, 1, 256, step.cache_dtype, "cpu")
    cache.lengths = [prefix]
    start = torch.tensor([prefix])
    tokens = torch.randint(0, 1000, (1, args.width), generator=torch.Generator().manual_seed(0))
    positions = write_positions(start, args.width)
    write = positions.clone()
    mask = attention_mask(start, chain_tree(1, args.width, "cpu"), cache.capacity)
    inputs = (cache, tokens, positions, write, mask, None, 0, step._every_layer)
    print(f"CPU: {cpu_isa()}; {torch.get_num_threads()} threads; torch {torch.__version__}; {args.form} compiled; "
          f"one call of {args.width} token(s) after {prefix} cached", flush=True)
    with torch.inference_mode():
        usual = step(cache, tokens, positions, write, mask, None, 0, (), compiled=True)[0]  # (compiles it)
        forward = step.forward
        functorch_config.enable_autograd_cache = False  # (it refuses frozen weights' compiled code otherwise)
        clock = time.perf_counter()
        direct = torch.compile(forward.forward, fullgraph=True, dynamic=False, options=CPU_INDUCTOR).aot_compile(
            (inputs, {}))
        print(f"aot_compile: {time.perf_counter() - clock:.1f} s", flush=True)
        direct.disable_guard_check()
        print("same logits:", torch.equal(usual, direct(forward, *inputs)[0]), flush=True)
        calls = {"as the engine calls it": lambda: step(cache, tokens, positions, write, mask, None, 0, (),
                                                       compiled=True),
                 "aot_compile, no guard check": lambda: direct(forward, *inputs)}
        report(calls, 40)
    head_calls(pair, args.width)


def report(calls: dict, repeats: int) -> None:
    """Each call's milliseconds: the median of ``repeats`` calls, in six rounds taking the calls in turn."""
    found: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(6):
        for name, call in calls.items():
            times = []
            for _ in range(repeats):
                clock = time.perf_counter()
                call()
                times.append(time.perf_counter() - clock)
            found[name].append(1000 * statistics.median(times))
    for name, medians in found.items():
        print(f"{name:<30} {' '.join(f'{ms:.3f}' for ms in medians)}  min {min(medians):.3f} ms", flush=True)


def head_calls(pair: ModelPair, width: int) -> None:
    """The same comparison for the shipped EAGLE head's step (``HeadStep``: one decoder layer), after 99 cached
    positions of a 256-position cache: its call through dynamo (with the making of its inputs), against the direct
    call of its kept graph (``core.kept``; a direct call of one capacity's graph since 2026-11-27)."""
    from fuzzyspec.core.kvcache import crop_to
    from fuzzyspec.drafters.head_step import head_step

    head = pair.with_drafter("default").draft.module
    step = head_step(head, pair.target.get_input_embeddings())
    cache = step.borrow_cache(step)
    size = head.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 100, size, generator=generator).to(step.dtype)
    tokens = torch.randint(0, 1000, (1, 101), generator=generator)
    with torch.inference_mode():
        step(cache, tokens[:, 1:100], features[:, :99], compiled=True)

        def usual():
            step(cache, tokens[:, 1: 1 + width], features[:, :width], compiled=True)
            crop_to(cache, 99)
        usual()
        kept = step._kept  # (its calls' graphs, kept: ``core.kept``, since 2026-11-28; direct calls since 2026-11-27)
        step._kept = None
        clock = time.perf_counter()
        usual()  # (dynamo's graph, as before 2026-11-27)
        print(f"\nEAGLE head, {width} token(s): dynamo's graph compiled in {time.perf_counter() - clock:.1f} s",
              flush=True)

        def kept_call():
            step._kept = kept
            usual()
            step._kept = None
        report({"through dynamo (as before)": usual, "kept, direct (HeadStep's since)": kept_call}, 100)
        step._kept = kept


if __name__ == "__main__":
    main()
