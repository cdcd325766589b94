"""How close the GGUF target at its own 4-bit bytes (``--weights int4``) is to the same file dequantized to float32.

On the everyday prompts (fuzzyspec/prompts/everyday.jsonl), greedy, chat template, --tokens new tokens:

1. teacher-forced on the float32 target's own greedy text: each form's NLL of that text, and how often the
   int4 target's top-1 token equals the float32 one's (per position);
2. free-running: each form's greedy text, scored by the float32 target (NLL per token, the quality measure the
   accuracy/speed curves use), the share of prompts whose two texts are equal, and the mean number of tokens
   the texts share before they first differ;
3. the same for the int4 target with its keys and values cached in float32, as before 2026-11-27 (float16 since,
   as llama.cpp keeps them): its greedy text's NLL under float32, and how often it equals the float16 cache's.

Usage: python benchmarks/eval_int4.py [--prompts 16] [--tokens 128] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import everyday  # noqa: E402  (the same prompts, in the same order)

from fuzzyspec import tuning  # noqa: E402
from fuzzyspec.api import ModelPair  # noqa: E402
from fuzzyspec.core.scoring import log_probs, target_logits  # noqa: E402
from fuzzyspec.core.step import TargetStep  # noqa: E402


def nll(target: torch.nn.Module, ids: torch.Tensor, first: int) -> tuple[float, torch.Tensor]:
    """Mean NLL of ids[first:] under ``target``, and its top-1 tokens at those positions."""
    logits = target_logits(target, ids, first).float()
    log_p = log_probs(logits)
    picked = log_p.gather(-1, ids[0, first:, None])[:, 0]
    return -picked.mean().item(), logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    fp32 = ModelPair.load(draft=None, weights="fp32", dtype="float32")
    int4 = ModelPair.load(draft=None, weights="int4")
    float_cache = TargetStep(int4.target)
    float_cache.cache_dtype = torch.float32
    int4_float_cache = ModelPair(int4.target, int4.tokenizer, None, float_cache, None)
    forced = {"fp32": [], "int4": []}
    agree, free = [], {"fp32": [], "int4": [], "int4_float32_cache": []}
    equal, shared, caches_equal = 0, [], 0
    with torch.inference_mode():
        for index, (_, prompt) in enumerate(everyday(args.prompts)):
            ids = fp32.encode(prompt)
            first = ids.shape[1]
            texts = {}
            for name, pair in (("fp32", fp32), ("int4", int4), ("int4_float32_cache", int4_float_cache)):
                result = pair.generate(ids, method="ar", max_new_tokens=args.tokens, eos_token_ids=())
                texts[name] = result.tokens
            reference = torch.cat([ids, torch.tensor([texts["fp32"]])], 1)
            for name, pair in (("fp32", fp32), ("int4", int4)):
                value, top = nll(pair.target, reference, first)
                forced[name].append(value)
                if name == "fp32":
                    top_fp32 = top
                else:
                    agree.append((top == top_fp32).float().mean().item())
            for name in free:
                written = torch.cat([ids, torch.tensor([texts[name]])], 1)
                free[name].append(nll(fp32.target, written, first)[0])
            equal += texts["fp32"] == texts["int4"]
            caches_equal += texts["int4"] == texts["int4_float32_cache"]
            same = next((i for i, (a, b) in enumerate(zip(texts["fp32"], texts["int4"])) if a != b),
                        min(len(texts["fp32"]), len(texts["int4"])))
            shared.append(same)
            print(f"eval_int4: prompt {index + 1}/{args.prompts}", file=sys.stderr, flush=True)
    mean = statistics.fmean
    report = {
        "machine": tuning.machine(), "prompts": args.prompts, "tokens": args.tokens,
        "teacher_forced_nll": {name: mean(values) for name, values in forced.items()},
        "teacher_forced_top1_agreement": mean(agree),
        "greedy_text_nll_under_fp32": {name: mean(values) for name, values in free.items()},
        "greedy_texts_equal": equal / args.prompts, "mean_tokens_before_first_difference": mean(shared),
        "int4_greedy_texts_equal_with_a_float32_cache": caches_equal / args.prompts,
    }
    print(f"int4 (the GGUF's own 4-bit bytes; Q8_0 LM head as 8-bit) against the same file in float32; "
          f"{args.prompts} everyday prompts x {args.tokens} greedy tokens; {report['machine']}")
    print(f"  teacher-forced on float32's greedy text: NLL fp32 {report['teacher_forced_nll']['fp32']:.4f}, "
          f"int4 {report['teacher_forced_nll']['int4']:.4f}; top-1 agreement {report['teacher_forced_top1_agreement']:.4f}")
    print(f"  each form's own greedy text, scored by fp32: NLL fp32 {report['greedy_text_nll_under_fp32']['fp32']:.4f}, "
          f"int4 {report['greedy_text_nll_under_fp32']['int4']:.4f}")
    print(f"  greedy texts equal: {report['greedy_texts_equal']:.2f} of prompts; tokens shared before the first "
          f"difference: {report['mean_tokens_before_first_difference']:.1f} on average")
    print(f"  int4 with its cache in float32 (as before 2026-11-27): greedy text NLL under fp32 "
          f"{report['greedy_text_nll_under_fp32']['int4_float32_cache']:.4f}; the same text as the float16 cache's "
          f"on {report['int4_greedy_texts_equal_with_a_float32_cache']:.2f} of prompts")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
