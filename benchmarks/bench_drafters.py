"""Benchmark drafters of the embedded target on prompts they never saw: chains, EAGLE-2 trees, the default job.

Two prompt sets, side by side: ``everyday`` (fuzzyspec/prompts/everyday.jsonl, written for the project in
eight categories, never used in training) and ``sharegpt`` (held-out ShareGPT conversations, the
training source's own distribution), and any category of the everyday set on its own (``extraction``:
pulling fields out of a given text, or editing it, where prompt lookup has text to copy). Greedy, M new tokens per prompt (EOS does not stop a run, so every
configuration yields the same number of tokens), bfloat16, all in one process with the configurations
interleaved per prompt (each after each other alike: turns.py), so machine noise hits all alike.

Rows: our AR; llama.cpp's plain greedy decoding of the same GGUF (when llama-cpp-python is installed);
chain SD with the draft LM and with the EAGLE head; lossless EAGLE-2 trees; the CLI's default job; and
any --extra configurations. Columns: tokens/s and its ratio to AR, tokens per target pass, "prefix"
(mean fraction of the M tokens made before the first difference from AR's greedy text; 1.00 =
identical) and "nll" (the target's mean negative log-likelihood per token of the text). Below the
table: the time of one draft step of each drafter against one target step (a 1-token forward on a
200-token cache, medians), which decides how cheap drafting is.

Usage: python benchmarks/bench_drafters.py [--sets everyday,sharegpt,extraction] [--prompts 16] [--max-new-tokens 128]
           [--draft NAME] [--eagle NAME] [--extra 'ROW={"drafter": NAME, ...}'] [--threads 2] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from turns import balanced_turns  # (this folder's module)

from fuzzyspec.api import ModelPair
from fuzzyspec.data import prompts, read_sharegpt, split
from fuzzyspec.core.engine import target_features
from fuzzyspec.core.draft import Budget
from fuzzyspec.core.kvcache import crop_to
from fuzzyspec.loading import embedded_gguf
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.eval.quality import first_difference, target_nll
from fuzzyspec.eval.tasks import FreeForm

EVERYDAY = Path(__file__).resolve().parents[1] / "fuzzyspec" / "prompts" / "everyday.jsonl"
TREE = dict(tree=True, tree_total_tokens=16, tree_depth=5, tree_top_k=4)


def load_prompts(name: str, count: int) -> list[str]:
    """``everyday`` (every category in turn), one of its categories by name (e.g. ``extraction``: pulling
    fields out of a given text, or editing it), or ``sharegpt`` (held out)."""
    rows = [json.loads(line) for line in EVERYDAY.read_text().splitlines() if line.strip()]
    if name in {row["category"] for row in rows}:
        return [row["prompt"] for row in rows if row["category"] == name][:count]
    if name == "everyday":
        examples = FreeForm(str(EVERYDAY)).examples()
        # The same number from every category: every eighth prompt first, then the next ones.
        ordered = [examples[i] for offset in range(8) for i in range(offset, len(examples), 8)]
        return [e.prompt for e in ordered[:count]]
    _, held_out = split(read_sharegpt())
    return prompts(held_out, count, max_chars=2000)


class LlamaCpp:
    """llama.cpp's own greedy decoding of the same GGUF file, fed the same token ids."""

    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        self.model = Llama(model_path=str(embedded_gguf()), n_threads=threads, n_ctx=4096, verbose=False)

    def generate(self, ids: list[int], count: int) -> tuple[list[int], float]:
        self.model.reset()
        start, tokens = time.perf_counter(), []
        for token in self.model.generate(ids, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if len(tokens) == count:
                break
        return tokens, time.perf_counter() - start


@torch.inference_mode()
def step_times(pair: ModelPair, drafted: dict[str, ModelPair], repeats: int = 30) -> dict[str, float]:
    """Median ms of one target step (one new token on a 200-token cache) and of one draft step of each
    drafter: the extra time of proposing k + 1 tokens rather than k after the same 200 tokens."""
    ids = torch.randint(0, pair.vocab_size, (1, 201))
    cache = DynamicCache()
    pair.target(input_ids=ids[:, :200], past_key_values=cache, use_cache=True)

    def target_step() -> None:
        pair.target(input_ids=ids[:, 200:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        crop_to(cache, 200)

    def median(run) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1000

    times = {"target": median(target_step)}
    sampling = Sampling()
    for name, other in drafted.items():
        drafter = other.drafter(other.config(method="sd"))
        if getattr(drafter, "wants_target_features", False):
            hidden = pair.target(input_ids=ids[:, :200], output_hidden_states=True).hidden_states
            drafter.observe(0, target_features(hidden, drafter)[:, :199])
        drafter.propose(ids, Budget(4), sampling, None)
        times[name] = median(lambda: drafter.propose(ids, Budget(5), sampling, None)) - \
            median(lambda: drafter.propose(ids, Budget(4), sampling, None))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="everyday,sharegpt",
                        help="comma-separated prompt sets, each NAME or NAME:COUNT (COUNT overrides --prompts)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", default="draft", help="the draft LM row's drafter (default: the shipped draft LM)")
    parser.add_argument("--eagle", default="eagle", help="the EAGLE rows' drafter: 'eagle' (shipped) or eagle:DIR")
    parser.add_argument("--extra", action="append", default=[],
                        help='another row: NAME=JSON decoding options with "drafter" giving a drafter name, e.g. '
                             "'lookup sd={\"drafter\": \"lookup\", \"method\": \"sd\"}'")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = ModelPair.load(draft=None, dtype="bfloat16")
    pairs: dict[str, ModelPair] = {}

    def pair_for(name: str) -> ModelPair:  # one target in memory, one drafter per name
        if name not in pairs:
            pairs[name] = base.with_drafter(name)
        return pairs[name]

    draft, eagle = args.draft, args.eagle
    configs: list[tuple[str, ModelPair | None, dict]] = [("AR", base, dict(method="ar"))]
    llama = None
    if not args.no_llama_cpp:
        try:
            llama = LlamaCpp(args.threads)
            configs.append(("llama.cpp greedy (same GGUF)", None, {}))
        except ImportError:
            print("llama-cpp-python is not installed: no llama.cpp row", file=sys.stderr)
    configs += [("draft LM chain sd", pair_for(draft), dict(method="sd")),
                ("EAGLE chain sd", pair_for(eagle), dict(method="sd")),
                ("EAGLE-2 tree 16/5/4 sd", pair_for(eagle), dict(method="sd", **TREE)),
                ("default job (no options)", pair_for("default"), {})]
    for extra in args.extra:
        name, options = extra.split("=", 1)
        options = json.loads(options)
        configs.append((name, pair_for(options.pop("drafter")), options))

    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=())
    for name, pair, options in configs:  # warm-up
        if pair is not None:
            pair.generate("Hello", **{**common, **options, "max_new_tokens": 8})
    steps = step_times(base, dict(pairs))  # every drafter loaded for a row, by name
    results = {}
    for set_spec in [s for s in args.sets.split(",") if s]:
        set_name, _, count = set_spec.partition(":")
        texts = load_prompts(set_name, int(count) if count else args.prompts)
        totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "prefix": 0.0, "nll": 0.0}
                  for name, _, _ in configs}
        for i, (text, order) in enumerate(zip(texts, balanced_turns(configs, len(texts)))):
            ids = base.encode(text)
            outputs = {}
            for name, pair, options in order:
                if pair is None:
                    tokens, seconds = llama.generate(ids[0].tolist(), args.max_new_tokens)
                    forwards = len(tokens)
                else:
                    start = time.perf_counter()
                    result = pair.generate(ids, **common, **options)
                    seconds = time.perf_counter() - start
                    tokens, forwards = result.tokens, result.stats.target_forwards
                row = totals[name]
                row["tokens"] += len(tokens)
                row["seconds"] += seconds
                row["forwards"] += forwards
                outputs[name] = tokens
            for name, tokens in outputs.items():  # quality, outside the timed calls
                totals[name]["prefix"] += first_difference(tokens, outputs["AR"]) / max(len(outputs["AR"]), 1)
                totals[name]["nll"] += target_nll(base.target, ids, tokens, base.vocab_size)
            print(f"[{set_name} {i + 1}/{len(texts)}] done", file=sys.stderr, flush=True)
        ar_speed = totals["AR"]["tokens"] / totals["AR"]["seconds"]
        results[set_name] = [{"configuration": name, "tokens_per_s": row["tokens"] / row["seconds"],
                              "vs_ar": row["tokens"] / row["seconds"] / ar_speed,
                              "tokens_per_target_pass": row["tokens"] / row["forwards"],
                              "prefix_same_as_ar": row["prefix"] / len(texts),
                              "target_nll": row["nll"] / len(texts), "prompts": len(texts)}
                             for name, row in totals.items()]
        if args.json:  # what is measured so far survives a later failure
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "step_ms": steps},
                                                  indent=2))

    print(f"fuzzyspec bench_drafters: SmolLM2-135M-Instruct, greedy, {args.max_new_tokens} tokens per prompt, "
          f"bfloat16, {args.threads} threads, torch {torch.__version__}, {platform.machine()}; "
          f"draft LM {args.draft}, EAGLE head {args.eagle}")
    names = list(results)
    print(f"{'configuration':<34}" + "".join(f" | {n + ' (' + str(results[n][0]['prompts']) + ')':^38}"
                                              for n in names))
    print(f"{'':<34}" + " | tok/s   xAR tok/pass prefix   nll" * len(names))
    for index, (name, _, _) in enumerate(configs):
        line = f"{name:<34}"
        for n in names:
            r = results[n][index]
            line += (f" | {r['tokens_per_s']:5.1f} {r['vs_ar']:5.2f} {r['tokens_per_target_pass']:8.2f} "
                     f"{r['prefix_same_as_ar']:6.2f} {r['target_nll']:5.3f}")
        print(line)
    print("one step (ms, median): " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()) + "; draft/target: "
          + ", ".join(f"{k} 1/{steps['target'] / v:.1f}" for k, v in steps.items() if k != "target"))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "step_ms": steps},
                                              indent=2))


if __name__ == "__main__":
    main()
