"""No regression from the one engine: a batch of one through it against the decoding loop it replaced.

The loop of an earlier commit (default f752666, the last before the engine; ``git archive`` of its
``fuzzyspec`` package, imported as ``fuzzyspec_old``) and today's engine decode the same prompts with the
same target object in one process, interleaved per prompt (the order alternating): AR, chain SD with the
shipped draft LM, and EAGLE-2 tree SD (16/5/4) with the shipped EAGLE head (the old package's copies of
both, loaded by each side's own code). Greedy, M new tokens per prompt (EOS does not stop), bfloat16, 2 threads. Printed per method:
tokens/s of each, their ratio (new / old; the aim is >= 0.97), tokens per target pass, and the share of
decoding time the engine spent in the acceptance step (divergence + rule; the aim is <= 3%) for chains
(`sd`, `fsd` js) and trees (`sd`, `fsd-hybrid` js). Prompts: the everyday set, every category in turn.

Usage: python benchmarks/bench_engine.py [--old f752666] [--prompts 8] [--max-new-tokens 96] [--threads 2]
"""
from __future__ import annotations

import argparse
import importlib
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from bench_drafters import load_prompts  # the everyday set, every category in turn
from fuzzyspec.api import ModelPair, make_config

ROOT = Path(__file__).resolve().parents[1]


def import_old(revision: str, folder: Path):
    """The ``fuzzyspec`` package of ``revision``, importable as ``fuzzyspec_old`` (its imports are relative)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "fuzzyspec"], check=True,
                             capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(folder)
    (folder / "fuzzyspec").rename(folder / "fuzzyspec_old")
    sys.path.insert(0, str(folder))
    return importlib.import_module("fuzzyspec_old.api"), importlib.import_module("fuzzyspec_old.loading")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="f752666", help="the commit whose decoding loop is the reference")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as folder:
        old_api, old_loading = import_old(args.old, Path(folder))
        base = ModelPair.load(draft=None, dtype="bfloat16")
        target, tokenizer = base.target, base.tokenizer
        weights = Path(folder) / "fuzzyspec_old" / "weights" / "smollm2-135m-instruct"  # the same drafters for both
        new = {"draft": base.with_drafter(str(weights / "draft")),
               "eagle": base.with_drafter(f"eagle:{weights / 'eagle'}")}
        old = {name: old_api.ModelPair(target, tokenizer,
                                       old_loading.load_draft(None if name == "draft" else "eagle", target, tokenizer,
                                                              None, "bfloat16"))
               for name in ("draft", "eagle")}
        methods = [("ar", "draft", {}), ("chain sd", "draft", {"method": "sd"}),
                   ("tree sd", "eagle", {"method": "sd", "tree": True})]
        common = {"max_new_tokens": args.max_new_tokens, "eos_token_ids": ()}
        prompts = [base.encode(text) for text in load_prompts("everyday", args.prompts)]
        for name, drafter, options in methods:  # warm-up
            options = {"method": "ar", **options}
            new[drafter].generate(prompts[0], config=make_config(**{**common, **options, "max_new_tokens": 8}))
            old[drafter].generate(prompts[0], **{**common, **options, "max_new_tokens": 8})
        totals = {(name, which): [0, 0.0, 0] for name, _, _ in methods for which in ("old", "new")}
        fuzzy = {"divergence": "js", "threshold": 0.3}
        timed = {"chain sd": ("draft", {"method": "sd"}), "chain fsd js 0.3": ("draft", {"method": "fsd", **fuzzy}),
                 "tree sd": ("eagle", {"method": "sd", "tree": True}),
                 "tree fsd-hybrid js 0.3": ("eagle", {"method": "fsd-hybrid", "tree": True, **fuzzy})}
        accept = {name: [0.0, 0.0] for name in timed}  # seconds in the acceptance step, seconds decoding
        for i, ids in enumerate(prompts):
            for name, drafter, options in methods:
                options = {"method": "ar", **options}
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for which in order:
                    start = time.perf_counter()
                    if which == "old":
                        result = old[drafter].generate(ids, **common, **options)
                    else:
                        result = new[drafter].generate(ids, config=make_config(**common, **options))
                    seconds = time.perf_counter() - start
                    row = totals[(name, which)]
                    row[0] += len(result.tokens)
                    row[1] += seconds
                    row[2] += result.stats.target_forwards
            for name, (drafter, options) in timed.items():
                stats = new[drafter].generate(ids, config=make_config(**common, **options)).stats
                accept[name][0] += stats.accept_s
                accept[name][1] += stats.wall_s
            print(f"[{i + 1}/{len(prompts)}] done", file=sys.stderr, flush=True)

    print(f"fuzzyspec bench_engine: SmolLM2-135M-Instruct, {len(prompts)} everyday prompts x {args.max_new_tokens} "
          f"tokens, greedy, bfloat16, {args.threads} threads, torch {torch.__version__}, {platform.machine()}; "
          f"old loop: {args.old}")
    print(f"{'method':<10} {'old tok/s':>9} {'new tok/s':>9} {'new/old':>8} {'tok/pass old':>12} {'tok/pass new':>12}")
    for name, _, _ in methods:
        (old_tokens, old_s, old_passes), (new_tokens, new_s, new_passes) = totals[(name, "old")], totals[(name, "new")]
        print(f"{name:<10} {old_tokens / old_s:>9.1f} {new_tokens / new_s:>9.1f} "
              f"{(new_tokens / new_s) / (old_tokens / old_s):>8.3f} {old_tokens / old_passes:>12.2f} "
              f"{new_tokens / new_passes:>12.2f}")
    for name, (in_rule, total) in accept.items():
        print(f"acceptance step (divergence + rule), {name}: {100 * in_rule / total:.2f}% of decoding time")


if __name__ == "__main__":
    main()
