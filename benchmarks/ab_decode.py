"""Decoding from this checkout against an earlier commit's, as whole processes taking turns: tokens a second.

Each process imports ``fuzzyspec`` from its own sources (``ab_main_command.checkout``: the commit's, taken with
``git archive``), loads the embedded 4-bit target and its shipped drafter (eager), answers two prompts uncounted,
then decodes the first N everyday prompts (128 greedy tokens) with AR and the default job, the two alternating
prompt by prompt. The processes of the two sides take balanced turns (``turns.py``), so a spell of the shared
machine's pace falls on both alike. Printed: each side's tokens a second for each job (medians over its processes),
the ratio, and whether both sides gave the same tokens (greedy decoding: they should, token for token).

Usage: python benchmarks/ab_decode.py --before COMMIT [--prompts 16] [--repeats 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from ab_main_command import checkout, child_json, run_from  # (this folder's modules)
from bench_step import ROOT
from turns import balanced_turns

from fuzzyspec.tuning import machine

CHILD = """
import hashlib, json, sys, time
import torch
sys.path.insert(0, {benchmarks!r})
from bench_drafters import load_prompts
from fuzzyspec.api import ModelPair
torch.set_num_threads({threads})
pair = ModelPair.load(weights="int4", compile=False)
prompts = load_prompts("everyday", {prompts})
jobs = {{"ar": {{"method": "ar"}}, "default job": {{}}}}
for prompt in prompts[:2]:
    for options in jobs.values():
        pair.generate(prompt, max_new_tokens=128, **options)
seconds, tokens, digest = dict.fromkeys(jobs, 0.0), dict.fromkeys(jobs, 0), {{job: hashlib.sha256() for job in jobs}}
for i, prompt in enumerate(prompts):
    for job in (list(jobs) if i % 2 else list(jobs)[::-1]):
        clock = time.perf_counter()
        result = pair.generate(prompt, max_new_tokens=128, **jobs[job])
        seconds[job] += time.perf_counter() - clock
        tokens[job] += len(result.tokens)
        digest[job].update(str(list(result.tokens)).encode())
print(json.dumps({{job: [tokens[job] / seconds[job], digest[job].hexdigest()[:12]] for job in jobs}}))
"""


def once(where: dict, prompts: int, threads: int) -> dict:
    """One process's {job: [tokens a second, digest of its tokens]}."""
    return child_json(CHILD.format(benchmarks=str(ROOT / "benchmarks"), prompts=prompts, threads=threads), where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4, help="processes of each side")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ways = {"this checkout": run_from(ROOT), f"at {args.before}": run_from(checkout(args.before))}
    print(f"fuzzyspec ab_decode: {machine()} (the children run {args.threads} threads); {args.prompts} everyday "
          f"prompts x 128 greedy tokens a process, eager int4; {time.strftime('%Y-%m-%d')}", flush=True)
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for turn in balanced_turns(list(ways), args.repeats):
        for way in turn:
            runs[way].append(once(ways[way], args.prompts, args.threads))
            print(f"  {way:24s} " + ", ".join(f"{job} {rate:.1f} tok/s" for job, (rate, _) in runs[way][-1].items()),
                  flush=True)
    now, then = runs["this checkout"], runs[f"at {args.before}"]
    for job in now[0]:
        rate_now, rate_then = (statistics.median(run[job][0] for run in side) for side in (now, then))
        same = {run[job][1] for run in now + then}
        print(f"  {job}: {rate_now:.1f} tok/s against {rate_then:.1f} ({rate_now / rate_then:.3f}x as fast); "
              f"{'the same tokens every run' if len(same) == 1 else f'{len(same)} different token sets'}")


if __name__ == "__main__":
    main()
