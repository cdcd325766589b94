"""What sharding the target costs or gains: the same greedy decoding with 1 process and with N (tensor-parallel).

Run it under torchrun; every rank decodes, rank 0 prints. With one process it times the unsharded target,
so the ratio needs two runs of this script, one after the other on the same machine:

    torchrun --nproc-per-node 1 benchmarks/bench_parallel.py --out benchmarks/results_parallel_1.json
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --out benchmarks/results_parallel_2.json \
        --against benchmarks/results_parallel_1.json

The model is a random Llama (--layers, --hidden; 8 heads, 4 key-value heads, so 2, 4 or 8 ranks divide it)
in float32 on the CPU (gloo) or bfloat16 on GPUs (--device cuda: nccl, one GPU per rank), with a random 2-layer
draft of the same vocabulary for the chain sd row. Random weights accept few drafts: the rows measure the
machinery (the collectives each step adds, and the work each rank is spared), not speculation's gain. On the
CPU the ranks share one machine's cores, so N processes with 1 thread each are compared with 1 process with
N threads: the same cores, split two ways.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fuzzyspec.core import parallel
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.eval.bench import hardware
from fuzzyspec.loading import gguf_tokenizer_folder, load_model


def save_random(folder: Path, layers: int, hidden: int, vocab: int, seed: int) -> None:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf_tokenizer_folder()).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--folder", default="/tmp/fuzzyspec-bench-parallel")
    parser.add_argument("--out", required=True)
    parser.add_argument("--against", help="the 1-process run's JSON, for ratios")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world) if args.device == "cpu" else 1)
    folder, draft_folder = Path(args.folder) / "target", Path(args.folder) / "draft"
    if int(os.environ.get("RANK", "0")) == 0 and not (folder / "config.json").exists():
        save_random(folder, args.layers, args.hidden, 32000, seed=0)
        save_random(draft_folder, 2, args.hidden // 2, 32000, seed=1)
    if world > 1:
        parallel.start(args.device)
        dist.barrier()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    target, _ = load_model(str(folder), dtype, args.device, weights=None, tp=world > 1)
    draft, _ = load_model(str(draft_folder), dtype, parallel.local_device(args.device) if world > 1 else args.device,
                          weights=None)
    vocab = target.config.vocab_size
    rows = {"ar": DecodeConfig(method="ar", max_new_tokens=args.tokens),
            "chain sd (gamma 4)": DecodeConfig(method="sd", gamma=4, max_new_tokens=args.tokens)}
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (1, 32), generator=generator) for _ in range(args.prompts)]
    for config in rows.values():  # warm up
        decode(target, ModelDrafter(draft, vocab), prompts[0], DecodeConfig(**{**config.__dict__, "max_new_tokens": 4}),
               vocab)
    measured: dict[str, dict] = {name: {"tokens": 0, "seconds": 0.0, "passes": 0} for name in rows}
    for prompt in prompts:  # interleaved per prompt
        for name, config in rows.items():
            if world > 1:
                dist.barrier()
            clock = time.perf_counter()
            tokens, stats = decode(target, ModelDrafter(draft, vocab) if config.method != "ar" else None,
                                   prompt.to(target.device), config, vocab)
            measured[name]["seconds"] += time.perf_counter() - clock
            measured[name]["tokens"] += tokens.shape[1]
            measured[name]["passes"] += stats.target_forwards
    drafting = drafting_costs(target, draft, vocab, prompts[0]) if world > 1 else None
    if int(os.environ.get("RANK", "0")) != 0:
        return
    result = {"processes": world, "device": args.device, "hardware": hardware(args.device),
              "threads_per_process": torch.get_num_threads(), "layers": args.layers, "hidden": args.hidden,
              "rows": {name: {**m, "tokens_per_s": m["tokens"] / m["seconds"]} for name, m in measured.items()}}
    against = json.loads(Path(args.against).read_text()) if args.against else None
    print(f"{world} process(es) x {result['threads_per_process']} thread(s), {args.device}; {result['hardware']}")
    print(f"random Llama {args.layers} layers x {args.hidden} hidden; {args.prompts} prompts x {args.tokens} tokens")
    for name, row in result["rows"].items():
        ratio = ""
        if against is not None:
            base = against["rows"][name]["tokens_per_s"]
            ratio = f"  {row['tokens_per_s'] / base:.2f}x the {against['processes']}-process run ({base:.1f} tok/s)"
        print(f"  {name:20s} {row['tokens_per_s']:7.1f} tok/s  {row['tokens'] / row['passes']:.2f} tok/pass{ratio}")
    if drafting is not None:
        result["drafting_ms"] = drafting
        print(f"  drafting 4 tokens on every rank: {drafting['propose']:.1f} ms; sending rank 0's draft to the "
              f"others instead: {drafting['broadcast']:.1f} ms (its tokens and distributions, "
              f"{drafting['bytes'] / 1e6:.1f} MB)")
    Path(args.out).write_text(json.dumps(result, indent=1))


def drafting_costs(target, draft, vocab: int, prompt: torch.Tensor, repeats: int = 10) -> dict:
    """The two ways ranks can share drafts: each drafts for itself (what the engine does; the ranks draft at
    the same time, so it costs one proposal's time), or rank 0 drafts and broadcasts the draft (the tokens and
    the draft distributions the rules read), which the others wait for: one proposal's time and the broadcast.
    Measured as in decoding: the prompt already in the drafter's cache."""
    from fuzzyspec.core.draft import Budget
    from fuzzyspec.core.sampling import Sampling

    drafter = ModelDrafter(draft, vocab)
    sequence = prompt.to(target.device)
    drafter.propose(sequence, Budget(4), Sampling(), None)  # the prompt is in its cache: each proposal feeds one token
    propose, broadcast, size = [], [], 0
    for _ in range(repeats):
        dist.barrier()
        clock = time.perf_counter()
        proposal = drafter.propose(sequence, Budget(4), Sampling(), None)
        propose.append(time.perf_counter() - clock)
        payload = [(proposal.tokens, proposal.q, proposal.logits)]
        size = sum(t.numel() * t.element_size() for t in payload[0])
        dist.barrier()
        clock = time.perf_counter()
        dist.broadcast_object_list(payload, src=0)
        broadcast.append(time.perf_counter() - clock)
    return {"propose": 1000 * sorted(propose)[len(propose) // 2], "broadcast": 1000 * sorted(broadcast)[len(broadcast) // 2],
            "bytes": size}


if __name__ == "__main__":
    main()
