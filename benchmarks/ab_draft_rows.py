"""How the EAGLE head's LM-head rows are held, against how often its drafts pass: the same answers, drafted from
float rows, the target's 8-bit rows, 4-bit rows alone, and 4-bit rows whose highest logits are worked out again
from the 8-bit ones (``core.vocab.RoundedRows``, as shipped).

The embedded target at its own 4-bit bytes answers everyday prompts (prompts no drafter trained on) greedily, with
exact SD over chains of ``--gamma`` tokens from the shipped EAGLE head. Greedy SD writes the target's own text
whatever the draft, so every variant drafts over the same answers and only its acceptance differs: tokens per
target pass, and each chain position's pass rate among the drafts that got there. Times are not compared here
(``ab_planner.py`` variants ``q8rows`` and ``q4rows`` do that).

Usage: python benchmarks/ab_draft_rows.py [--prompts 24] [--gamma 4] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import everyday  # noqa: E402 (this folder's module)

from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core.vocab import RESCORED, reduced_lm_head  # noqa: E402
from fuzzyspec.drafters.eagle import EagleDrafter  # noqa: E402
from fuzzyspec.drafters.registry import DrafterSource  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402


def variants(pair: ModelPair) -> dict:
    """name -> how the head's outputs become draft logits (None: as shipped)."""
    head, lm_head = pair.draft.module, pair.target.get_output_embeddings()
    ids = head.vocab.target_ids
    exact = nn.Linear(lm_head.in_features, len(ids), bias=False)
    exact.weight.data.copy_(lm_head.weight.detach().index_select(0, ids))
    rounded = reduced_lm_head(lm_head, head.vocab)

    def through(layer: nn.Module):
        return lambda out: layer(out).float()

    return {"float rows": through(exact), "8-bit rows": through(lm_head.rows(ids)),
            "4-bit rows alone": through(rounded.rows), f"4-bit rows, top {RESCORED} again (shipped)": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    pair = ModelPair.load(draft="eagle", weights="int4")
    head, target = pair.draft.module, pair.target
    print(f"ab_draft_rows: CPU {cpu_isa()}; torch {torch.__version__}; the embedded target int4, eager; shipped EAGLE "
          f"head, greedy SD chains of {args.gamma}; {args.prompts} everyday prompts x {args.max_new_tokens} tokens")
    jobs = {}
    for name, logits in variants(pair).items():
        if logits is None:
            jobs[name] = pair
            continue
        source = DrafterSource(name, head, lambda vocab_size, logits=logits: EagleDrafter(head, target, vocab_size,
                                                                                           logits), drafts_trees=True)
        jobs[name] = ModelPair(target, pair.tokenizer, source, pair.step, None)
    totals = {name: [0, 0, [0] * args.gamma, [0] * args.gamma] for name in jobs}
    texts: dict[str, list[list[int]]] = {name: [] for name in jobs}
    for index, (_, prompt) in enumerate(everyday(args.prompts)):
        for name, job in jobs.items():
            config = job.config(method="sd", tree=False, gamma=args.gamma, gamma_schedule="constant",
                                max_new_tokens=args.max_new_tokens)
            result = job.generate(prompt, config=config)
            stats, total = result.stats, totals[name]
            texts[name].append(result.tokens)
            total[0] += stats.new_tokens
            total[1] += stats.target_forwards
            for i, (reached, passed) in enumerate(zip(stats.reached_at, stats.accepted_at)):
                total[2][i] += reached
                total[3][i] += passed
        print(f"ab_draft_rows: prompt {index + 1}/{args.prompts} done", file=sys.stderr, flush=True)
    same = all(texts[name] == next(iter(texts.values())) for name in texts)
    print(f"every variant wrote the same answers: {same}")
    for name, (tokens, passes, reached, passed) in totals.items():
        rates = ", ".join(f"{p / r:.3f}" for p, r in zip(passed, reached) if r)
        print(f"{name:34s} tokens a pass {tokens / passes:.3f}  passed at each position: {rates}")


if __name__ == "__main__":
    main()
