"""The ``fuzzyspec`` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Sequence

from transformers.utils import logging as transformers_logging

from .api import DEFAULT_DRAFT, ModelPair, make_config
from .decoding import METHODS, SCHEDULES
from .divergences import ALIASES, NAMES
from .train import KINDS, TrainConfig, train


class UsageError(Exception):
    """Bad input; reported as one line on stderr with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        raise UsageError(message)


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"threshold must be a number, got {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"threshold must be >= 0 (inf allowed), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fuzzyspec", description="Fuzzy speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("prompt", help="the prompt (a user message when --chat)")
    models = gen.add_argument_group("models")
    models.add_argument("--target", default=None,
                        help="HF id, folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    models.add_argument("--draft", default=DEFAULT_DRAFT,
                        help="the drafter: 'default' (the draft LM shipped for the embedded target), 'eagle' "
                             "(the EAGLE head shipped for it), eagle:DIR (any EAGLE head), self:N (the target's "
                             "first N layers), or a draft model: HF id, folder or .gguf file")
    models.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    models.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (spread over all GPUs)")
    rule = gen.add_argument_group("decoding")
    rule.add_argument("--method", default="fsd", choices=METHODS)
    rule.add_argument("--divergence", default="js", metavar="NAME",
                      help=f"one of: {', '.join(NAMES)}; aliases: {', '.join(ALIASES)} (default: js)")
    rule.add_argument("--threshold", type=_threshold, default=0.3, help="T of the fuzzy rules (default: 0.3)")
    rule.add_argument("--raw-divergence", action="store_true",
                      help="compute D on unprocessed distributions, as the FSD reference code did")
    rule.add_argument("--divergence-top-k", type=int, default=50, help="k of the topk_* divergences")
    rule.add_argument("--divergence-top-p", type=float, default=0.9, help="p of the topp_* divergences")
    rule.add_argument("--gamma", type=int, default=5, help="drafted tokens per step (default: 5)")
    rule.add_argument("--gamma-schedule", default="constant", choices=SCHEDULES)
    rule.add_argument("--draft-confidence", type=float, default=0.0,
                      help="stop drafting when the draft's top probability falls below this")
    rule.add_argument("--tree", action="store_true",
                      help="draft EAGLE-2 dynamic trees instead of chains (needs an EAGLE head as --draft)")
    rule.add_argument("--tree-total-tokens", type=int, default=16, help="nodes kept per tree (default: 16)")
    rule.add_argument("--tree-depth", type=int, default=5, help="tree depth (default: 5)")
    rule.add_argument("--tree-top-k", type=int, default=4, help="children per expanded node and nodes expanded "
                                                                  "per level (default: 4)")
    rule.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    rule.add_argument("--top-k", type=int, default=0, help="0 = off")
    rule.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    rule.add_argument("--seed", type=int, default=None)
    rule.add_argument("--max-new-tokens", type=int, default=128)
    rule.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat = gen.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt in the chat template (default)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    train = commands.add_parser("train", help="train a drafter for a target on ShareGPT")
    train.add_argument("kind", choices=KINDS, help="eagle: an EAGLE head; draft: a small draft LM")
    train.add_argument("--out", required=True, help="output folder (a run there is resumed)")
    train.add_argument("--target", default=None, help="HF id, folder or .gguf file (default: embedded)")
    train.add_argument("--device", default="cpu")
    train.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                       help="the target's dtype (trained weights stay float32)")
    defaults = TrainConfig(kind="eagle", out="")
    for flag, help_text in [("max-tokens", "cut conversations to this many tokens"),
                            ("limit", "use only the first N training conversations"),
                            ("batch-size", "sequences per step"), ("lr", "peak learning rate"),
                            ("warmup-steps", "linear warm-up steps"), ("epochs", "passes over the data"),
                            ("budget-minutes", "stop (saving everything) after this much wall time"),
                            ("seed", "random seed"), ("init", "start from this saved drafter of the same kind"),
                            ("eval-sequences", "held-out sequences to evaluate"),
                            ("layers", "draft LM: decoder layers"), ("noise", "EAGLE: feature noise"),
                            ("regression-weight", "EAGLE: weight of the feature loss"),
                            ("ce-weight", "EAGLE: weight of the token loss")]:
        field = flag.replace("-", "_")
        default = getattr(defaults, field)
        kind = float if isinstance(default, float) or field == "budget_minutes" else str if field == "init" else int
        train.add_argument(f"--{flag}", type=kind, default=default, help=f"{help_text} (default: {default})")
    return parser


def _generate(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    options = dict(method=args.method, divergence=args.divergence, threshold=args.threshold,
                   raw_divergence=args.raw_divergence, divergence_top_k=args.divergence_top_k,
                   divergence_top_p=args.divergence_top_p, gamma=args.gamma, gamma_schedule=args.gamma_schedule,
                   draft_confidence=args.draft_confidence, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, tree=args.tree,
                   tree_total_tokens=args.tree_total_tokens, tree_depth=args.tree_depth, tree_top_k=args.tree_top_k)
    make_config(**options)  # validate before spending time on loading models
    pair = ModelPair.load(args.target, None if args.method == "ar" else args.draft, args.dtype, args.device)

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = pair.generate(args.prompt, chat=args.chat, stop=args.stop, on_text=None if args.json else show,
                           **options)
    stats = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "method": args.method, "finish_reason": result.finish_reason,
                          "stats": stats.to_dict()}))
        return
    print()
    rate = "-" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.2f}"
    print(f"[{args.method}] {stats.new_tokens} tokens in {stats.wall_s:.2f} s ({stats.tokens_per_s:.1f} tokens/s), "
          f"{stats.mean_accepted or 0:.2f} tokens per target pass, acceptance {rate}", file=sys.stderr)


def _train(args: argparse.Namespace) -> None:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    metrics = train(config)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}))


def main(argv: Sequence[str] | None = None) -> int:
    transformers_logging.disable_progress_bar()
    try:
        args = build_parser().parse_args(argv)
        _train(args) if args.command == "train" else _generate(args)
    except (UsageError, ValueError) as error:
        print(f"fuzzyspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
