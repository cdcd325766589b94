"""Benchmark AR, speculative (SD) and fuzzy speculative decoding (FSD) side by side.

Runs, greedy, on the embedded target (SmolLM2-135M-Instruct) for N fixed chat
prompts x M new tokens, in ONE process and interleaved (for each prompt every
configuration, each after each other alike: turns.py) so machine noise hits
every configuration alike:

  HF AR        target.generate(do_sample=False)
  HF SD        target.generate(assistant_model=draft, do_sample=False) with a
               constant number of assistant tokens (gamma) and the assistant's
               confidence early stop off: the same algorithm as ours "sd"
  ours ar      pair.generate(ids, method="ar")
  ours sd      pair.generate(ids, method="sd", gamma=gamma)
  ours fsd     pair.generate(ids, method="fsd", threshold=T, divergence=D, gamma=gamma)
               for every T of --thresholds

EOS never stops a run (ours: eos_token_ids=(); HF: eos_token_id=None, which does
not mask EOS, unlike min_new_tokens), so every run yields exactly M tokens and
the tokens stay comparable between HF and ours. Every call is timed the same
way, with time.perf_counter around the call.

Columns:
  tok/s       total new tokens / total wall time of the calls
  xHF-AR      tok/s relative to HF AR
  tok/pass    new tokens / target forward passes (target passes are counted by
              a forward pre-hook on the target, for HF and ours alike; ours
              agree with Stats.target_forwards, checked at run time)
  accept      accepted drafts / proposed drafts (ours: Stats; HF SD: from the
              tokens fed to the target, see hf_proposed)
  =HF-AR      fraction of prompts whose M tokens equal HF AR's exactly
  prefix      mean fraction of the M tokens before the first difference from HF AR
  =HF-SD      (ours sd only) fraction of prompts whose tokens equal HF SD's exactly
  acc ms      Stats.accept_s per target pass (divergence + acceptance rule), ours only
  acc %step   sum Stats.accept_s / sum Stats.wall_s: the acceptance step's share of
              the mean time of one decoding step (wall_s / target_forwards)

Usage: python benchmarks/bench_core.py [--prompts 10] [--max-new-tokens 128] ...
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import transformers
from transformers.utils import logging as transformers_logging

from turns import balanced_turns  # (this folder's module)

from fuzzyspec.api import ModelPair
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.loading import resolve_dtype

PROMPTS = [
    "What causes the seasons on Earth? Explain it simply.",
    "Write a short poem about a lighthouse keeper who waits for a ship.",
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and case.",
    "Give me three tips for improving my sleep.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Explain the difference between a list and a tuple in Python, with an example of each.",
    "Write a polite email to my landlord asking to fix a leaking kitchen tap.",
    "Why is the sky blue?",
    "Write a JavaScript function that returns the n-th Fibonacci number using a loop.",
    "Describe a healthy breakfast and explain why each part of it is good for you.",
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- counting target passes

class PassCounter:
    """Counts forward passes of a module and the input tokens fed to them (a forward pre-hook)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.passes = 0
        self.fed = 0
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.passes += 1
        if ids is not None:
            self.fed += ids.shape[-1]

    def reset(self) -> None:
        self.passes = self.fed = 0


def hf_proposed(fed: int, passes: int, prompt_len: int) -> int:
    """Drafts the target checked, from what it was fed: the first pass reads the prompt and
    k_1 drafts, each later pass the newest token and k_i drafts, so fed = L + K + passes - 1."""
    return fed - prompt_len - passes + 1


# ---------------------------------------------------------------- configurations

@dataclass
class Run:
    tokens: list[int]
    seconds: float
    passes: int
    proposed: int | None = None
    accepted: int | None = None
    stats: dict[str, Any] | None = None


@dataclass
class Config:
    name: str
    kind: str  # "hf-ar", "hf-sd" or "ours"
    run: Callable[[torch.Tensor, int], Run]
    method: str = ""
    threshold: float | None = None
    runs: list[Run] = field(default_factory=list)


def build_configs(pair: ModelPair, args: argparse.Namespace, thresholds: list[float],
                  counter: PassCounter) -> list[Config]:
    target, gamma = pair.target, args.gamma
    pad = pair.tokenizer.pad_token_id
    pad = pad if pad is not None else pair.tokenizer.eos_token_id

    # HF's assisted generation reads the number of assistant tokens, its schedule and the
    # confidence threshold from the ASSISTANT's generation_config (the keyword arguments of
    # target.generate do not reach the candidate generator). A self draft shares its
    # generation_config object with the target, so give it a copy of its own first.
    assistant = pair.draft.module  # the draft model (HF's assisted generation needs a model, not a head)
    assistant.generation_config = copy.deepcopy(target.generation_config)
    assistant.generation_config.num_assistant_tokens = gamma
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # no early stop of drafting

    def hf_common(ids: torch.Tensor, m: int) -> dict[str, Any]:
        return dict(attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=None,
                    do_sample=False, eos_token_id=None, pad_token_id=pad)

    def hf_ar(ids: torch.Tensor, m: int) -> Run:
        counter.reset()
        start = time.perf_counter()
        out = target.generate(ids, **hf_common(ids, m))
        seconds = time.perf_counter() - start
        return Run(out[0, ids.shape[1]:].tolist(), seconds, counter.passes)

    def hf_sd(ids: torch.Tensor, m: int) -> Run:
        counter.reset()
        start = time.perf_counter()
        out = target.generate(ids, assistant_model=assistant, num_assistant_tokens=gamma,
                              num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                              **hf_common(ids, m))
        seconds = time.perf_counter() - start
        tokens = out[0, ids.shape[1]:].tolist()
        proposed = hf_proposed(counter.fed, counter.passes, ids.shape[1])
        return Run(tokens, seconds, counter.passes, proposed, len(tokens) - counter.passes)

    def ours(method: str, threshold: float | None) -> Callable[[torch.Tensor, int], Run]:
        options: dict[str, Any] = dict(method=method, gamma=gamma, eos_token_ids=(), seed=0)
        if threshold is not None:
            options.update(threshold=threshold, divergence=args.divergence)

        def run(ids: torch.Tensor, m: int) -> Run:
            counter.reset()
            start = time.perf_counter()
            result = pair.generate(ids, max_new_tokens=m, **options)
            seconds = time.perf_counter() - start
            stats = result.stats
            if counter.passes != stats.target_forwards:
                log(f"  warning: {method}: hook counted {counter.passes} target passes, "
                    f"stats {stats.target_forwards}")
            return Run(result.tokens, seconds, stats.target_forwards, stats.proposed, stats.accepted,
                       stats.to_dict() | {"divergence_quantiles": None})
        return run

    configs = [Config("HF AR", "hf-ar", hf_ar), Config(f"HF SD g={gamma}", "hf-sd", hf_sd),
               Config("ours ar", "ours", ours("ar", None), "ar"),
               Config(f"ours sd g={gamma}", "ours", ours("sd", None), "sd")]
    configs += [Config(f"ours fsd {args.divergence} T={t:g}", "ours", ours("fsd", t), "fsd", t)
                for t in thresholds]
    return configs


# ---------------------------------------------------------------- summary

def prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(configs: list[Config]) -> list[dict[str, Any]]:
    hf_ar = next(c for c in configs if c.kind == "hf-ar")
    hf_sd = next(c for c in configs if c.kind == "hf-sd")
    base_tps = None
    rows = []
    for c in configs:
        tokens = sum(len(r.tokens) for r in c.runs)
        seconds = sum(r.seconds for r in c.runs)
        passes = sum(r.passes for r in c.runs)
        tps = tokens / seconds if seconds > 0 else 0.0
        if c is hf_ar:
            base_tps = tps
        proposed = [r.proposed for r in c.runs]
        accepted = [r.accepted for r in c.runs]
        acceptance = None
        if None not in proposed and sum(proposed) > 0:
            acceptance = sum(accepted) / sum(proposed)
        same_ar = sum(r.tokens == b.tokens for r, b in zip(c.runs, hf_ar.runs)) / len(c.runs)
        prefix = sum(prefix_len(r.tokens, b.tokens) / max(1, len(b.tokens))
                     for r, b in zip(c.runs, hf_ar.runs)) / len(c.runs)
        same_sd = None
        if c.kind == "ours" and c.method == "sd":
            same_sd = sum(r.tokens == b.tokens for r, b in zip(c.runs, hf_sd.runs)) / len(c.runs)
        accept_ms = accept_share = None
        if c.kind == "ours":
            accept_s = sum(r.stats["accept_s"] for r in c.runs)
            loop_s = sum(r.stats["wall_s"] for r in c.runs)
            forwards = sum(r.stats["target_forwards"] for r in c.runs)
            if forwards:
                accept_ms = 1000 * accept_s / forwards
            if loop_s > 0:
                accept_share = accept_s / loop_s
        rows.append(dict(
            config=c.name, kind=c.kind, method=c.method or ("ar" if c.kind == "hf-ar" else "sd"),
            threshold=c.threshold, prompts=len(c.runs), new_tokens=tokens, seconds=seconds,
            tokens_per_s=tps, target_passes=passes, tokens_per_pass=tokens / passes if passes else None,
            acceptance=acceptance, same_as_hf_ar=same_ar, prefix_vs_hf_ar=prefix, same_as_hf_sd=same_sd,
            accept_ms_per_step=accept_ms, accept_share_of_step=accept_share,
            token_counts=sorted({len(r.tokens) for r in c.runs}),
        ))
    for row in rows:
        row["vs_hf_ar"] = row["tokens_per_s"] / base_tps if base_tps else None
    return rows


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    headers = ["config", "tok/s", "xHF-AR", "tok/pass", "accept", "=HF-AR", "prefix", "=HF-SD",
               "acc ms", "acc %step"]
    lines = [[r["config"], fmt(r["tokens_per_s"], ".1f"), fmt(r["vs_hf_ar"], ".2f"),
              fmt(r["tokens_per_pass"], ".2f"), fmt(r["acceptance"], ".2f"), fmt(r["same_as_hf_ar"], ".2f"),
              fmt(r["prefix_vs_hf_ar"], ".2f"), fmt(r["same_as_hf_sd"], ".2f"),
              fmt(r["accept_ms_per_step"], ".3f"),
              fmt(None if r["accept_share_of_step"] is None else 100 * r["accept_share_of_step"], ".1f")]
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    def show(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(show(headers))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print(show(line))


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark HF AR, HF assisted generation and fuzzyspec's ar/sd/fsd side by side "
                    "(greedy, embedded SmolLM2-135M-Instruct target, CPU).")
    parser.add_argument("--prompts", type=int, default=10, help=f"number of prompts, 1..{len(PROMPTS)} (default 10)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per run, exactly (default 128)")
    parser.add_argument("--gamma", type=int, default=5, help="drafts per step, ours and HF SD (default 5)")
    parser.add_argument("--thresholds", default="0.3,0.5,0.65", help="FSD thresholds, comma-separated")
    parser.add_argument("--divergence", default="js", help="FSD divergence (default js)")
    parser.add_argument("--draft", default="self:8", help="a draft model with the full vocabulary, as HF's assisted "
                        "generation needs (default self:8)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="auto = bfloat16 where the CPU computes it natively, else float32")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows (and per-prompt runs) as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be >= 2")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    try:
        args.threshold_list = [float(t) for t in args.thresholds.split(",") if t.strip()]
        for t in args.threshold_list:  # validates threshold, divergence and gamma
            DecodeConfig(method="fsd", threshold=t, divergence=args.divergence, gamma=args.gamma)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    m = args.max_new_tokens

    log(f"loading target (embedded) and draft {args.draft} ...")
    pair = ModelPair.load(target=None, draft=args.draft, dtype=args.dtype, device="cpu")
    if pair.draft is None or not hasattr(pair.draft.module, "generation_config"):
        raise SystemExit("a draft model is needed (a draft LM or a model: HF's assisted generation runs beside)")
    dtype = str(resolve_dtype(args.dtype, "cpu")).replace("torch.", "")
    counter = PassCounter(pair.target)
    configs = build_configs(pair, args, args.threshold_list, counter)
    prompts = PROMPTS[: args.prompts]
    encoded = [pair.encode(p) for p in prompts]

    meta = dict(target="smollm2-135m-instruct (embedded)", draft=args.draft, dtype=dtype, threads=args.threads,
                prompts=args.prompts, max_new_tokens=m, gamma=args.gamma, divergence=args.divergence,
                thresholds=args.threshold_list, torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), prompt_tokens=[int(e.shape[1]) for e in encoded],
                loadavg_start=os.getloadavg())

    # Warm-up, untimed: one short generation per configuration (first calls pay one-off costs).
    log(f"warm-up: {len(configs)} configurations x {min(m, 16)} tokens ...")
    for c in configs:
        c.run(encoded[0], min(m, 16))

    started = time.perf_counter()
    for i, (ids, order) in enumerate(zip(encoded, balanced_turns(configs, len(encoded)))):
        for c in order:  # each configuration after each other alike (turns.py says why)
            run = c.run(ids, m)
            c.runs.append(run)
            if len(run.tokens) != m:
                log(f"  warning: {c.name} produced {len(run.tokens)} tokens, not {m}")
            log(f"[prompt {i + 1}/{len(encoded)}] {c.name:<22} {len(run.tokens):4d} tok "
                f"{run.seconds:7.2f} s {len(run.tokens) / run.seconds:7.1f} tok/s "
                f"{len(run.tokens) / run.passes if run.passes else 0:5.2f} tok/pass")
    meta["loadavg_end"] = os.getloadavg()
    meta["bench_s"] = time.perf_counter() - started

    rows = summarize(configs)
    print(f"fuzzyspec bench_core: target SmolLM2-135M-Instruct, draft {args.draft}, {dtype}, "
          f"{args.threads} threads, {args.prompts} prompts x {m} new tokens, greedy, gamma {args.gamma}, "
          f"divergence {args.divergence}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"load avg {meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}")
    print_table(rows)
    odd = [r["config"] for r in rows if r["token_counts"] != [m]]
    if odd:
        print(f"warning: not every run produced exactly {m} tokens: {', '.join(odd)}")

    if args.json:
        runs = [dict(config=c.name, prompt=i, seconds=r.seconds, new_tokens=len(r.tokens), target_passes=r.passes,
                     proposed=r.proposed, accepted=r.accepted, tokens=r.tokens, stats=r.stats)
                for c in configs for i, r in enumerate(c.runs)]
        with open(args.json, "w") as handle:
            json.dump(dict(meta=meta, rows=rows, runs=runs), handle, indent=1, default=str)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
