"""A compiled CPU step called as the engine calls it (``step.Compiled``: dynamo's frame evaluation and cache lookup on
every call) against the same forward compiled with dynamo's ``aot_compile`` and called with its guard check off (the
traced bytecode and inductor's code, nothing before them), one process, interleaved.

What it measures is the per-call cost a direct call could save: a lead, not a change shipped. What it needs to ship
(not done): ``aot_compile`` refuses frozen weights unless AOTAutograd's cache is off, so every process would trace
each shape again; the head's capacity dimension is dynamic; the GPU path captures graphs over the dynamo-compiled
function (``core.graphs``).

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
        found: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(6):
            for name, call in calls.items():
                times = []
                for _ in range(40):
                    clock = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - clock)
                found[name].append(1000 * statistics.median(times))
    for name, medians in found.items():
        print(f"{name:<30} {' '.join(f'{ms:.3f}' for ms in medians)}  min {min(medians):.3f} ms", flush=True)
    head_calls(pair, args.width)


def head_calls(pair: ModelPair, width: int) -> None:
    """The same comparison for the shipped EAGLE head's step (``HeadStep``: one decoder layer), after 99 cached
    positions of a 256-position cache; its direct way compiled for that capacity alone (the engine's graph keeps the
    capacity a symbol)."""
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
        mask = torch.zeros(1, 1, width, cache.capacity, dtype=torch.bool)
        mask[..., : 99 + width] = torch.ones(width, 99 + width, dtype=torch.bool).tril(99)
        write = torch.arange(99, 99 + width)[None]
        inputs = (cache.keys, cache.values, tokens[:, 1: 1 + width].clone(), features[:, :width].clone(), write.clone(),
                  write, mask)
        clock = time.perf_counter()
        with torch._inductor.config.patch(freezing=False):
            direct = torch.compile(step.forward, fullgraph=True, dynamic=False, options=CPU_INDUCTOR).aot_compile(
                (inputs, {}))
        print(f"\nEAGLE head, {width} token(s): aot_compile {time.perf_counter() - clock:.1f} s", flush=True)
        direct.disable_guard_check()
        found: dict[str, list[float]] = {"as the engine calls it": [], "aot_compile, no guard check": []}
        for _ in range(6):
            for name, call in (("as the engine calls it", usual),
                               ("aot_compile, no guard check", lambda: direct(step, *inputs))):
                times = []
                for _ in range(100):
                    clock = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - clock)
                found[name].append(1000 * statistics.median(times))
    for name, medians in found.items():
        print(f"{name:<30} {' '.join(f'{ms:.3f}' for ms in medians)}  min {min(medians):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
