"""Decoding speed on a GPU, in one process: transformers' generate beside our engine, eager and compiled.

Two model sets: (a) a random Llama of about 1B parameters in bfloat16 with a random 2-layer draft of the same
vocabulary and a random EAGLE head (random weights accept almost nothing: the rows measure the machinery,
and AR's share of the memory-bandwidth limit); (b) the embedded SmolLM2-135M-Instruct with its shipped drafters
(real acceptance). Greedy, --tokens new tokens per prompt, EOS never stops a run, every configuration
interleaved per prompt.

Rows: HF generate (eager, dynamic cache), HF generate with its static cache compiled, our AR (eager, compiled),
chain sd with the draft model, EAGLE-2 trees sd, chain fsd and fsd-hybrid (js, T = 0.3); for each, tokens/s, ms
per target pass and tokens per pass, and for AR the fraction of the memory-bandwidth limit: weight bytes read per
step over the copy bandwidth measured on this device (one step cannot be faster than reading every weight once).

Usage: python benchmarks/bench_gpu.py [--sets random,embedded] [--prompts 4] [--tokens 128] [--device cuda]
       python benchmarks/bench_gpu.py --device cpu --tiny --tokens 8      (a smoke test of the script itself)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fuzzyspec import tuning
from fuzzyspec.api import ModelPair
from fuzzyspec.core.step import TargetStep
from fuzzyspec.drafters.draftlm import DraftLM
from fuzzyspec.drafters.eagle import EagleDrafter, head_logits
from fuzzyspec.drafters.eagle_head import EagleHead
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.drafters.registry import DrafterSource
from fuzzyspec.loading import embedded_folder

PROMPTS = ["Explain how a bicycle stays upright.", "Write a short story about a lighthouse keeper.",
           "What are the main causes of inflation?", "Give three tips for learning a language."]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write), the best of five."""
    size = 1 << 30 if device.type == "cuda" else 1 << 27
    a, b = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        clock = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - clock)
    return 2 * size / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_pair(device: torch.device, tiny: bool) -> ModelPair:
    """A random ~1B Llama (tiny: a few layers of width 64), a random 2-layer draft of its vocabulary, and a random
    EAGLE head; the embedded tokenizer (its vocabulary: 49,152 tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_folder())
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if tiny else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4)  # TinyLlama-1.1B's shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).to(device, dtype).eval()
    draft = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})).to(device, dtype).eval()
    head = EagleHead.for_target(target).to(device, dtype).eval()
    logits = head_logits(head, target)
    pair = ModelPair(target, tokenizer)
    pair.drafts = {
        "draft": DrafterSource("draft", draft, lambda v: ModelDrafter(draft, v), DraftLM(draft).width),
        "eagle": DrafterSource("eagle", head, lambda v: EagleDrafter(head, target, v, logits), drafts_trees=True)}
    return pair


def embedded_pair(device: torch.device) -> ModelPair:
    pair = ModelPair.load(draft=None, device=str(device), weights="bf16" if device.type == "cuda" else "auto")
    pair.drafts = {name: pair.with_drafter(name, device=str(device)).draft for name in ("draft", "eagle")}
    return pair


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decoding step reads: every parameter and buffer once (the embedding's rows aside: one row)."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    return total if tied else total - embedding.numel() * embedding.element_size()


def run_set(name: str, pair: ModelPair, device: torch.device, prompts: int, tokens: int, bandwidth: float) -> list:
    eager, compiled = TargetStep(pair.target), TargetStep(pair.target, compile=True)
    rows = [("HF generate, eager", "hf", None), ("HF generate, static cache, compiled", "hf-static", None),
            ("our AR, eager", eager, {"method": "ar"}), ("our AR, compiled", compiled, {"method": "ar"}),
            ("chain sd, draft model", compiled, {"draft": "draft", "method": "sd"}),
            ("EAGLE-2 trees sd", compiled, {"draft": "eagle", "method": "sd", "tree": True}),
            ("chain fsd js 0.3", compiled, {"draft": "draft", "method": "fsd", "threshold": 0.3}),
            ("chain fsd-hybrid js 0.3", compiled, {"draft": "draft", "method": "fsd-hybrid", "threshold": 0.3})]
    pairs = {}
    for label, step, options in rows:
        if options is not None:
            draft = pair.drafts[options["draft"]] if "draft" in options else None
            pairs[label] = ModelPair(pair.target, pair.tokenizer, draft, step)
    results = {label: {"seconds": 0.0, "tokens": 0, "passes": 0} for label, _, _ in rows}
    hf_compiled = torch.compile(pair.target.forward, mode="reduce-overhead" if device.type == "cuda" else None)
    for index in range(-1, prompts):  # index -1: warm-up (compiles)
        ids = pair.encode(PROMPTS[max(index, 0) % len(PROMPTS)])
        count = 8 if index < 0 else tokens
        for label, step, options in rows[index % len(rows):] + rows[: index % len(rows)]:
            _sync(device)
            clock = time.perf_counter()
            if options is None:
                kwargs = {"cache_implementation": "static"} if step == "hf-static" else {}
                forward = pair.target.forward
                if step == "hf-static":
                    pair.target.forward = hf_compiled
                out = pair.target.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False, **kwargs)
                pair.target.forward = forward
                made, passes = out.shape[1] - ids.shape[1], count
            else:
                decoding = {k: v for k, v in options.items() if k != "draft"}
                result = pairs[label].generate(ids, max_new_tokens=count, eos_token_ids=(), gamma_schedule="constant",
                                               **decoding)
                made, passes = result.stats.new_tokens, result.stats.target_forwards
            _sync(device)
            if index >= 0:
                results[label]["seconds"] += time.perf_counter() - clock
                results[label]["tokens"] += made
                results[label]["passes"] += passes
    limit = bandwidth / weight_bytes(pair.target)  # steps per second if a step only read the weights
    table = []
    for label, total in results.items():
        rate = total["tokens"] / total["seconds"]
        step_ms = 1000 * total["seconds"] / total["passes"]
        share = (1000 / step_ms) / limit if label.startswith("our AR") else None
        table.append({"set": name, "row": label, "tokens_per_s": rate, "ms_per_pass": step_ms,
                      "tokens_per_pass": total["tokens"] / total["passes"], "ar_bandwidth_share": share})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="random,embedded")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random target: checks the script, measures nothing")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    print(f"fuzzyspec bench_gpu: {tuning.machine(args.device)}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"{args.prompts} prompts x {args.tokens} tokens, greedy; {time.strftime('%Y-%m-%d')}")
    table = []
    for name in args.sets.split(","):
        pair = random_pair(device, args.tiny) if name == "random" else embedded_pair(device)
        print(f"\n{name}: target {sum(p.numel() for p in pair.target.parameters()) / 1e6:.0f} M parameters, "
              f"{weight_bytes(pair.target) / 1e9:.2f} GB read per step")
        rows = run_set(name, pair, device, args.prompts, args.tokens, bandwidth)
        for row in rows:
            share = f"  {100 * row['ar_bandwidth_share']:.0f}% of the bandwidth limit" \
                if row["ar_bandwidth_share"] is not None else ""
            print(f"  {row['row']:<40} {row['tokens_per_s']:8.1f} tok/s  {row['ms_per_pass']:7.2f} ms/pass  "
                  f"{row['tokens_per_pass']:5.2f} tok/pass{share}")
        table += rows
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
