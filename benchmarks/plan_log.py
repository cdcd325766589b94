"""Where the default job's planner stops a row's drafting, and on what evidence.

The embedded target at its own 4-bit bytes, compiled, answers everyday prompts (prompts no drafter trained on) with
the default job, each answer in turn with AR's (which keeps a profile of its own, as in ``ab_planner.py``); both
start from empty profiles. Every plan the planner makes for the default job is logged: its pick, the row's
first-draft acceptance estimate and the counts it stands on, and the prices it weighs (the target's 1- and 2-token
passes, a 1-token chain's drafting, a step's time outside its forward). Prints, for every answer where a plan
drafted nothing, how many of its plans did and the evidence at the first; the first-draft acceptance at which a
1-token chain breaks even, over all plans; and the default job's speed over AR's.

Usage: python benchmarks/plan_log.py [--prompts 64] [--doubt D] [--json PATH]
       --doubt sets ``cost.DOUBT`` (0: a row stops wherever its estimate says drafting loses, as before 2026-11-27)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import everyday  # noqa: E402 (this folder's module)

from fuzzyspec import tuning  # noqa: E402
from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core import cost, engine  # noqa: E402
from fuzzyspec.core.cost import Profile  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

NEW_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--doubt", type=float, default=cost.DOUBT)
    parser.add_argument("--json", default=None, help="write every plan's record here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    cost.DOUBT = args.doubt
    pair = ModelPair.load(weights="int4", compile=True)
    print(f"plan_log: CPU {cpu_isa()}; torch {torch.__version__}; int4 compiled; {args.prompts} everyday prompts x "
          f"{NEW_TOKENS} tokens, greedy; cost.DOUBT {cost.DOUBT}")
    tuning.prepare(pair, pair.config(max_new_tokens=NEW_TOKENS, eos_token_ids=()))
    profiles = {"ar": Profile(), "default": Profile()}
    records: list[dict] = []
    answering: list[int | None] = [None]
    shipped = engine.plan

    def logged(options, acceptances, profile, *rest, **keywords):
        picks = shipped(options, acceptances, profile, *rest, **keywords)
        if answering[0] is not None:
            context, row = keywords.get("context", 0), acceptances[0]
            records.append({"prompt": answering[0], "pick": list(picks[0]), "estimate": row.rate(1),
                            "passed": (row.passed.get(1) or [0.0])[0], "reached": (row.reached.get(1) or [0.0])[0],
                            "one": profile.target_ms(1, context=context), "two": profile.target_ms(2, context=context),
                            "chain": profile.draft_ms(options[0].key(1), 1), "outside": profile.outside_ms(1)})
        return picks

    engine.plan = logged
    encoded = [pair.encode(prompt) for _, prompt in everyday(args.prompts)]
    tokens, seconds = {"ar": 0, "default": 0}, {"ar": 0.0, "default": 0.0}
    for index, ids in enumerate([encoded[0]] + encoded):  # (the first: a warm-up, not counted)
        for job in ("ar", "default") if index % 2 else ("default", "ar"):
            pair.step.profile = profiles[job]
            answering[0] = index - 1 if job == "default" and index else None
            start = time.perf_counter()
            result = pair.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_ids=(),
                                   **({"method": "ar"} if job == "ar" else {}))
            if index:
                tokens[job] += result.stats.new_tokens
                seconds[job] += time.perf_counter() - start
        print(f"plan_log: prompt {index}/{args.prompts} done", file=sys.stderr, flush=True)
    engine.plan = shipped
    speed = {job: tokens[job] / seconds[job] for job in tokens}
    stopped = [record for record in records if record["pick"] == [0, 1]]
    print(f"the default job {speed['default']:.1f} tok/s, x AR {speed['default'] / speed['ar']:.3f}; "
          f"{len(stopped)} of {len(records)} plans drafted nothing")
    for prompt in sorted({record["prompt"] for record in stopped}):
        plans = [record for record in records if record["prompt"] == prompt]
        first = next(record for record in plans if record["pick"] == [0, 1])
        print(f"  prompt {prompt}: {sum(r['pick'] == [0, 1] for r in plans)} of {len(plans)} plans drafted nothing; "
              f"at the first, the estimate {first['estimate']:.3f} on {first['passed']:.1f} passed of "
              f"{first['reached']:.1f} drafted (faded), break-even {break_even(first):.3f}")
    deciles = statistics.quantiles([break_even(record) for record in records], n=10)
    print("break-even first-draft acceptance over all plans, deciles: " + ", ".join(f"{q:.3f}" for q in deciles))
    if args.json:
        Path(args.json).write_text(json.dumps(records))


def break_even(record: dict) -> float:
    """The first-draft acceptance a at which a 1-token chain yields what AR does: (1 + a) / (T2 + D + S) =
    1 / (T1 + S)."""
    return (record["two"] + record["chain"] + record["outside"]) / (record["one"] + record["outside"]) - 1


if __name__ == "__main__":
    main()
