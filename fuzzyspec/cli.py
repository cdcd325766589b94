"""The ``fuzzyspec`` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from transformers.utils import logging as transformers_logging

from .api import DEFAULT_DRAFT, ModelPair, eos_ids, make_config
from .bench import Settings, Sweep, plan
from .calibrate import CALIBRATION_PROMPTS, cached_calibration, calibrate_pair, check_request
from .decoding import METHODS, SCHEDULES
from .divergences import ALIASES, NAMES, canonical_name
from .rules import FUZZY
from .tasks import TASKS, get_task
from .selfdistill import AnswerSettings
from .train import DEFAULT_DRAFT_VOCAB, KINDS, TrainConfig, train

CALIBRATED_DIVERGENCES = "js,js_legacy,kl_pq,kl_qp,tv,hellinger"
BENCH_ACCEPTANCE = "0.3,0.5,0.7,0.9"
SETTINGS_FIELDS = {f.name for f in dataclasses.fields(Settings)}


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


def _floats(text: str) -> list[float]:
    try:
        return [_threshold(t) for t in text.split(",") if t.strip()]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"in {text!r}: {error}") from None


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _add_models(parser: argparse.ArgumentParser, draft: bool = True) -> None:
    models = parser.add_argument_group("models")
    models.add_argument("--target", default=None,
                        help="HF id, folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    if draft:
        models.add_argument("--draft", default=DEFAULT_DRAFT,
                            help="the drafter: 'default' (the draft LM shipped for the embedded target), 'eagle' "
                                 "(the EAGLE head shipped for it), eagle:DIR (any EAGLE head), self:N (the "
                                 "target's first N layers), or a draft model: HF id, folder or .gguf file")
    models.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    models.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (spread over all GPUs)")


def _add_decoding(parser: argparse.ArgumentParser, max_new_tokens: int, seed: int | None, tree: bool = True
                  ) -> argparse._ArgumentGroup:
    """Options shared by generate, calibrate and bench: drafting, trees, sampling, length."""
    rule = parser.add_argument_group("decoding")
    rule.add_argument("--raw-divergence", action="store_true",
                      help="compute D on unprocessed distributions, as the FSD reference code did")
    rule.add_argument("--divergence-top-k", type=int, default=50, help="k of the topk_* divergences")
    rule.add_argument("--divergence-top-p", type=float, default=0.9, help="p of the topp_* divergences")
    rule.add_argument("--gamma", type=int, default=5, help="drafted tokens per step (default: 5)")
    rule.add_argument("--gamma-schedule", default="constant", choices=SCHEDULES)
    rule.add_argument("--draft-confidence", type=float, default=0.0,
                      help="stop drafting when the draft's top probability falls below this")
    if tree:  # bench names trees per method instead (eagle+tree)
        rule.add_argument("--tree", action="store_true",
                          help="draft EAGLE-2 dynamic trees instead of chains (needs an EAGLE head as --draft)")
    rule.add_argument("--tree-total-tokens", type=int, default=16, help="nodes kept per tree (default: 16)")
    rule.add_argument("--tree-depth", type=int, default=5, help="tree depth (default: 5)")
    rule.add_argument("--tree-top-k", type=int, default=4, help="children per expanded node and nodes expanded "
                                                                  "per level (default: 4)")
    rule.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    rule.add_argument("--top-k", type=int, default=0, help="0 = off")
    rule.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    rule.add_argument("--seed", type=int, default=seed, help=f"random seed (default: {seed})")
    rule.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                      help=f"(default: {max_new_tokens})")
    return rule


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fuzzyspec", description="Fuzzy speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    divergence_help = f"one of: {', '.join(NAMES)}; aliases: {', '.join(ALIASES)}"

    gen = commands.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("prompt", help="the prompt (a user message when --chat)")
    _add_models(gen)
    rule = _add_decoding(gen, max_new_tokens=128, seed=None)
    rule.add_argument("--method", default="fsd", choices=METHODS)
    rule.add_argument("--divergence", default="js", metavar="NAME", help=f"{divergence_help} (default: js)")
    threshold = rule.add_mutually_exclusive_group()
    threshold.add_argument("--threshold", type=_threshold, default=None, help="T of the fuzzy rules (default: 0.3)")
    threshold.add_argument("--target-acceptance", type=float, default=None, metavar="A",
                           help="instead of T: calibrate T so that a fraction A of drafts is accepted (on "
                                f"{CALIBRATION_PROMPTS} held-out ShareGPT prompts; remembered in the cache)")
    rule.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat = gen.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt in the chat template (default)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    cal = commands.add_parser("calibrate", help="print the threshold that yields a requested acceptance rate")
    _add_models(cal)
    rule = _add_decoding(cal, max_new_tokens=64, seed=0)
    rule.add_argument("--method", default="fsd", choices=FUZZY)
    rule.add_argument("--divergences", type=_names, default=_names(CALIBRATED_DIVERGENCES),
                      help=f"comma-separated ({divergence_help}; default: {CALIBRATED_DIVERGENCES})")
    wanted = cal.add_mutually_exclusive_group(required=True)
    wanted.add_argument("--acceptance", type=float, help="the fraction of drafted tokens to accept, in (0, 1)")
    wanted.add_argument("--mean-accepted", type=float,
                        help="the tokens per target pass to reach, in (1, gamma + 1)")
    cal.add_argument("--task", default="freeform", help="whose prompts to sample (default: freeform, held-out "
                                                        "ShareGPT); any bench task or a task file")
    cal.add_argument("--data", default=None, help="the task's JSONL file (free-form: rows with 'prompt')")
    cal.add_argument("--prompts", type=int, default=16, help="prompts in the sample (default: 16)")
    cal.add_argument("--json", action="store_true", help="print one JSON object per divergence")

    bench = commands.add_parser("bench", help="sweep rules, divergences and thresholds on a task: CSV, JSON, PNG")
    bench.add_argument("--task", required=True, help=f"one of {', '.join(TASKS)}, or a .py file defining a Task")
    bench.add_argument("--data", default=None, help="the task's local JSONL file (default: the task's own source)")
    bench.add_argument("--limit", type=int, default=None, help="only the first N examples")
    bench.add_argument("--out", required=True, help="the sweep folder (a sweep there is resumed)")
    _add_models(bench, draft=False)
    grid = bench.add_argument_group("sweep")
    grid.add_argument("--methods", type=_names, default=["ar", DEFAULT_DRAFT],
                      help="comma-separated: ar and drafters as --draft names them ('default', 'eagle', "
                           "eagle:DIR, self:N, a model); append +tree for EAGLE-2 trees, e.g. eagle+tree "
                           "(default: ar,default)")
    grid.add_argument("--rules", type=_names, default=["sd", "fsd"], help="comma-separated: sd, fsd, fsd-hybrid "
                                                                          "(default: sd,fsd)")
    grid.add_argument("--divergences", type=_names, default=["js"], help="comma-separated (default: js)")
    values = grid.add_mutually_exclusive_group()
    values.add_argument("--thresholds", type=_floats, default=None, help="comma-separated T values")
    values.add_argument("--target-acceptance", type=_floats, default=None,
                        help="comma-separated acceptance rates; T is calibrated for each (default: "
                             f"{BENCH_ACCEPTANCE} when no --thresholds)")
    grid.add_argument("--calibration-prompts", type=int, default=8,
                      help="examples used to calibrate T (default: 8)")
    _add_decoding(bench, max_new_tokens=256, seed=0, tree=False)
    bench.add_argument("--quiet", action="store_true", help="no progress bar")

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with batched FSD")
    _add_models(serve)
    serve.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1; 0.0.0.0 to listen on all)")
    serve.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    serve.add_argument("--model-name", default=None,
                       help="the model id clients send (default: the --target name, or smollm2-135m-instruct)")
    defaults = serve.add_argument_group("request defaults (each request may override them in its body)")
    defaults.add_argument("--method", default="fsd", choices=METHODS)
    defaults.add_argument("--divergence", default="js", help=f"{divergence_help} (default: js)")
    defaults.add_argument("--threshold", type=_threshold, default=0.3, help="(default: 0.3)")
    defaults.add_argument("--gamma", type=int, default=5, help="(default: 5)")
    defaults.add_argument("--temperature", type=float, default=1.0, help="(default: 1.0, as OpenAI's API)")
    defaults.add_argument("--max-tokens", type=int, default=256, help="(default: 256)")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-batch", type=int, default=16, help="rows decoded together (default: 16)")
    limits.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting for a row; more get HTTP 429 (default: 64)")
    limits.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take, queueing included; then HTTP 504 (default: 300)")

    train = commands.add_parser("train", help="train a drafter for a target, or make its training data")
    kinds = train.add_subparsers(dest="kind", required=True, parser_class=_Parser, metavar="KIND")
    helps = {"eagle3": "an EAGLE-3 head (fused features, reduced vocabulary, training-time test)",
             "eagle": "an EAGLE-1/2 head (feature regression)",
             "draft": "a small draft LM sharing the target's embedding and LM head",
             "data": "the target's own answers to training prompts (self-distillation data)"}
    for kind in (*KINDS, "data"):
        sub = kinds.add_parser(kind, help=helps[kind], description=helps[kind])
        sub.add_argument("--out", required=True, help="output folder (a run there is resumed)")
        sub.add_argument("--target", default=None, help="HF id, folder or .gguf file (default: embedded)")
        sub.add_argument("--device", default="cpu")
        sub.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                         help="the target's dtype (trained weights stay float32)")
        if kind == "data":
            _add_answer_flags(sub)
        else:
            _add_training_flags(sub, kind)
    return parser


TRAINING_FLAGS = {  # TrainConfig field -> (help, kinds it applies to; None: all)
    "data": ("'sharegpt', a folder from `fuzzyspec train data`, or a TokenDataset .npz", None),
    "eval_data": ("held-out data, the same choices", None),
    "max_tokens": ("cut sequences to this many tokens", None),
    "limit": ("use only the first N training sequences", None),
    "batch_size": ("sequences per step", None), "lr": ("peak learning rate", None),
    "warmup_steps": ("linear warm-up steps", None), "epochs": ("passes over the data", None),
    "budget_minutes": ("stop (saving everything) after this much wall time", None),
    "seed": ("random seed", None), "init": ("start from this saved drafter of the same kind", None),
    "eval_sequences": ("held-out sequences to evaluate", None),
    "draft_vocab": ("size N of the reduced draft vocabulary (the target's N most frequent output tokens); "
                    f"default {DEFAULT_DRAFT_VOCAB}, or the whole vocabulary if N is at least its size",
                    ("eagle3", "draft")),
    "loss": ("distillation loss: ce, tv or js", ("eagle3", "draft")),
    "layers": ("decoder layers", ("draft",)),
    "ttt_steps": ("draft steps unrolled in training (training-time test)", ("eagle3",)),
    "ttt_decay": ("weight of unrolled step s is this to the power s", ("eagle3",)),
    "train_lm_head": ("train and store the head's own LM head (default: the target's rows, not stored)",
                      ("eagle3",)),
    "feature_layers": ("comma-separated target hidden-state indices to fuse (default: 2, L/2, L-3)", ("eagle3",)),
    "noise": ("feature noise", ("eagle",)), "regression_weight": ("weight of the feature loss", ("eagle",)),
    "ce_weight": ("weight of the token loss", ("eagle",)),
}


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_training_flags(parser: argparse.ArgumentParser, kind: str) -> None:
    defaults = TrainConfig(kind=kind, out="")
    types = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for field, (help_text, kinds) in TRAINING_FLAGS.items():
        if kinds is not None and kind not in kinds:
            continue
        default = getattr(defaults, field)
        flag = "--" + field.replace("_", "-")
        if types[field] in (bool, "bool"):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind_of = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float,
                   "str | None": str, "list[int] | None": _int_list}[str(types[field])]
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, type=kind_of, default=default, help=help_text + shown)


def _add_answer_flags(parser: argparse.ArgumentParser) -> None:
    defaults = AnswerSettings()
    parser.add_argument("--prompts", default="sharegpt",
                        help="'sharegpt' (first user messages of its training split) or a JSONL file of "
                             "prompt/messages rows (default: sharegpt)")
    parser.add_argument("--split", default="train", choices=["train", "held_out"],
                        help="ShareGPT split to take prompts from (default: train)")
    parser.add_argument("--limit", type=int, default=None, help="answer only the first N prompts")
    parser.add_argument("--temperatures", type=_floats, default=list(defaults.temperatures),
                        help="one answer per prompt at each temperature, 0 for greedy (default: 0,0.8)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                        help=f"longest answer (default: {defaults.max_new_tokens})")
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens,
                        help=f"skip longer prompts (default: {defaults.max_prompt_tokens})")
    parser.add_argument("--shard-size", type=int, default=defaults.shard_size,
                        help=f"prompts per output file (default: {defaults.shard_size})")
    parser.add_argument("--batch-size", type=int, default=64, help="rows decoded together (default: 64)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default: 0)")
    parser.add_argument("--worker", default="0/1",
                        help="i/n: this process answers shards s with s %% n == i, so n processes share the work")


DECODING_FLAGS = ("raw_divergence", "divergence_top_k", "divergence_top_p", "gamma", "gamma_schedule",
                  "draft_confidence", "tree_total_tokens", "tree_depth", "tree_top_k", "temperature", "top_k",
                  "top_p", "seed", "max_new_tokens")


def _decoding(args: argparse.Namespace, **extra: object) -> dict:
    """DecodeConfig options from the shared flags, validated before any model loads."""
    options = {k: getattr(args, k) for k in DECODING_FLAGS} | {"tree": getattr(args, "tree", False)} | extra
    make_config(**options)
    return options


def _calibrated_threshold(pair: ModelPair, options: dict, target: str | None, draft: str,
                          acceptance: float) -> float:
    """T for ``generate --target-acceptance``, calibrated once per setting and then read from the cache."""
    config = make_config(**(options | {"eos_token_ids": eos_ids(pair.target, pair.tokenizer)}))
    found = cached_calibration(pair, config, acceptance, {"target": str(target), "draft": str(draft)})
    print(f"[calibrated] {options['divergence']} T={found['threshold']:.4g}: acceptance {found['acceptance']:.3f} "
          f"on {found['prompts']} held-out prompts (asked {acceptance})", file=sys.stderr)
    return found["threshold"]


def _generate(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    if args.target_acceptance is not None:
        if args.method not in FUZZY:
            raise UsageError(f"--target-acceptance needs a fuzzy method (fsd or fsd-hybrid), not {args.method}")
        check_request("acceptance", args.target_acceptance, args.gamma)
    options = _decoding(args, method=args.method, divergence=args.divergence,
                        threshold=0.3 if args.threshold is None else args.threshold)
    pair = ModelPair.load(args.target, None if args.method == "ar" else args.draft, args.dtype, args.device)
    if args.target_acceptance is not None:
        options["threshold"] = _calibrated_threshold(pair, options, args.target, args.draft, args.target_acceptance)

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = pair.generate(args.prompt, chat=args.chat, stop=args.stop, on_text=None if args.json else show,
                           **options)
    stats = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "method": args.method, "threshold": options["threshold"],
                          "finish_reason": result.finish_reason, "stats": stats.to_dict()}))
        return
    print()
    rate = "-" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.2f}"
    print(f"[{args.method}] {stats.new_tokens} tokens in {stats.wall_s:.2f} s ({stats.tokens_per_s:.1f} tokens/s), "
          f"{stats.mean_accepted or 0:.2f} tokens per target pass, acceptance {rate}", file=sys.stderr)


def _calibrate(args: argparse.Namespace) -> None:
    objective, value = ("acceptance", args.acceptance) if args.acceptance is not None else \
        ("mean_accepted", args.mean_accepted)
    check_request(objective, value, args.gamma)
    if args.prompts < 1:
        raise UsageError(f"--prompts must be >= 1, got {args.prompts}")
    for name in args.divergences:
        canonical_name(name)
    options = _decoding(args, method=args.method)
    prompts = [e.prompt for e in get_task(args.task, args.data).examples(args.prompts)]
    pair = ModelPair.load(args.target, args.draft, args.dtype, args.device)
    options["eos_token_ids"] = eos_ids(pair.target, pair.tokenizer)
    if not args.json:
        print(f"{'divergence':<16} {'T':>10} {'acceptance':>10} {'tok/pass':>9} {'D q10':>8} {'D q50':>8} "
              f"{'D q90':>8} {'runs':>4}")
    for name in args.divergences:
        config = make_config(**(options | {"divergence": name, "threshold": 0.0}))
        result = calibrate_pair(pair, config, objective, value, prompts, progress=not args.json)
        if args.json:
            print(json.dumps(result.to_dict() | {"prompts": len(prompts)}))
            continue
        q = result.quantiles
        note = "" if result.converged else "  (not converged: acceptance jumps with T here; use more --prompts)"
        print(f"{name:<16} {result.threshold:>10.4g} {result.acceptance:>10.3f} {result.mean_accepted:>9.2f} "
              f"{q.get('q10', 0):>8.3g} {q.get('q50', 0):>8.3g} {q.get('q90', 0):>8.3g} {result.runs:>4}{note}",
              flush=True)


def _bench(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    for name in args.divergences:
        canonical_name(name)
    acceptances = args.target_acceptance
    if args.thresholds is None and acceptances is None:
        acceptances = _floats(BENCH_ACCEPTANCE)
    for value in acceptances or ():
        check_request("acceptance", value, args.gamma)
    options = _decoding(args)
    settings = Settings(task=args.task, data=args.data, limit=args.limit, target=args.target, dtype=args.dtype,
                        device=args.device, calibration_prompts=args.calibration_prompts,
                        **{k: v for k, v in options.items() if k in SETTINGS_FIELDS})
    specs = plan(args.methods, args.rules, args.divergences, args.thresholds or [], acceptances or [])
    sweep = Sweep(settings, args.out, progress=not args.quiet)
    rows = sweep.run(specs)
    metric = sweep.task.metric
    print(f"{'configuration':<36} {metric:>8} {'tok/s':>7} {'tok/pass':>8} {'accept':>7}")
    for row in rows:
        value = "-" if row.get(metric) is None else f"{row[metric]:.3f}"
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        threshold = "" if row["threshold"] is None else f" T={row['threshold']:.3g}"
        name = f"{row['method']} {row['rule']}" + (f" {row['divergence']}{threshold}" if row["divergence"] else "")
        print(f"{name:<36} {value:>8} {row['tokens_per_s']:>7.1f} {row['mean_accepted']:>8.2f} {rate:>7}")
    print(f"results: {Path(args.out) / 'results.csv'}, {Path(args.out) / 'results.json'}, "
          f"{Path(args.out) / 'curve.png'}", file=sys.stderr)


def _train(args: argparse.Namespace) -> None:
    if args.kind == "data":
        _answers(args)
        return
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    metrics = train(config)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}))


def _answers(args: argparse.Namespace) -> None:
    from .loading import load_model
    from .selfdistill import encode_prompts, generate_answers, training_prompts

    try:
        index, count = (int(part) for part in args.worker.split("/"))
    except ValueError:
        raise UsageError(f"--worker must be i/n, got {args.worker!r}") from None
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    settings = AnswerSettings(tuple(args.temperatures), args.max_new_tokens, args.max_prompt_tokens,
                              args.shard_size, args.seed)
    texts = training_prompts(args.prompts, args.limit, args.split)
    target, tokenizer = load_model(args.target, args.dtype, args.device)
    prompts = encode_prompts(tokenizer, texts, settings.max_prompt_tokens)
    written = generate_answers(target, prompts, args.out, settings, eos_ids(target, tokenizer), args.batch_size,
                               (index, count))
    print(json.dumps({"prompts": len(prompts), "skipped_long_prompts": len(texts) - len(prompts),
                      "answers_written": written, "out": args.out}))


def _serve(args: argparse.Namespace) -> None:
    from .loading import EMBEDDED
    from .server import ServeConfig, Server, create_app

    for name, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-tokens", args.max_tokens), ("--gamma", args.gamma)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if args.request_timeout <= 0:
        raise UsageError(f"--request-timeout must be > 0, got {args.request_timeout}")
    canonical_name(args.divergence)
    make_config(method=args.method, divergence=args.divergence, threshold=args.threshold, gamma=args.gamma,
                temperature=args.temperature)
    import uvicorn

    draft = None if args.method == "ar" and args.draft == DEFAULT_DRAFT else args.draft
    pair = ModelPair.load(args.target, draft, args.dtype, args.device)
    config = ServeConfig(model_name=args.model_name or args.target or EMBEDDED, method=args.method,
                         divergence=args.divergence, threshold=args.threshold, gamma=args.gamma,
                         temperature=args.temperature, max_tokens=args.max_tokens, max_batch=args.max_batch,
                         max_queue=args.max_queue, request_timeout=args.request_timeout,
                         names=(("target", str(args.target)), ("draft", str(draft))))
    app = create_app(Server(pair, config))
    print(f"fuzzyspec: serving {config.model_name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


COMMANDS = {"generate": _generate, "calibrate": _calibrate, "bench": _bench, "serve": _serve, "train": _train}


def main(argv: Sequence[str] | None = None) -> int:
    transformers_logging.disable_progress_bar()
    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
    except (UsageError, ValueError) as error:
        print(f"fuzzyspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
