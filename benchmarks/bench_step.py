"""The fast step on the CPU: what a target step costs by width, what drafting costs, and what decoding gains.

Everything in one process, on the embedded SmolLM2-135M-Instruct and its shipped drafters, greedy:

1. the verification cost curve: one forward of k tokens after 128 cached ones (batch 1), k = 1..32, for each
   weights form (fp32: the GGUF dequantized; int4: its own 4-bit weights), eager and compiled (compiled at the
   widths the engine pads to; the first call's seconds, the compilation, beside);
2. each drafter's proposal cost by size (chain tokens, tree depth);
3. decoding the everyday prompts (fuzzyspec/prompts/everyday.jsonl, never trained on), every configuration
   interleaved per prompt (each after each other alike: turns.py): AR before this work (the engine of the commit named
   by --before, fp32 eager, imported from ``git archive`` as a second package), our AR, the default job
   (cost-sized lossless EAGLE-2 trees), and other drafters and rules, in each form, eager and compiled;
   tokens/s and its ratio to the old AR and to compiled AR of the same form, tokens per target pass, the
   acceptance step's share of decoding time, and the default job per prompt category;
4. llama.cpp's plain decoding of the same GGUF on the same threads, when llama-cpp-python is installed;
5. with --cli, the README's main command in fresh processes against ``--method ar``, alternating: three first
   runs (each with a fresh cache holding only the GGUF) and three second runs; medians.

Every figure is a median or a sum measured here; the header records the CPU's instruction sets, because a
machine with AVX2 only and one with AVX512-BF16 behave differently.

Usage: python benchmarks/bench_step.py [--prompts 16] [--max-new-tokens 128] [--threads 2] [--forms int4,fp32]
           [--modes eager,compiled] [--rows default,ar,...] [--curve 1,2,...] [--cli] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from turns import balanced_turns  # (this folder's module)

from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.core import kernels
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.cost import breadths
from fuzzyspec.core.step import TargetStep
from fuzzyspec.loading import cache_dir, embedded_gguf

ROOT = Path(__file__).resolve().parents[1]
EVERYDAY = ROOT / "fuzzyspec" / "prompts" / "everyday.jsonl"
MAIN_PROMPT = "Give me three tips for writing clear emails."  # the README's main command
# name -> (drafter, decoding options); "default" and "ar" are the job and the target alone.
ROWS = {
    "ar": (None, {"method": "ar"}),
    "default": ("default", {}),
    "eagle trees sd constant 16/5/4": ("eagle", {"method": "sd", "tree": True, "gamma_schedule": "constant"}),
    "eagle chain sd": ("eagle", {"method": "sd"}),
    "eagle trees fsd-hybrid js 0.2": ("eagle", {"method": "fsd-hybrid", "tree": True, "threshold": 0.2}),
    "draft LM chain sd": ("draft", {"method": "sd"}),
    "draft LM chain fsd-hybrid js 0.3": ("draft", {"method": "fsd-hybrid", "threshold": 0.3}),
    "lookup sd": ("lookup", {"method": "sd"}),
}


def everyday(count: int) -> list[tuple[str, str]]:
    """(category, prompt), every category in turn."""
    rows = [json.loads(line) for line in EVERYDAY.read_text().splitlines() if line.strip()]
    categories = list(dict.fromkeys(row["category"] for row in rows))
    by = {c: [row["prompt"] for row in rows if row["category"] == c] for c in categories}
    ordered = [(c, by[c][i]) for i in range(max(map(len, by.values()))) for c in categories if i < len(by[c])]
    return ordered[:count]


def sources_at(commit: str, folder: Path) -> Path:
    """``folder``, holding the ``fuzzyspec`` package as it was at ``commit`` (``git archive``)."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "fuzzyspec"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def old_engine(commit: str):
    """The decode function and config class of the engine at ``commit`` (a second package, ``before``)."""
    folder = sources_at(commit, Path(tempfile.mkdtemp(prefix="fuzzyspec-before-")))
    spec = importlib.util.spec_from_file_location("before", folder / "fuzzyspec" / "__init__.py",
                                                  submodule_search_locations=[str(folder / "fuzzyspec")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["before"] = package
    spec.loader.exec_module(package)
    from before.core.decoding import DecodeConfig, decode  # noqa: E402 (the package just made)
    return decode, DecodeConfig


class LlamaCpp:
    """llama.cpp's own greedy decoding of the same GGUF file, fed the same token ids."""

    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        self.model = Llama(model_path=str(embedded_gguf()), n_threads=threads, n_ctx=4096, verbose=False)

    def generate(self, ids: list[int], count: int) -> float:
        self.model.reset()
        start, made = time.perf_counter(), 0
        for _ in self.model.generate(ids, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == count:
                break
        return time.perf_counter() - start


def make_steps(pairs: dict[str, ModelPair], modes: list[str]) -> dict[tuple[str, str], TargetStep]:
    """One target step per form and mode, shared by the curve and the decoding rows (so each compiled shape is
    compiled once), with the costs kept for that form and mode on this machine."""
    steps = {}
    for form, pair in pairs.items():
        for mode in modes:
            step = TargetStep(pair.target, compile=mode == "compiled")
            key = tuning.profile_key(None, form.split("-")[0], "auto", "cpu", mode == "compiled")
            step.profile = tuning.load(key)
            step.profile_key = None if "-" in form else key  # the variants' costs are not kept
            if form.endswith("-sdpa"):
                step.forward.heads = dataclasses.replace(step.forward.heads, invariant=False)
            steps[form, mode] = step
    return steps


def curve(steps: dict[tuple[str, str], TargetStep], widths: tuple[int, ...], rounds: int = 5) -> dict:
    """The verification cost curve per form and mode: ``rounds`` rounds over every width (so a drift of the machine
    reaches all widths alike), each width's median of the rounds' medians."""
    result = {}
    for (form, mode), step in steps.items():
        compiled = mode == "compiled"
        used = tuple(sorted({step.shape(w, 1)[0] for w in widths})) if compiled else widths
        measured = []
        for round_ in range(rounds):
            times, compile_s = tuning.measure_target(step, used, compiled=compiled,
                                                     progress=tuning.progress_line if round_ == 0 else None)
            measured.append(times)
            if round_ == 0:
                first = compile_s  # (the compilations; later rounds' first calls are steps like any)
        times = {w: statistics.median(m[w] for m in measured) for w in used}
        result[f"{form} {mode}"] = {"ms": times, "first_s": first}
    return result


def drafting(pairs: dict[str, ModelPair]) -> dict:
    """What drafting each size adds to a step (ms, as decoding prices it: ``tuning.measure_drafter``), per drafter
    and form."""
    result = {}
    for form, pair in pairs.items():
        for name in ("eagle", "draft"):
            drafted = pair.with_drafter(name)
            for breadth in breadths(DecodeConfig().tree_top_k) if drafted.draft.drafts_trees else (1,):
                result[f"{form} {name} {'chain' if breadth == 1 else f'tree {breadth} wide'}"] = \
                    tuning.measure_drafter(drafted, breadth, range(1, 6))
    return result


def decode_rows(pairs: dict[str, ModelPair], steps: dict[tuple[str, str], TargetStep], rows: list[str],
                prompts: list[tuple[str, str]], tokens: int, before, llama: LlamaCpp | None) -> dict:
    """Decode every prompt with every configuration, interleaved; totals per configuration and category."""
    configs = []  # (label, pair, options)
    for (form, mode), step in steps.items():
        pair = pairs[form]
        for row in rows:
            drafter, options = ROWS[row]
            drafted = pair.with_drafter(drafter) if drafter is not None else pair
            configs.append((f"{row} [{form} {mode}]",
                            ModelPair(pair.target, pair.tokenizer, drafted.draft, step, step.profile_key), options))
    first = next(iter(pairs.values()))
    labels = [label for label, _, _ in configs] + (["before: AR [fp32 eager]"] if before else []) + \
        (["llama.cpp (same GGUF)"] if llama else [])
    totals = {label: {"tokens": 0, "seconds": 0.0, "passes": 0, "accept_s": 0.0, "by_category": {}}
              for label in labels}
    common = {"max_new_tokens": tokens, "eos_token_ids": ()}
    # Warmed on the shortest and the longest prompt at full length, so that every cache size decoding reaches
    # (a power of two from the step's first, ``TargetStep.min_capacity``) is compiled before the clock runs
    # (compiling is timed apart, in the cost curve's "first" column).
    encoded = sorted((first.encode(prompt) for _, prompt in prompts), key=lambda ids: ids.shape[1])
    print(f"fuzzyspec: warming {len(configs)} configurations (compiles where compiled) ...", file=sys.stderr)
    longest = max(ids.shape[1] for ids in encoded) + tokens
    for label, pair, options in configs:
        # every shape the schedule may pick, at every cache size decoding reaches
        first_capacity = pair.step.min_capacity
        capacities = tuple(first_capacity << i for i in range(8) if i == 0 or first_capacity << i < 2 * longest)
        tuning.prepare(pair, pair.config(**(common | options)), capacities)
        # Again while a pass still compiles: the draft sizes the cost schedule picks (so the widths a step runs
        # at) change as its measurements come in, and a width compiled inside a timed prompt costs ~20 s.
        compiled = []
        pair.step.on_compile = lambda rows, width: compiled.append(width)
        for _ in range(4):
            compiled.clear()
            for ids in (encoded[0], encoded[-1]):
                pair.generate(ids, **(common | options))
            if not compiled:
                break
        pair.step.on_compile = None
    for index, ((category, prompt), order) in enumerate(zip(prompts, balanced_turns(labels, len(prompts)))):
        ids = first.encode(prompt)
        for label in order:
            if label.startswith("before"):
                decode, config_class, fp32 = before
                clock = time.perf_counter()
                out, stats = decode(fp32.target, None, ids, config_class(method="ar", max_new_tokens=tokens), fp32.vocab_size)
                seconds, made, passes, accept_s = time.perf_counter() - clock, out.shape[1], stats.target_forwards, 0.0
            elif label.startswith("llama.cpp"):
                seconds, made, passes, accept_s = llama.generate(ids[0].tolist(), tokens), tokens, tokens, 0.0
            else:
                _, pair, options = next(c for c in configs if c[0] == label)
                compiled = []
                pair.step.on_compile = lambda rows, width: compiled.append(width)
                clock = time.perf_counter()
                result = pair.generate(ids, **(common | options))
                seconds = time.perf_counter() - clock
                pair.step.on_compile = None
                if compiled:  # the warm-up missed a shape: say so, as its seconds are in this row's time
                    print(f"fuzzyspec: {label} compiled width {compiled} in prompt {index + 1} ({seconds:.1f} s)",
                          file=sys.stderr, flush=True)
                made, passes, accept_s = result.stats.new_tokens, result.stats.target_forwards, result.stats.accept_s
            total = totals[label]
            total["tokens"] += made
            total["seconds"] += seconds
            total["passes"] += passes
            total["accept_s"] += accept_s
            cat = total["by_category"].setdefault(category, [0, 0.0])
            cat[0] += made
            cat[1] += seconds
        print(f"fuzzyspec: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    return totals


def cli_runs(repeats: int) -> dict:
    """The README's main command against --method ar, fresh processes, alternating: ``repeats`` first runs (each
    with a fresh cache holding only the GGUF, so each builds the kernels and converts the tokenizer), then
    ``repeats`` second runs on the last of those caches; median seconds of the whole process, and the answer's
    tokens. (One first run each was not enough: the kernels' build alone moves by about 0.5 s between runs.)"""
    results: dict = {}
    env = dict(os.environ)
    labels = (("default job", []), ("ar", ["--method", "ar"]))
    with tempfile.TemporaryDirectory(prefix="fuzzyspec-cache-") as fresh:
        for attempt in ("first run", "second run"):
            times: dict[str, list[float]] = {label: [] for label, _ in labels}
            for repeat in range(repeats):
                for label, extra in labels if repeat % 2 == 0 else labels[::-1]:
                    cache = Path(fresh) / label.replace(" ", "-")
                    if attempt == "first run":
                        shutil.rmtree(cache, ignore_errors=True)
                        (cache / "gguf").mkdir(parents=True)
                        shutil.copy(embedded_gguf(), cache / "gguf" / embedded_gguf().name)
                    env["FUZZYSPEC_CACHE"] = str(cache)
                    clock = time.perf_counter()
                    done = subprocess.run([sys.executable, "-m", "fuzzyspec", "--threads", str(torch.get_num_threads()),
                                           "generate", MAIN_PROMPT, "--json", *extra], capture_output=True, text=True,
                                          env=env, timeout=1800)
                    times[label].append(time.perf_counter() - clock)
                    if done.returncode:
                        raise SystemExit(done.stderr)
                    answer = json.loads(done.stdout)
                    results[f"{label}, {attempt}"] = {"seconds": statistics.median(times[label]),
                                                      "runs": times[label],
                                                      "tokens": answer["stats"]["new_tokens"],
                                                      "tokens_per_pass": answer["stats"]["mean_accepted"]}
    return results


def load_form(form: str) -> ModelPair:
    """The embedded target in a weights form; ``int4-unfused``: int4 with q, k, v and gate, up as separate
    products (as before ``int4.fuse_projections``); ``int4-sdpa``: int4 with PyTorch's attention in place of ours
    (``core.attention``), for the side-by-side."""
    if form != "int4-unfused":
        return ModelPair.load(draft=None, weights=form.removesuffix("-sdpa"))  # (make_steps sets the attention)
    pair = ModelPair.load(draft=None, weights="int4")
    for layer in pair.target.model.layers:
        del layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    pair.step = TargetStep(pair.target)
    return pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forms", default="int4,fp32",
                        help="weights forms: int4, fp32, bf16, int4-unfused (int4 without fused projections) and int4-sdpa "
                             "(int4 with PyTorch's attention in place of ours)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"decoding rows, of: {', '.join(ROWS)}")
    parser.add_argument("--curve", default="1,2,3,4,5,6,8,12,17,24,32", help="widths of the cost curve ('' : none)")
    parser.add_argument("--no-drafting", action="store_true", help="skip the drafters' proposal costs")
    parser.add_argument("--before", default="628761a", help="the commit whose eager AR is the baseline ('': none)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--cli", action="store_true", help="also time the README's main command in fresh processes")
    parser.add_argument("--cli-repeats", type=int, default=3, help="first runs and second runs each, per mode")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    modes = [m for m in args.modes.split(",") if m]
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(map(repr, unknown))}; rows are {', '.join(ROWS)}")
    forms = [f for f in args.forms.split(",") if f]
    pairs = {form: load_form(form) for form in forms}
    machine = tuning.machine() + (f"; int4 kernel for {kernels.isa()}" if any(f.startswith("int4") for f in forms) else "")
    report = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "dtype": {f: str(p.target.dtype) for f, p in pairs.items()}}
    print(f"fuzzyspec bench_step: {report['machine']}; forms {', '.join(forms)}; {args.prompts} everyday prompts x "
          f"{args.max_new_tokens} tokens, greedy; {time.strftime('%Y-%m-%d')}")
    widths = tuple(int(w) for w in args.curve.split(",") if w)
    steps = make_steps(pairs, modes)
    if widths:
        report["curve"] = curve(steps, widths)
        print("\nverification cost: ms of one forward of k tokens after 128 (x the same at k = 1); compiled: first call s")
        for label, measured in report["curve"].items():
            one = measured["ms"][min(measured["ms"])]
            cells = "  ".join(f"{k}:{ms:.1f}(x{ms / one:.2f})" for k, ms in measured["ms"].items())
            first = "  first: " + ", ".join(f"{k}:{s:.0f}s" for k, s in measured["first_s"].items()) if measured["first_s"] else ""
            print(f"  {label:<16} {cells}{first}")
    if not args.no_drafting:
        report["drafting"] = drafting({form: pairs[form] for form in forms[:1]})
        print("\ndrafting: ms each size adds to a step (chain tokens, tree depth; proposal, judging and bookkeeping)")
        for label, sizes in report["drafting"].items():
            print(f"  {label:<22} " + "  ".join(f"{size}:{ms:.1f}" for size, ms in sizes.items()))
    before = None
    if args.before:  # the old engine on the float32 target (loaded for it where no fp32 row is asked for)
        fp32 = pairs["fp32"] if "fp32" in pairs else ModelPair.load(draft=None, weights="fp32")
        before = (*old_engine(args.before), fp32)
    llama = None
    if not args.no_llama_cpp:
        with contextlib.suppress(ImportError):
            llama = LlamaCpp(args.threads)
        if llama is None:
            print("(llama-cpp-python is not installed: no llama.cpp row)", file=sys.stderr)
    if rows:
        prompts = everyday(args.prompts)
        totals = decode_rows(pairs, steps, rows, prompts, args.max_new_tokens, before, llama)
        report["decoding"] = totals
        rate = {label: t["tokens"] / t["seconds"] for label, t in totals.items()}
        base = rate.get("before: AR [fp32 eager]")
        print(f"\ndecoding: {len(prompts)} everyday prompts x {args.max_new_tokens} tokens")
        print(f"  {'configuration':<52} {'tok/s':>7} {'x before AR':>11} {'x AR same':>9} {'x llama.cpp':>11} "
              f"{'tok/pass':>8} {'accept %':>8}")
        llama_rate = rate.get("llama.cpp (same GGUF)")
        for label, total in totals.items():
            bracket = label[label.find("["):] if "[" in label else ""
            same_ar = rate.get(f"ar {bracket}") if bracket else None  # AR of the same form and mode
            print(f"  {label:<52} {rate[label]:7.1f} {rate[label] / base if base else float('nan'):11.2f} "
                  f"{rate[label] / same_ar if same_ar else float('nan'):9.2f} "
                  f"{rate[label] / llama_rate if llama_rate else float('nan'):11.2f} "
                  f"{total['tokens'] / max(total['passes'], 1):8.2f} {100 * total['accept_s'] / total['seconds']:8.2f}")
        print("\nthe default job against AR of the same form and mode, by category (tok/s ratio)")
        for form, mode in steps:
            job, ar = totals.get(f"default [{form} {mode}]"), totals.get(f"ar [{form} {mode}]")
            if job and ar:
                print(f"  {form} {mode}: " + ", ".join(
                    f"{c}: {(job['by_category'][c][0] / job['by_category'][c][1]) / (ar['by_category'][c][0] / ar['by_category'][c][1]):.2f}"
                    for c in job["by_category"]))
    if args.cli:
        report["cli"] = cli_runs(repeats=args.cli_repeats)
        print("\nthe README's main command, whole processes (seconds; answer tokens; tokens per pass)")
        for label, run in report["cli"].items():
            print(f"  {label:<26} {run['seconds']:7.2f} s  {run['tokens']:4d} tokens  {run['tokens_per_pass'] or 0:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
