"""Does the EAGLE head know when it is right? Its top draft probability against the target's verdict, and what
chains sized by that confidence would decode at under measured step costs.

Records greedy exact-SD chains of ``--gamma`` tokens from the shipped EAGLE head on everyday prompts (prompts no
drafter trained on): for every verified step, each drafted token's top draft probability q and how many of the
chain the target accepted. Prints
1. calibration: at each chain position, the share accepted among drafts that got there, by q;
2. what fixed chains of 1..gamma, and chains that stop by confidence, would decode at, as x AR, from those records and
   a profile of step costs (``--costs``): the target's pass by width, the head's first call (which brings the head
   up to date and gives the first draft), each further head call, and a step's time outside its forward;
3. the same by category for a 1-token chain that drafts only where the first draft's q clears a bar (the head's
   call is paid either way; a pass one token wider is what the bar saves).

Greedy decoding's tokens do not depend on the mode, so the records are taken eager. The costs are presets from
profiles the default job filed in ``ab_planner.py`` runs (``results_planner_ab_epyc.txt``), or your own.

Usage: python benchmarks/draft_confidence.py [--prompts 24] [--gamma 4] [--weights int4|bf16|fp32] [--costs native|avx2|eager|T1,T2,..;first,further;outside]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import everyday  # noqa: E402 (this folder's module)

from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.drafters import eagle  # noqa: E402
from fuzzyspec.loading import cpu_isa  # noqa: E402

# ms: the target's pass by width (1 = AR's); the head's first call; each further call; outside the forward
COSTS = {
    "native": ("O53, compiled int4, AVX-512 with native bfloat16", "2.98,3.21,3.47,3.73,4.07;0.72,0.43;0.29"),
    "avx2": ("O52, compiled int4, the AVX2 class emulated", "3.42,3.78,4.80,5.83,6.50;0.77,0.50;0.28"),
    "eager": ("O48, eager int4, AVX-512 with native bfloat16", "5.00,5.39,5.93,6.50,6.86;0.91,0.48;0.40"),
}
BINS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def record(prompts: int, gamma: int, max_new_tokens: int, weights: str = "int4"
           ) -> list[tuple[str, list[float], int]]:
    """(category, each drafted token's top draft probability, tokens accepted) for every verified step."""
    steps: list[tuple[str, list[float], int]] = []
    confidences: list[list[float]] = []
    chain = eagle.draft_chain

    def recording(logits, advance, budget, sampling, generator, vocab=None):
        tops = [torch.softmax(logits.float(), -1).max().item()]

        def advanced(token):
            logits = advance(token)
            tops.append(torch.softmax(logits.float(), -1).max().item())
            return logits

        draft = chain(logits, advanced, budget, sampling, generator, vocab)
        confidences.append(tops)
        return draft

    eagle.draft_chain = recording
    try:
        pair = ModelPair.load(draft="eagle", weights=weights)
        for index, (category, prompt) in enumerate(everyday(prompts)):
            config = pair.config(method="sd", tree=False, gamma=gamma, gamma_schedule="constant",
                                 max_new_tokens=max_new_tokens)
            drafter = pair.drafter(config)
            judged = drafter.accepted

            def accepted(count: int, judged=judged, category=category) -> None:
                if confidences:
                    steps.append((category, confidences.pop(), count))
                confidences.clear()
                judged(count)

            drafter.accepted = accepted
            pair.drafter = lambda config, drafter=drafter: drafter
            pair.generate(prompt, config=config)
            del pair.drafter
            print(f"draft_confidence: prompt {index + 1}/{prompts} done", file=sys.stderr, flush=True)
    finally:
        eagle.draft_chain = chain
    return [step for step in steps if len(step[1]) == gamma]  # (a chain cut by the answer's end: left out)


def parse_costs(text: str) -> tuple[list[float], float, float, float]:
    widths, calls, outside = COSTS[text][1].split(";") if text in COSTS else text.split(";")
    first, further = map(float, calls.split(","))
    return [float(ms) for ms in widths.split(",")], first, further, float(outside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--weights", default="int4", help="the target's form: int4 (the default job's on a CPU), "
                        "bf16 (the form the head trained beside) or fp32")
    parser.add_argument("--costs", default="native,avx2,eager", help="comma-joined presets, or one profile "
                        "'T1,T2,...;first call,further call;outside' (ms; T at widths 1 .. gamma + 1)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"draft_confidence: CPU {cpu_isa()}; torch {torch.__version__}; shipped EAGLE head, greedy SD chains of "
          f"{args.gamma}; {args.prompts} everyday prompts x {args.max_new_tokens} tokens, {args.weights} eager")
    steps = record(args.prompts, args.gamma, args.max_new_tokens, args.weights)
    print(f"{len(steps)} verified steps; mean accepted {sum(s[2] for s in steps) / len(steps):.3f} of {args.gamma}")
    reached = [sum(s[2] >= i for s in steps) for i in range(args.gamma + 1)]
    print("passed at each position, of the drafts that got there: " +
          ", ".join(f"{reached[i + 1] / reached[i]:.3f} ({reached[i + 1]}/{reached[i]})" for i in range(args.gamma)))

    print("\n1. calibration: share accepted among drafts reaching position i, by the draft's top probability q")
    for i in range(args.gamma):
        cells = []
        for low, high in zip(BINS, BINS[1:]):
            reached = [s for s in steps if s[2] >= i and low <= s[1][i] < (high if high < 1 else 1.01)]
            if reached:
                share = sum(s[2] > i for s in reached) / len(reached)
                cells.append(f"[{low:.2f},{high:.2f}) {share:.2f} (n={len(reached)})")
        print(f"  position {i + 1}: " + "  ".join(cells))

    presets = args.costs.split(",") if all(name in COSTS for name in args.costs.split(",")) else [args.costs]
    for preset in presets:
        widths, first, further, outside = parse_costs(preset)
        ar = widths[0] + outside

        def rate(policy, subset=steps) -> tuple[float, float]:
            tokens = ms = 0.0
            for _, tops, accepted in subset:
                length, calls = policy(tops)
                tokens += 1 + min(length, accepted)
                ms += first + further * (calls - 1) + widths[length] + outside
            return tokens / ms * ar, tokens / len(subset)

        def by_confidence(include: float, go_on: float):
            """Draft while the chain's own odds (the product of its q) stay at least ``include``; call the head
            again only while they are at least ``go_on``."""
            def policy(tops: list[float]) -> tuple[int, int]:
                odds, length, calls = 1.0, 0, 1
                for i, q in enumerate(tops):
                    if i and odds < go_on:
                        break
                    calls += bool(i)
                    if odds * q < include:
                        break
                    odds, length = odds * q, length + 1
                return length, calls
            return policy

        label = f"{preset}: {COSTS[preset][0]}" if preset in COSTS else preset
        print(f"\n2. x AR under {label} (ms: passes {widths}, head calls {first} then {further}, outside {outside})")
        for length in range(1, args.gamma + 1):
            print("  fixed chain of %d                    x AR %.3f  tokens a pass %.2f"
                  % (length, *rate(lambda tops, length=length: (length, length))))
        tried = sorted(((*rate(by_confidence(include, go_on)), include, go_on)
                        for include in (0.0, 0.05, 0.1, 0.2, 0.3) for go_on in (0.3, 0.5, 0.7, 0.9, 1.01)),
                       reverse=True)
        for speed, tokens, include, go_on in tried[:3]:
            print(f"  by confidence, odds >= {include:.2f}, call on >= {go_on:.2f}  x AR {speed:.3f}  tokens a pass "
                  f"{tokens:.2f}")
        print("3. a 1-token chain drafted only where q clears the bar, x AR by category:")
        categories = collections.defaultdict(list)
        for step in steps:
            categories[step[0]].append(step)
        for bar in (0.0, 0.1, 0.2, 0.3):
            def gated(tops, bar=bar) -> tuple[int, int]:
                return int(tops[0] >= bar), 1
            cells = [f"{name} {rate(gated, subset)[0]:.3f}" for name, subset in categories.items()]
            print(f"  q >= {bar:.1f}: all {rate(gated)[0]:.3f}  " + " ".join(cells))


if __name__ == "__main__":
    main()
