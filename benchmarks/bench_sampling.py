"""Drawing a token: torch.multinomial against the inverse transform sampling of ``core.sampling.sample``.

In one process, on the embedded SmolLM2-135M-Instruct (its default weights form, eager), sampled decoding
(temperature 0.7) of everyday prompts (fuzzyspec/prompts/everyday.jsonl), each configuration run with both
samplers, interleaved per prompt, with the same seeds: tokens/s and the ratio. First, what one draw costs
over the 49,152-token vocabulary. Both samplers draw from the same distribution (tests/core/test_sampling.py
and the engine's chi-square tests check ours); only the random stream differs, so the texts differ.

Usage: python benchmarks/bench_sampling.py [--prompts 8] [--max-new-tokens 128] [--threads 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.core import engine, judge, rules, sampling, tree_rules

EVERYDAY = Path(__file__).resolve().parents[1] / "fuzzyspec" / "prompts" / "everyday.jsonl"
ROWS = {"ar": (None, {"method": "ar"}), "default job (EAGLE-2 trees, sd)": ("default", {}),
        "draft LM chain sd, gamma 5": ("draft", {"method": "sd", "gamma_schedule": "constant"})}


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@contextlib.contextmanager
def sampler(draw):
    """Every module that draws tokens uses ``draw`` inside the block."""
    modules = (sampling, rules, judge, engine, tree_rules)
    saved = [module.sample for module in modules]
    for module in modules:
        module.sample = draw
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.sample = original


def draw_ms(draw, rows: int, repeats: int = 200) -> float:
    probs = torch.randn(rows, 49152).mul(3).softmax(-1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        draw(probs, generator)
    start = time.perf_counter()
    for _ in range(repeats):
        draw(probs, generator)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samplers = {"multinomial": multinomial, "inverse transform": sampling.sample}
    report = {"machine": tuning.machine(), "date": time.strftime("%Y-%m-%d"), "draw_ms": {}, "decoding": {}}
    print(f"bench_sampling: {report['machine']}; {report['date']}")
    print("\none draw over 49,152 tokens, ms (rows at once)")
    for name, draw in samplers.items():
        report["draw_ms"][name] = {rows: draw_ms(draw, rows) for rows in (1, 8)}
        print(f"  {name:<18} " + "  ".join(f"{rows} row{'s' * (rows > 1)}: {ms:.3f}"
                                          for rows, ms in report["draw_ms"][name].items()))
    prompts = [json.loads(line)["prompt"] for line in EVERYDAY.read_text().splitlines() if line.strip()]
    prompts = prompts[:: max(len(prompts) // args.prompts, 1)][: args.prompts]
    base = ModelPair.load(draft=None)
    pairs = {row: base if draft is None else base.with_drafter(draft) for row, (draft, _) in ROWS.items()}
    totals = {(row, name): [0, 0.0] for row in ROWS for name in samplers}
    for row, (_, options) in ROWS.items():  # warm up: the first call of each drafter pays one-off costs
        pairs[row].generate(prompts[0], config=pairs[row].config(max_new_tokens=8, temperature=0.7, seed=0, **options))
    for index, prompt in enumerate(prompts):
        for row, (_, options) in ROWS.items():
            config = pairs[row].config(max_new_tokens=args.max_new_tokens, temperature=0.7, seed=index, **options)
            order = list(samplers.items())[:: 1 if index % 2 == 0 else -1]  # alternate which goes first
            for name, draw in order:
                with sampler(draw):
                    stats = pairs[row].generate(prompt, config=config).stats
                totals[row, name][0] += stats.new_tokens
                totals[row, name][1] += stats.wall_s
        print(f"  prompt {index + 1}/{len(prompts)} done", flush=True)
    print(f"\nsampled decoding (temperature 0.7), {len(prompts)} everyday prompts x {args.max_new_tokens} tokens, "
          f"{str(base.target.dtype) if base.profile_key.split('|')[1] != 'int4' else 'int4'} weights, eager")
    print(f"  {'configuration':<34} {'multinomial':>12} {'inverse':>9} {'ratio':>6}   tok/s")
    for row in ROWS:
        rates = {name: totals[row, name][0] / totals[row, name][1] for name in samplers}
        report["decoding"][row] = rates
        print(f"  {row:<34} {rates['multinomial']:12.1f} {rates['inverse transform']:9.1f} "
              f"{rates['inverse transform'] / rates['multinomial']:6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
