"""Teacher-forced measures of drafters on the target's own answers to prompts they never saw.

For each prompt set (``everyday``: fuzzyspec/prompts/everyday.jsonl; ``sharegpt``: held-out ShareGPT),
the embedded target answers every prompt greedily (M tokens, EOS allowed). Each drafter is then run
teacher-forced over prompt + answer, and at every answer position (and, for EAGLE-3 heads, every
unrolled draft step) the script reports: how often the drafter's top token is the target's (top-1),
SD's mean acceptance probability there, 1 - TV(p, q), the median of JS(p, q), and the share of
positions where FSD with JS would accept at T = 0.1 and 0.3. These are the distributions FSD's
threshold acts on: "before" (the previous shipped drafters) and "after" (the retrained ones), on the
same text.

Usage: python benchmarks/eval_drafters.py KIND=DIR ... [--sets everyday,sharegpt] [--prompts 64]
           [--max-new-tokens 128] [--threads 2] [--json PATH]
       KIND is eagle (EAGLE-1/2), eagle3 or draft; DIR a drafter folder ("shipped:eagle", "shipped:draft" for
       the ones in the package).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fuzzyspec.api import ModelPair
from fuzzyspec.data import TokenDataset, prompts, read_sharegpt, split
from fuzzyspec.loading import shipped
from fuzzyspec.eval.tasks import FreeForm
from fuzzyspec.train.config import TrainConfig
from fuzzyspec.train.loop import evaluate, make_objective

EVERYDAY = Path(__file__).resolve().parents[1] / "fuzzyspec" / "prompts" / "everyday.jsonl"


def answers(pair: ModelPair, texts: list, max_new_tokens: int) -> TokenDataset:
    """The target's greedy answers, as prompt + answer sequences learned from the answer on."""
    sequences, starts = [], []
    for i, text in enumerate(texts):
        ids = pair.encode(text)
        result = pair.generate(ids, method="ar", max_new_tokens=max_new_tokens)
        sequences.append(ids[0].tolist() + result.tokens)
        starts.append(ids.shape[1])
        print(f"[answers {i + 1}/{len(texts)}]", file=sys.stderr, flush=True)
    return TokenDataset.from_sequences(sequences, loss_from=starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="KIND=DIR")
    parser.add_argument("--sets", default="everyday,sharegpt")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = ModelPair.load(draft=None, dtype="bfloat16")
    results: dict = {}
    for set_name in [s for s in args.sets.split(",") if s]:
        if set_name == "everyday":
            texts = [e.prompt for e in FreeForm(str(EVERYDAY)).examples(args.prompts)]
        else:
            texts = prompts(split(read_sharegpt())[1], args.prompts, max_chars=2000)
        data = answers(pair, texts, args.max_new_tokens)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        for spec in args.drafters:
            kind, folder = spec.split("=", 1)
            if folder.startswith("shipped:"):
                folder = str(shipped(folder[len("shipped:"):]))
            objective = make_objective(TrainConfig(kind=kind, out="", init=folder), pair.target, data)
            objective.model.eval()
            results.setdefault(spec, {})[set_name] = evaluate(objective, data, 4, autocast)
            print(f"[{set_name}] {spec} done", file=sys.stderr, flush=True)
    print(f"fuzzyspec eval_drafters: the target's greedy answers ({args.max_new_tokens} tokens at most) to "
          f"{args.prompts} prompts per set, teacher-forced, bfloat16")
    print(f"{'drafter':<48} {'set':<9} {'step':>4} {'top-1':>6} {'1-TV':>6} {'JS q50':>7} {'FSD@0.1':>8} {'FSD@0.3':>8}")
    for spec, sets in results.items():
        for set_name, steps in sets.items():
            for step, r in enumerate(steps):
                print(f"{spec[-48:]:<48} {set_name:<9} {step:>4} {r['top1']:>6.3f} {r['sd_acceptance']:>6.3f} "
                      f"{r['js_quantiles']['0.5']:>7.3f} {r['fsd_js_acceptance']['0.1']:>8.3f} "
                      f"{r['fsd_js_acceptance']['0.3']:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
