"""Benchmark the shipped drafters of the embedded target as chain drafters.

On N held-out ShareGPT prompts (conversations that training never saw), greedy,
M new tokens each (EOS does not stop a run, so every run yields M tokens), gamma
drafts per step, all in one process with the configurations interleaved per
prompt: AR, SD with the shipped draft LM, SD with the shipped EAGLE head, and
FSD with each at the given thresholds. Prints tokens/s, the ratio to AR, and
mean tokens per target pass (accepted drafts + 1).

Usage: python benchmarks/bench_drafters.py [--prompts 50] [--max-new-tokens 128] [--gamma 5]
           [--thresholds 0.3] [--divergence js] [--threads 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from fuzzyspec.api import ModelPair
from fuzzyspec.data import prompts, read_sharegpt, split
from fuzzyspec.loading import load_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--thresholds", default="0.3", help="comma-separated FSD thresholds ('' for none)")
    parser.add_argument("--divergence", default="js")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    _, held_out = split(read_sharegpt())
    texts = prompts(held_out, args.prompts, max_chars=2000)
    draft_lm = ModelPair.load(draft="default")
    eagle = ModelPair(draft_lm.target, draft_lm.tokenizer,
                      load_draft("eagle", draft_lm.target, draft_lm.tokenizer))  # one target in memory
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    configs = [("AR", draft_lm, dict(method="ar"))]
    for name, pair in (("draft LM", draft_lm), ("EAGLE head", eagle)):
        configs.append((f"{name} sd", pair, dict(method="sd")))
        configs += [(f"{name} fsd {args.divergence} T={t}", pair,
                     dict(method="fsd", divergence=args.divergence, threshold=t)) for t in thresholds]
    totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "same_as_ar": 0} for name, _, _ in configs}
    common = dict(gamma=args.gamma, max_new_tokens=args.max_new_tokens, eos_token_ids=())

    for name, pair, options in configs:  # warm-up
        pair.generate(texts[0], **{**common, **options, "max_new_tokens": 8})
    for i, text in enumerate(texts):
        ids = draft_lm.encode(text)
        reference = None
        for name, pair, options in configs[i % len(configs):] + configs[: i % len(configs)]:
            start = time.perf_counter()
            result = pair.generate(ids, **common, **options)
            seconds = time.perf_counter() - start
            row = totals[name]
            row["tokens"] += result.stats.new_tokens
            row["seconds"] += seconds
            row["forwards"] += result.stats.target_forwards
            row.setdefault("tokens_by_prompt", []).append(result.tokens)
        reference = totals["AR"]["tokens_by_prompt"][-1]
        for name in totals:
            totals[name]["same_as_ar"] += totals[name]["tokens_by_prompt"][-1] == reference
        print(f"[{i + 1}/{len(texts)}] done", file=sys.stderr, flush=True)

    ar_speed = totals["AR"]["tokens"] / totals["AR"]["seconds"]
    print(f"fuzzyspec bench_drafters: SmolLM2-135M-Instruct, {len(texts)} held-out ShareGPT prompts x "
          f"{args.max_new_tokens} tokens, greedy, gamma {args.gamma}, bfloat16, {args.threads} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'configuration':<28} {'tok/s':>7} {'xAR':>6} {'tok/pass':>9} {'=AR':>6}")
    rows = []
    for name, _, _ in configs:
        row = totals[name]
        speed = row["tokens"] / row["seconds"]
        per_pass = row["tokens"] / row["forwards"]
        same = row["same_as_ar"] / len(texts)
        print(f"{name:<28} {speed:>7.1f} {speed / ar_speed:>6.2f} {per_pass:>9.2f} {same:>6.2f}")
        rows.append({"configuration": name, "tokens_per_s": speed, "vs_ar": speed / ar_speed,
                     "tokens_per_target_pass": per_pass, "same_tokens_as_ar": same})
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
