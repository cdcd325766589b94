"""Batched decoding throughput on the embedded pair: tokens/s at batch 1, 4 and 16.

N held-out ShareGPT prompts (default 16) x M new tokens (EOS does not stop a row, so every row yields
M tokens), greedy, gamma 5, a drafter by name (default: the shipped draft LM). For each method and batch
size B, the prompts are decoded B at a time by the engine (a full batch per group, rows leaving as they
finish), and
the single-sequence loop ``decode`` runs the same prompts one by one as the reference. Printed:
total tokens / total seconds, the ratio to the single-sequence loop, tokens per target pass (per row), and
how many rows equal their single-sequence output token for token (bfloat16 rounds differently at
different batch shapes, so a few greedy rows can part ways where two tokens are nearly tied).

Usage: python benchmarks/bench_batching.py [--prompts 16] [--max-new-tokens 64] [--batch-sizes 1,4,16]
           [--methods ar,sd,fsd] [--threshold 0.5] [--draft draft] [--tree] [--threads 2] [--dtype auto]
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time

import torch

from fuzzyspec.api import ModelPair
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import Engine, Job, decode
from fuzzyspec.eval.tasks import get_task


def run_batched(pair: ModelPair, prompts: list[torch.Tensor], config: DecodeConfig, batch: int
                ) -> tuple[list[list[int]], float, int]:
    outputs, seconds, passes = [], 0.0, 0
    for start in range(0, len(prompts), batch):
        decoder = Engine(pair.step, pair.vocab_size)
        began = time.perf_counter()
        group = prompts[start: start + batch]
        rows = decoder.add_many([Job(ids, config, pair.drafter(config)) for ids in group])
        while decoder.rows:
            decoder.step()
        seconds += time.perf_counter() - began
        passes += sum(row.stats.target_forwards for row in rows)  # one per step the row took part in
        outputs += [row.tokens for row in rows]
    return outputs, seconds, passes


def run_single(pair: ModelPair, prompts: list[torch.Tensor], config: DecodeConfig
               ) -> tuple[list[list[int]], float, int]:
    outputs, seconds, passes = [], 0.0, 0
    for ids in prompts:
        tokens, stats = decode(pair.target, pair.drafter(config), ids, config, pair.vocab_size)
        seconds += stats.wall_s
        passes += stats.target_forwards
        outputs.append(tokens[0].tolist())
    return outputs, seconds, passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--methods", default="ar,sd,fsd")
    parser.add_argument("--threshold", type=float, default=0.5, help="T of fsd (js)")
    parser.add_argument("--draft", default="draft", help="the drafter, by name (default: the shipped draft LM)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tree", action="store_true", help="draft EAGLE-2 trees 16/5/4 (needs --draft eagle)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    pair = ModelPair.load(draft=args.draft, dtype=args.dtype)
    prompts = [pair.encode(e.prompt) for e in get_task("freeform").examples(args.prompts)]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"fuzzyspec bench_batching: SmolLM2-135M-Instruct + drafter {args.draft}, {len(prompts)} held-out prompts "
          f"x {args.max_new_tokens} tokens, greedy, {'trees 16/5/4' if args.tree else 'gamma 5'}, {pair.target.dtype}, {args.threads} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'method':<12} {'decoder':<14} {'tok/s':>7} {'x single':>8} {'tok/pass':>8} {'same as single':>15}")
    for method in args.methods.split(","):
        config = DecodeConfig(method=method, threshold=args.threshold, max_new_tokens=args.max_new_tokens,
                              tree=args.tree and method != "ar")
        warm = dataclasses.replace(config, max_new_tokens=4)
        run_single(pair, prompts[:1], warm)
        run_batched(pair, prompts[:2], warm, 2)
        reference, seconds, passes = run_single(pair, prompts, config)
        tokens = sum(map(len, reference))
        base = tokens / seconds
        print(f"{method:<12} {'single loop':<14} {base:>7.1f} {1.0:>8.2f} {tokens / passes:>8.2f} {'-':>15}",
              flush=True)
        for batch in sizes:
            outputs, seconds, passes = run_batched(pair, prompts, config, batch)
            tokens = sum(map(len, outputs))
            same = sum(a == b for a, b in zip(outputs, reference))
            per_pass = tokens / passes  # per row: a batched pass counts once for each row in it
            print(f"{method:<12} {f'batch {batch}':<14} {tokens / seconds:>7.1f} {tokens / seconds / base:>8.2f} "
                  f"{per_pass:>8.2f} {f'{same}/{len(prompts)}':>15}", flush=True)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
