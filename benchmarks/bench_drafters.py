"""Benchmark the shipped drafters of the embedded target: chains, and EAGLE-2 trees.

On N held-out ShareGPT prompts (conversations that training never saw), greedy,
M new tokens each (EOS does not stop a run, so every run yields M tokens), all in
one process with the configurations interleaved per prompt (the starting one
rotating), so machine noise hits all alike:

  AR                          the target alone
  draft LM sd / fsd T         chains from the shipped draft LM (gamma drafts)
  EAGLE head sd / fsd T       chains from the shipped EAGLE head
  EAGLE-2 tree sd / fsd T     (--trees) EAGLE-2 dynamic trees from the same head

Columns: tokens/s, its ratio to AR, tokens per target pass (mean accepted + 1),
and two reference-free quality figures: "prefix", the mean fraction of the M
tokens produced before the first difference from AR's greedy output (1.00 =
identical), and "nll", the target's mean negative log-likelihood per token of
the generated text (lower = more what the target itself would say; AR's greedy
text sets the baseline).

Usage: python benchmarks/bench_drafters.py [--prompts 50] [--max-new-tokens 128] [--gamma 5]
           [--thresholds 0.3] [--tree-thresholds T,...] [--divergence js] [--fuzzy-rule fsd] [--trees]
           [--tree-total-tokens 16] [--tree-depth 5] [--tree-top-k 4] [--no-chains] [--threads 2] [--json PATH]
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
from fuzzyspec.quality import first_difference, target_nll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--thresholds", default="0.3", help="comma-separated FSD thresholds ('' for none)")
    parser.add_argument("--tree-thresholds", default=None, help="FSD thresholds for trees (default: --thresholds)")
    parser.add_argument("--divergence", default="js")
    parser.add_argument("--fuzzy-rule", default="fsd", choices=["fsd", "fsd-hybrid"],
                        help="the rule run at each threshold (default: fsd)")
    parser.add_argument("--trees", action="store_true", help="add EAGLE-2 tree configurations")
    parser.add_argument("--no-chains", action="store_true", help="leave out the chain configurations")
    parser.add_argument("--tree-total-tokens", type=int, default=16)
    parser.add_argument("--tree-depth", type=int, default=5)
    parser.add_argument("--tree-top-k", type=int, default=4)
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
    tree = dict(tree=True, tree_total_tokens=args.tree_total_tokens, tree_depth=args.tree_depth,
                tree_top_k=args.tree_top_k)
    tree_thresholds = thresholds if args.tree_thresholds is None else \
        [float(t) for t in args.tree_thresholds.split(",") if t]
    families = [] if args.no_chains else [("draft LM", draft_lm, {}, thresholds), ("EAGLE head", eagle, {}, thresholds)]
    if args.trees:
        families.append((f"EAGLE-2 tree {args.tree_total_tokens}/{args.tree_depth}/{args.tree_top_k}", eagle, tree,
                         tree_thresholds))
    configs = [("AR", draft_lm, dict(method="ar"))]
    for name, pair, extra, thresholds in families:
        configs.append((f"{name} sd", pair, dict(method="sd", **extra)))
        configs += [(f"{name} {args.fuzzy_rule} {args.divergence} T={t}", pair,
                     dict(method=args.fuzzy_rule, divergence=args.divergence, threshold=t, **extra))
                    for t in thresholds]
    totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "prefix": 0.0, "nll": 0.0} for name, _, _ in configs}
    common = dict(gamma=args.gamma, max_new_tokens=args.max_new_tokens, eos_token_ids=())

    for name, pair, options in configs:  # warm-up
        pair.generate(texts[0], **{**common, **options, "max_new_tokens": 8})
    for i, text in enumerate(texts):
        ids = draft_lm.encode(text)
        outputs = {}
        for name, pair, options in configs[i % len(configs):] + configs[: i % len(configs)]:
            start = time.perf_counter()
            result = pair.generate(ids, **common, **options)
            seconds = time.perf_counter() - start
            row = totals[name]
            row["tokens"] += result.stats.new_tokens
            row["seconds"] += seconds
            row["forwards"] += result.stats.target_forwards
            outputs[name] = result.tokens
        for name, tokens in outputs.items():  # quality, outside the timed calls
            totals[name]["prefix"] += first_difference(tokens, outputs["AR"]) / max(len(outputs["AR"]), 1)
            totals[name]["nll"] += target_nll(draft_lm.target, ids, tokens, draft_lm.vocab_size)
        print(f"[{i + 1}/{len(texts)}] done", file=sys.stderr, flush=True)

    ar_speed = totals["AR"]["tokens"] / totals["AR"]["seconds"]
    print(f"fuzzyspec bench_drafters: SmolLM2-135M-Instruct, {len(texts)} held-out ShareGPT prompts x "
          f"{args.max_new_tokens} tokens, greedy, gamma {args.gamma}, bfloat16, {args.threads} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'configuration':<36} {'tok/s':>7} {'xAR':>6} {'tok/pass':>9} {'prefix':>7} {'nll':>6}")
    rows = []
    for name, _, _ in configs:
        row = totals[name]
        speed = row["tokens"] / row["seconds"]
        result = {"configuration": name, "tokens_per_s": speed, "vs_ar": speed / ar_speed,
                  "tokens_per_target_pass": row["tokens"] / row["forwards"],
                  "prefix_same_as_ar": row["prefix"] / len(texts), "target_nll": row["nll"] / len(texts)}
        rows.append(result)
        print(f"{name:<36} {speed:>7.1f} {result['vs_ar']:>6.2f} {result['tokens_per_target_pass']:>9.2f} "
              f"{result['prefix_same_as_ar']:>7.2f} {result['target_nll']:>6.3f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "rows": rows}, file, indent=2)


if __name__ == "__main__":
    main()
