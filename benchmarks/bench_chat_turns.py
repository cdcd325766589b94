"""A chat's next turn, with and without what the last turn left in the cache: each turn of a chat sends the whole
conversation, and the slot the last answer used holds its prompt's and answer's keys and values
(``StaticCache.held``), so the next prompt is computed from where it differs (``Engine.add_many``).

Each everyday prompt is asked as the last turn of a long chat (``ab_planner.chats``: held-out ShareGPT exchanges
worth about --context tokens), answered; then the next turn asks "Can you say that more briefly?" after the answer,
timed twice, in an order that alternates from chat to chat: with what the first turn left, and with the cache's
slots emptied first (``held`` cleared). Same job, same process (the default job, or --method), greedy. Prints each
turn-2 answer's seconds (its prefill, then all), the prompt tokens computed, and the ratios, how many answers came
out the same both ways (compiled, the last answer's keys and values come from its compiled steps, whose rounding is
not an eager prefill's); and the CPU's instruction sets.

Usage: python benchmarks/bench_chat_turns.py [--prompts 8] [--context 1500] [--mode compiled] [--method sd]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_planner import chats  # noqa: E402 (this folder's modules)
from bench_step import everyday  # noqa: E402

from fuzzyspec import tuning  # noqa: E402
from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

FOLLOW_UP = "Can you say that more briefly?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--mode", choices=("eager", "compiled"), default="compiled")
    parser.add_argument("--method", default="sd", help="sd (the default job) or ar")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = ModelPair.load(draft=None, weights="int4")
    step = TargetStep(pair.target, compile=args.mode == "compiled")
    job = ModelPair(pair.target, pair.tokenizer, pair.with_drafter("default").draft, step, None)
    options = {"method": args.method, "max_new_tokens": args.max_new_tokens}
    conversations = [messages for _, messages in chats(everyday(args.prompts), pair.tokenizer, args.context)]
    if step.compile:
        tuning.prepare(job, job.config(**options), (4096,))
    job.generate(conversations[0], **options)  # (warm)
    results: dict[str, list[tuple[float, float, int]]] = {"kept": [], "emptied": []}
    same = 0
    for index, messages in enumerate(conversations):
        answer = job.generate(messages, **options).text
        follow = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        texts = {}
        for variant in ("kept", "emptied") if index % 2 == 0 else ("emptied", "kept"):
            if variant == "kept" and step._spare is not None and not any(t is not None for t in step._spare.held):
                job.generate(messages, **options)  # the first turn again: its slot holds it for the next
            if variant == "emptied" and step._spare is not None:
                step._spare.held = [None] * step._spare.slots
            clock = time.perf_counter()
            result = job.generate(follow, **options)
            seconds = time.perf_counter() - clock
            prompt = len(job.encode(follow)[0])
            results[variant].append((seconds - result.stats.wall_s, seconds, prompt - result.stats.cached_tokens))
            texts[variant] = result.text
        same += texts["kept"] == texts["emptied"]
        print(f"fuzzyspec: chat {index + 1}/{len(conversations)} done", file=sys.stderr, flush=True)
    print(f"CPU: {cpu_isa()}; {args.threads} threads; torch {torch.__version__}; int4 {args.mode}; {args.method}; "
          f"{len(conversations)} chats of ~{args.context} tokens, then '{FOLLOW_UP}' ({args.max_new_tokens} tokens)")
    for variant, rows in results.items():
        print(f"{variant:8s} turn 2: prefill {statistics.median(r[0] for r in rows):6.2f} s, whole answer "
              f"{statistics.median(r[1] for r in rows):6.2f} s (medians), prompt tokens computed "
              f"{statistics.median(r[2] for r in rows):.0f}")
    kept, emptied = results["kept"], results["emptied"]
    why = (" (compiled, the last answer's keys and values come from its compiled steps, which round unlike an eager "
           "prefill: a near-tie can go the other way)") if step.compile else ""
    print(f"the same answer both ways: {same} of {len(conversations)}{why}")
    print(f"emptied / kept: prefill {sum(r[0] for r in emptied) / sum(r[0] for r in kept):.2f}x, whole answer "
          f"{sum(r[1] for r in emptied) / sum(r[1] for r in kept):.2f}x (sums)")


if __name__ == "__main__":
    main()
