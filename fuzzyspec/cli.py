"""The ``fuzzyspec`` command line.

Only the standard library and ``options`` are imported up front, so ``fuzzyspec --help`` and usage
errors answer at once; each command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Sequence

from . import __version__
from .options import (DEFAULT_DRAFT, DEFAULT_JOB, FUZZY, JOB_HELP, OPTIONS, SERVE_DEFAULTS, OptionError,
                      check_acceptance, flag, parse_threshold, value_parser)

CALIBRATED_DIVERGENCES = "js,js_legacy,kl_pq,kl_qp,tv,hellinger"
BENCH_ACCEPTANCE = "0.3,0.5,0.7,0.9"
BENCH_DEFAULTS = {"seed": 0, "max_new_tokens": 256}  # a sweep is seeded and answers at some length
CALIBRATE_DEFAULTS = {"seed": 0, "max_new_tokens": 64}  # its sample: 64 tokens a prompt (calibrate's)
DRAFT_HELP = ("the drafter: 'default' (the default job's: the shipped {default} head, drafting EAGLE-2 trees), "
              "'draft' (the draft LM shipped for the embedded target), 'eagle' (the EAGLE head shipped for it, "
              "chains unless --tree), eagle:DIR (any EAGLE-1/2/3 head), lookup or lookup:N (prompt lookup, no "
              "weights), self:N (the target's first N layers), or a draft model: a folder, a .gguf file or a "
              "Hugging Face id (default: default)")
log = logging.getLogger("fuzzyspec")


class UsageError(Exception):
    """Bad input; reported as one line on stderr with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        raise UsageError(message)


def _typed(read, name: str):
    """An argparse type from an option reader: its OptionError becomes a usage error naming the flag."""
    def convert(text: str):
        try:
            return read(text)
        except OptionError as error:
            raise argparse.ArgumentTypeError(error.problem) from None
    convert.__name__ = name
    return convert


def _floats(text: str) -> list[float]:
    try:
        return [parse_threshold(t) for t in text.split(",") if t.strip()]
    except OptionError as error:
        raise argparse.ArgumentTypeError(f"in {text!r}: {error.problem}") from None


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_options(parser: argparse.ArgumentParser, shown: dict | None = None,
                skip: tuple[str, ...] = ()) -> dict[str, argparse._ArgumentGroup]:
    """Add every decoding option (but ``skip``) to ``parser``, unset by default: a flag left out is decided by
    ``DecodeConfig.from_options`` like any other request. ``shown``: defaults this command sets itself."""
    shown = shown or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in OPTIONS:
        if option.name in skip:
            continue
        group = groups.setdefault(option.group, parser.add_argument_group(option.group))
        default = shown.get(option.name, option.shown_default if option.shown_default is not None else option.default)
        help_text = option.help + ("" if default is None else f" (default: {_shown(default)})")
        if isinstance(option.default, bool):  # --tree and --no-tree
            group.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        group.add_argument(option.flag, type=_typed(value_parser(option), option.name), default=None,
                           choices=option.choices, metavar=None if option.choices else option.name.upper(),
                           help=help_text)
    return groups


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def given_options(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    """The decoding options the command line set (over ``defaults``, the command's own)."""
    given = {option.name: getattr(args, option.name) for option in OPTIONS
             if getattr(args, option.name, None) is not None}
    return dict(defaults or {}) | given


def _add_models(parser: argparse.ArgumentParser, draft: bool = True) -> None:
    models = parser.add_argument_group("models")
    models.add_argument("--target", default=None,
                        help="HF id, folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    if draft:
        models.add_argument("--draft", default=DEFAULT_DRAFT, help=DRAFT_HELP.format(default=DEFAULT_JOB["draft"]))
    models.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="(default: auto: bfloat16 where the hardware computes it natively, else float32)")
    models.add_argument("--weights", default="auto", choices=["auto", "int4", "bf16", "fp32"],
                        help="how the target's weights are held: int4 (a GGUF target's own 4-bit weights, through "
                             "the CPU int4 kernel), bf16 or fp32 (dequantized) (default: auto: int4 for a GGUF "
                             "target on the CPU unless --dtype names a float type, else --dtype)")
    models.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:N, or auto to spread a large model over all GPUs (default: cuda if "
                             "a GPU is present, else cpu)")
    models.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="run the target's decoding steps compiled (torch.compile; the first use of each shape "
                             "compiles, about a minute on a small CPU, then the compiled code is cached) (default: "
                             "off for generate and calibrate, whose one answer cannot repay a compilation; for "
                             "serve and bench, on where `fuzzyspec tune` measured compiled steps faster)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fuzzyspec", description="Fuzzy speculative decoding for Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"fuzzyspec {__version__}")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="what fuzzyspec logs on stderr (default: warning)")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate text for a prompt",
                              description=f"Generate text for a prompt; {JOB_HELP}.")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt (a user message when --chat); - reads it from standard input")
    gen.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE (UTF-8)")
    _add_models(gen)
    groups = add_options(gen)
    groups["decoding"].add_argument(
        "--target-acceptance", type=float, default=None, metavar="A",
        help="instead of --threshold: calibrate T so that a fraction A of drafts is accepted (on held-out "
             "ShareGPT prompts; remembered in the cache); implies --method fsd unless one is given")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat = gen.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt in the chat template (default)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    cal = commands.add_parser("calibrate", help="print the threshold that yields a requested acceptance rate")
    _add_models(cal)
    groups = add_options(cal, shown=CALIBRATE_DEFAULTS, skip=("method", "divergence", "threshold"))
    groups["decoding"].add_argument("--method", default="fsd", choices=FUZZY, help="the fuzzy rule (default: fsd)")
    groups["decoding"].add_argument("--divergences", type=_names, default=_names(CALIBRATED_DIVERGENCES),
                                    help=f"comma-separated divergences (default: {CALIBRATED_DIVERGENCES})")
    wanted = cal.add_mutually_exclusive_group(required=True)
    wanted.add_argument("--acceptance", type=float, help="the fraction of drafted tokens to accept, in (0, 1)")
    wanted.add_argument("--mean-accepted", type=float, help="the tokens per target pass to reach, in (1, gamma + 1)")
    cal.add_argument("--task", default="freeform", help="whose prompts to sample (default: freeform, held-out "
                                                        "ShareGPT); any bench task or a task file")
    cal.add_argument("--data", default=None, help="the task's JSONL file (free-form: rows with 'prompt')")
    cal.add_argument("--prompts", type=int, default=16, help="prompts in the sample (default: 16)")
    cal.add_argument("--json", action="store_true", help="print one JSON object per divergence")

    bench = commands.add_parser("bench", help="sweep drafters, rules, divergences and thresholds on a task: "
                                              "CSV, JSON, PNG")
    what = bench.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", help="humaneval, gsm8k, csqa, freeform, or a .py file defining a Task")
    what.add_argument("--merge", action="store_true",
                      help="decode nothing: write the results of the sweep in --out from every worker's examples "
                           "(after workers that finished on different machines, or one that stopped)")
    bench.add_argument("--data", default=None, help="the task's local JSONL file (default: the task's own source)")
    bench.add_argument("--limit", type=int, default=None, help="only the first N examples")
    bench.add_argument("--out", required=True, help="the sweep folder (a sweep there is resumed)")
    bench.add_argument("--worker", default=None, metavar="I/N",
                       help="decode only the examples with index %% N == I of every row, into files of this "
                            "worker's own, so that N processes sharing --out split the sweep (default: 0/1, or "
                            "RANK/WORLD_SIZE under torchrun without --tp)")
    bench.add_argument("--tp", action="store_true",
                       help="under torchrun: shard the target over the ranks, which then decode as one worker "
                            "(rank 0 writes --out); without it the ranks are workers, each with a whole target")
    _add_models(bench, draft=False)
    grid = bench.add_argument_group("sweep")
    grid.add_argument("--drafts", type=_names, default=None,
                      help="comma-separated: ar and drafters as --draft names them ('default', 'eagle', eagle:DIR, "
                           "lookup, self:N, a model); append +tree for EAGLE-2 trees, e.g. eagle+tree "
                           "(default: ar,default)")
    grid.add_argument("--methods", type=_names, default=None, help=argparse.SUPPRESS)  # the old name of --drafts
    grid.add_argument("--rules", type=_names, default=["sd", "fsd"],
                      help="comma-separated rules (--method values): sd, fsd, fsd-hybrid (default: sd,fsd)")
    grid.add_argument("--divergences", type=_names, default=["js"], help="comma-separated (default: js)")
    values = grid.add_mutually_exclusive_group()
    values.add_argument("--thresholds", type=_floats, default=None, help="comma-separated T values")
    values.add_argument("--target-acceptance", type=_floats, default=None,
                        help="comma-separated acceptance rates; T is calibrated for each (default: "
                             f"{BENCH_ACCEPTANCE} when no --thresholds)")
    grid.add_argument("--calibration-prompts", type=int, default=None,
                      help="examples used to calibrate T (default: 8)")
    add_options(bench, shown=BENCH_DEFAULTS, skip=("method", "divergence", "threshold", "tree"))
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--allow-code-execution", action="store_true",
                       help="let code tasks (humaneval) run the model's code to score it; isolated where the kernel "
                            "allows (see the README)")

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with batched FSD")
    _add_models(serve)
    serve.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1; 0.0.0.0 to listen on all)")
    serve.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    serve.add_argument("--model-name", default=None,
                       help="the model id clients send (default: the --target name, or smollm2-135m-instruct)")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request on stderr")
    add_options(serve, shown=SERVE_DEFAULTS)
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-batch", type=int, default=16, help="rows decoded together (default: 16)")
    limits.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting for a row; more get HTTP 429 (default: 64)")
    limits.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take, queueing included; then HTTP 504 (default: 300)")
    limits.add_argument("--max-body-bytes", type=int, default=1_000_000,
                        help="largest request body accepted; larger ones get HTTP 413 (default: 1000000)")

    tune = commands.add_parser("tune", help="measure what this machine charges for the target's steps and the "
                               "cost of each draft size to a step, and print the draft sizes that follow")
    _add_models(tune)
    tune.add_argument("--widths", type=_int_list, default=None,
                      help="target widths to measure (default: 1,2,3,4,5,6,8,12,17,24,32; compiled: 1,2,4,6,8,17)")
    tune.add_argument("--json", action="store_true", help="print one JSON object")

    lm_eval = commands.add_parser(
        "lm-eval", add_help=False, help="lm-evaluation-harness with the fuzzyspec model registered (all "
        "arguments go to lm-eval: fuzzyspec lm-eval run --model fuzzyspec --model_args method=sd --tasks ...)")
    lm_eval.add_argument("arguments", nargs=argparse.REMAINDER)

    train = commands.add_parser("train", help="train a drafter for a target, or make its training data")
    kinds = train.add_subparsers(dest="kind", required=True, parser_class=_Parser, metavar="KIND")
    helps = {"eagle3": "an EAGLE-3 head (fused features, reduced vocabulary, training-time test)",
             "eagle": "an EAGLE-1/2 head (feature regression)",
             "draft": "a small draft LM sharing the target's embedding and LM head",
             "data": "the target's own answers to training prompts (self-distillation data)"}
    for kind in ("eagle3", "eagle", "draft", "data"):
        sub = kinds.add_parser(kind, help=helps[kind], description=helps[kind])
        sub.add_argument("--out", required=True, help="output folder (a run there is resumed)")
        sub.add_argument("--target", default=None, help="HF id, folder or .gguf file (default: embedded)")
        sub.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present, else cpu)")
        sub.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                         help="the target's dtype (trained weights stay float32)")
        if kind == "data":
            _add_answer_flags(sub)
        else:
            _add_training_flags(sub, kind)
    return parser


TRAINING_FLAGS = {  # TrainConfig field -> (type, help, kinds it applies to; None: all)
    "data": (str, "'sharegpt', a folder from `fuzzyspec train data`, or a TokenDataset .npz", None),
    "eval_data": (str, "held-out data, the same choices", None),
    "max_tokens": (int, "cut sequences to this many tokens", None),
    "limit": (int, "use only the first N training sequences", None),
    "batch_size": (int, "sequences per step", None), "lr": (float, "peak learning rate", None),
    "warmup_steps": (int, "linear warm-up steps", None), "epochs": (float, "passes over the data", None),
    "budget_minutes": (float, "stop (saving everything) after this much wall time", None),
    "seed": (int, "random seed", None), "init": (str, "start from this saved drafter of the same kind", None),
    "eval_sequences": (int, "held-out sequences to evaluate", None),
    "draft_vocab": (int, "size N of the reduced draft vocabulary (the target's N most frequent output tokens; at "
                         "least its vocabulary size: no reduction)", ("eagle3", "draft")),
    "loss": (str, "distillation loss: ce, tv or js", ("eagle3", "draft")),
    "layers": (int, "decoder layers", ("draft",)),
    "ttt_steps": (int, "draft steps unrolled in training (training-time test)", ("eagle3",)),
    "ttt_decay": (float, "weight of unrolled step s is this to the power s", ("eagle3",)),
    "train_lm_head": (bool, "train and store the head's own LM head (default: the target's rows, not stored)",
                      ("eagle3",)),
    "feature_layers": (_int_list, "comma-separated target hidden-state indices to fuse (default: 2, L/2, L-3)",
                       ("eagle3",)),
    "noise": (float, "feature noise", ("eagle",)), "regression_weight": (float, "weight of the feature loss", ("eagle",)),
    "ce_weight": (float, "weight of the token loss", ("eagle",)),
}


def _add_training_flags(parser: argparse.ArgumentParser, kind: str) -> None:
    from .train.config import DEFAULT_DRAFT_VOCAB, TrainConfig

    defaults = TrainConfig(kind=kind, out="")
    for field, (kind_of, help_text, kinds) in TRAINING_FLAGS.items():
        if kinds is not None and kind not in kinds:
            continue
        default = getattr(defaults, field)
        if kind_of is bool:
            parser.add_argument(flag(field), action="store_true", help=help_text)
            continue
        if field == "draft_vocab":
            help_text += f" (default: {DEFAULT_DRAFT_VOCAB})"
        elif default is not None:
            help_text += f" (default: {default})"
        parser.add_argument(flag(field), type=kind_of, default=default, help=help_text)


def _add_answer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="sharegpt",
                        help="'sharegpt' (first user messages of its training split) or a JSONL file of "
                             "prompt/messages rows (default: sharegpt)")
    parser.add_argument("--split", default="train", choices=["train", "held_out"],
                        help="ShareGPT split to take prompts from (default: train)")
    parser.add_argument("--limit", type=int, default=None, help="answer only the first N prompts")
    parser.add_argument("--temperatures", type=_floats, default=[0.0, 0.8],
                        help="one answer per prompt at each temperature, 0 for greedy (default: 0,0.8)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer (default: 256)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (default: 256)")
    parser.add_argument("--shard-size", type=int, default=512, help="prompts per output file (default: 512)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows decoded together (default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--worker", default=None, metavar="I/N",
                        help="this process answers shards s with s %% n == i, so n processes share the work "
                             "(default: torchrun's RANK/WORLD_SIZE, else 0/1)")


def _device(args: argparse.Namespace) -> str:
    """The --device asked for, or the best one present; one that is absent or unknown is a usage error."""
    import re

    import torch

    if args.device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        return args.device
    if not re.fullmatch(r"cuda(:\d+)?|auto", args.device):
        raise UsageError(f"--device {args.device}: unknown; valid: cpu, cuda, cuda:N, auto")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: this torch build sees no CUDA GPU (torch {torch.__version__}); "
                         "use --device cpu")
    index = args.device.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA GPUs")
    return args.device


def _decided(options: dict, draft: str | None, target_acceptance: float | None = None):
    """The request these options make with this drafter (by name), decided and checked before any model
    loads, as every interface decides it; errors name the flag."""
    from .core.config import DecodeConfig
    from .drafters.registry import describe

    drafter = describe(draft) if draft is not None else None
    return DecodeConfig.from_options(options, drafter=drafter, target_acceptance=target_acceptance)


def _build_kernels_soon(args: argparse.Namespace, device: str) -> None:
    """Start building (or loading) the CPU kernels where the target will likely need them, before the imports that
    deciding the job and loading the model take (3-5 s): on a machine's first use their build (about 8 s on 2 cores)
    was the longest wait of a first answer."""
    from .core import kernels, parallel
    from .loading import int4_likely

    if int4_likely(args.target, args.dtype, device, args.weights, parallel.launched()):
        kernels.build_soon()


def _load_pair(args: argparse.Namespace, draft: str | None, device: str, long_running: bool):
    """The target (in its weights form, compiled or not) and the drafter, with progress while it compiles."""
    from .api import ModelPair

    from .core import parallel

    tp = parallel.launched()
    if tp and args.command not in ("generate", "serve"):
        raise UsageError(f"under torchrun only `generate`, `serve` and `bench --tp` shard the target; "
                         f"`{args.command}` does not")
    compile = _compiles(args, device, long_running, sharded=tp)
    if compile:
        _persist_compiled_code()
    pair = ModelPair.load(args.target, draft, args.dtype, device, args.weights, compile, tp=tp)
    pair.step.on_compile = lambda rows, width: print(
        f"fuzzyspec: compiling the target's step for {rows} row{'s' if rows > 1 else ''} x {width} "
        f"token{'s' if width > 1 else ''} (seconds to a minute, once: it is kept on this machine for later runs) ...",
        file=sys.stderr, flush=True)
    if compile and pair.draft is not None and pair.draft.prepare is not None:  # (an EAGLE head's own steps)
        from .core.kvcache import HEAD_CAPACITY

        pair.draft.prepare(HEAD_CAPACITY, on_compile=lambda: print(
            "fuzzyspec: compiling the drafter's step (seconds, once: it is kept on this machine for later runs) ...",
            file=sys.stderr, flush=True))
    _started()
    return pair


def _started() -> None:
    """Start-up is over: in the command's own process (``run``), the garbage collector, held off until now, starts,
    and what start-up made (the imports' modules, classes and functions, the loaded models: some 400,000 objects
    that live as long as the process) is frozen out of its scans. Called where a command has loaded what it needs."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _compiles(args: argparse.Namespace, device: str, long_running: bool, sharded: bool = False) -> bool:
    """--compile as given; else compiled only for long-running commands of an unsharded target, where
    `fuzzyspec tune` measured compiled steps faster on this machine (a one-shot answer cannot repay a
    compilation, and a sharded target's steps do not compile yet)."""
    if args.compile is not None or not long_running or sharded:
        return bool(args.compile)
    from . import tuning

    return bool(tuning.facts(tuning.profile_key(args.target, args.weights, args.dtype, device, True))
                .get("compile_pays"))


def _persist_compiled_code() -> None:
    """Keep inductor's compiled code in the fuzzyspec cache (unless TORCHINDUCTOR_CACHE_DIR names a folder), so a
    shape compiles once per machine: in a folder per kind of CPU (its instruction sets, and those torch's kernels
    use), since inductor's cache reused across them runs code built for the other. A cache filled with
    ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine, then used without it, gave a compiled 4-bit step garbage logits
    (max difference from eager 2482, 1e-5 on a cache of its own) or a "double free or corruption" crash
    (2026-11-26); a network home folder shared by two machines would."""
    import platform

    import torch

    from .loading import cache_dir, cpu_isa

    cpu = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}-{cpu_isa()}".lower().replace(",", "-")
    # Importing torch._dynamo (transformers does) sets TORCHINDUCTOR_CACHE_DIR to inductor's default folder, so a
    # value equal to that default is not the user's choice (with ``setdefault`` alone, no compiled code was ever kept
    # here: it went to inductor's default folder).
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        default = default_cache_dir()
    except ImportError:  # (another torch: only an unset variable is ours to set)
        default = None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor" / cpu)


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt: the argument, standard input (``-``) or ``--prompt-file``; checked to be UTF-8 text."""
    from .text import check_prompt

    if args.prompt_file is not None and args.prompt is not None:
        raise UsageError("give the prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_bytes().decode("utf-8")
        except OSError as error:
            raise UsageError(f"--prompt-file {args.prompt_file}: {error.strerror or error}") from None
        except UnicodeDecodeError as error:
            raise UsageError(f"--prompt-file {args.prompt_file} is not UTF-8 text (byte {error.start})") from None
    elif args.prompt == "-":
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError(f"standard input is not UTF-8 text (byte {error.start})") from None
    elif args.prompt is None:
        raise UsageError("a prompt is required: PROMPT, - for standard input, or --prompt-file FILE")
    else:
        prompt = args.prompt
    check_prompt(prompt)
    return prompt


def _calibrated_threshold(pair, config, target: str | None, draft: str, acceptance: float) -> float:
    """T for ``generate --target-acceptance``, calibrated once per setting and then read from the cache."""
    from .eval.calibrate import cached_calibration

    found = cached_calibration(pair, config, acceptance, {"target": str(target), "draft": str(draft)})
    print(f"[calibrated] {config.divergence} T={found['threshold']:.4g}: acceptance {found['acceptance']:.3f} "
          f"on {found['prompts']} held-out prompts (asked {acceptance})", file=sys.stderr)
    return found["threshold"]


def _generate(args: argparse.Namespace) -> None:
    import dataclasses

    prompt = _read_prompt(args)
    options = given_options(args)
    draft = None if options.get("method") == "ar" else args.draft
    device = _device(args)
    _build_kernels_soon(args, device)
    config = _decided(options, draft, args.target_acceptance)
    pair = _load_pair(args, draft, device, long_running=False)
    _check_context(pair, prompt, args.chat, config.max_new_tokens)
    config = dataclasses.replace(config, eos_token_ids=pair.eos_token_ids)
    if args.target_acceptance is not None:
        threshold = _calibrated_threshold(pair, config, args.target, args.draft, args.target_acceptance)
        config = dataclasses.replace(config, threshold=threshold)

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = pair.generate(prompt, chat=args.chat, stop=args.stop, on_text=None if args.json else show,
                           config=config)
    stats = result.stats
    if args.json:
        print(json.dumps({"text": result.text, **config.describe(), "draft": draft,
                          "finish_reason": result.finish_reason, "stats": stats.to_dict()}))
        return
    print()
    rate = "-" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.2f}"
    print(f"[{config.method}] {stats.new_tokens} tokens in {stats.wall_s:.2f} s ({stats.tokens_per_s:.1f} tokens/s), "
          f"{stats.mean_accepted or 0:.2f} tokens per target pass, acceptance {rate}", file=sys.stderr)


def _check_context(pair, prompt: str, chat: bool, max_new_tokens: int) -> None:
    """Refuse a prompt that leaves no room in the target's context, before any decoding."""
    context = getattr(pair.target.config, "max_position_embeddings", None)
    length = pair.encode(prompt, chat).shape[1]
    if context and length >= context:
        raise UsageError(f"the prompt is {length} tokens; the target's context holds {context}")
    if context and length + max_new_tokens > context:
        log.warning("the prompt (%d tokens) and --max-new-tokens %d exceed the context of %d tokens: generation "
                    "stops at the context's end", length, max_new_tokens, context)


def _calibrate(args: argparse.Namespace) -> None:
    import dataclasses

    from .eval.calibrate import calibrate_pair, check_request

    objective, value = ("acceptance", args.acceptance) if args.acceptance is not None else \
        ("mean_accepted", args.mean_accepted)
    if args.prompts < 1:
        raise UsageError(f"--prompts must be >= 1, got {args.prompts}")
    options = given_options(args, CALIBRATE_DEFAULTS) | {"method": args.method, "threshold": 0.0}
    configs = {name: _decided(options | {"divergence": name}, args.draft) for name in args.divergences}
    check_request(objective, value, next(iter(configs.values())).gamma)
    device = _device(args)
    from .eval.tasks import get_task

    prompts = [e.prompt for e in get_task(args.task, args.data).examples(args.prompts)]
    pair = _load_pair(args, args.draft, device, long_running=False)
    if not args.json:
        print(f"{'divergence':<16} {'T':>10} {'acceptance':>10} {'tok/pass':>9} {'D q10':>8} {'D q50':>8} "
              f"{'D q90':>8} {'runs':>4}")
    for name, config in configs.items():
        config = dataclasses.replace(config, eos_token_ids=pair.eos_token_ids)
        result = calibrate_pair(pair, config, objective, value, prompts, progress=not args.json)
        if args.json:
            print(json.dumps(result.to_dict() | {"prompts": len(prompts)}))
            continue
        q = result.quantiles
        note = "" if result.converged else "  (not converged: acceptance jumps with T here; use more --prompts)"
        print(f"{name:<16} {result.threshold:>10.4g} {result.acceptance:>10.3f} {result.mean_accepted:>9.2f} "
              f"{q.get('q10', 0):>8.3g} {q.get('q50', 0):>8.3g} {q.get('q90', 0):>8.3g} {result.runs:>4}{note}",
              flush=True)


def _worker(args: argparse.Namespace) -> tuple[int, int]:
    """This process's share of the work (a sweep, answers to write), (i, n): --worker, else torchrun's RANK
    and WORLD_SIZE (unless its ranks share one sharded target, ``bench --tp``), else all of it."""
    if args.worker is not None:
        text, name = args.worker, "--worker"
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and not getattr(args, "tp", False):
        text, name = f"{os.environ['RANK']}/{os.environ['WORLD_SIZE']}", "RANK/WORLD_SIZE (torchrun's)"
    else:
        return 0, 1
    index, _, count = text.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        raise UsageError(f"{name} must be i/n (worker i of n), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"{name} must be i/n with 0 <= i < n, got {text!r}")
    return index, count


def _bench(args: argparse.Namespace) -> None:
    _started()  # (its start-up is not one load: the collector runs from here)
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("bench needs the [bench] extra: pip install 'fuzzyspec[bench]' (matplotlib is missing)")
    from .eval.bench import SETTINGS_FILE, TREE_SUFFIX, Settings, Sweep, plan
    from .eval.calibrate import CALIBRATION_PROMPTS

    out = Path(args.out)
    if args.merge:
        if not (out / SETTINGS_FILE).is_file():
            raise UsageError(f"--out {args.out}: not a sweep folder (it has no {SETTINGS_FILE})")
        sweep = Sweep.from_folder(out)
        _print_rows(sweep.merge(), sweep.task.metric, out)
        return
    from .core import parallel

    if args.tp and not parallel.launched():
        raise UsageError("--tp shards the target over the ranks of a torchrun launch: run it under "
                         "torchrun --nproc-per-node N (or without --tp)")
    if args.tp and args.compile:
        raise UsageError("compiled steps of a tensor-parallel target are not supported yet: use --no-compile")
    worker = _worker(args)
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.methods is not None:
        print("fuzzyspec: bench --methods is now --drafts (what proposes; --method names the rule elsewhere)",
              file=sys.stderr)
    drafts = args.drafts or args.methods or ["ar", DEFAULT_DRAFT]
    acceptances = args.target_acceptance
    if args.thresholds is None and acceptances is None:
        acceptances = _floats(BENCH_ACCEPTANCE)
    decoding = given_options(args, BENCH_DEFAULTS)
    specs = plan(drafts, args.rules, args.divergences, args.thresholds or [], acceptances or [])
    for spec in specs:  # every row's request, checked before anything loads
        row = decoding | {"method": spec.rule} | ({"tree": True} if spec.draft.endswith(TREE_SUFFIX) else {})
        if spec.rule in FUZZY:
            row |= {"divergence": spec.divergence, "threshold": spec.threshold or 0.0}
        _decided(row, None if spec.draft == "ar" else spec.draft.removesuffix(TREE_SUFFIX))
    for value in acceptances or ():
        check_acceptance(value)
    from .eval.execution import ALLOW_VARIABLE
    from .eval.tasks import CODE_REFUSAL, get_task

    if args.allow_code_execution:
        os.environ[ALLOW_VARIABLE] = "1"  # the one switch, read where the code runs
    task = get_task(args.task, args.data)
    if task.runs_code and not getattr(task, "allowed", False):
        raise UsageError(CODE_REFUSAL)
    device = _device(args)
    if device == "cuda" and "LOCAL_RANK" in os.environ and not args.tp:  # torchrun's workers: a GPU each
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    settings = Settings(task=args.task, data=args.data, limit=args.limit, target=args.target, dtype=args.dtype,
                        device=device, weights=args.weights,
                        compile=_compiles(args, device, long_running=True, sharded=args.tp),
                        decoding=decoding,
                        calibration_prompts=args.calibration_prompts or CALIBRATION_PROMPTS)
    if not args.tp or parallel.rank() == 0:  # rank 0 alone writes a sharded target's sweep
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / ".write-test").touch()
            (out / ".write-test").unlink()
        except OSError as error:
            raise UsageError(f"--out {args.out}: cannot write there ({error.strerror or error})") from None
    sweep = Sweep(settings, out, progress=not args.quiet, worker=worker, sharded=args.tp)
    rows = sweep.run(specs)
    if sweep.leads:
        _print_rows(rows, sweep.task.metric, out)


def _print_rows(rows: list[dict], metric: str, out: Path) -> None:
    """The sweep's finished rows as a table on stdout; where their files are on stderr."""
    print(f"{'configuration':<36} {metric:>8} {'tok/s':>7} {'tok/pass':>8} {'accept':>7}")
    for row in rows:
        value = "-" if row.get(metric) is None else f"{row[metric]:.3f}"
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        threshold = "" if row["threshold"] is None else f" T={row['threshold']:.3g}"
        name = f"{row['draft']} {row['rule']}" + (f" {row['divergence']}{threshold}" if row["divergence"] else "")
        print(f"{name:<36} {value:>8} {row['tokens_per_s']:>7.1f} {row['mean_accepted']:>8.2f} {rate:>7}")
    print(f"results: {out / 'results.csv'}, {out / 'results.json'}, {out / 'curve.png'}", file=sys.stderr)


def _train(args: argparse.Namespace) -> None:
    _started()  # (its start-up is not one load: the collector runs from here)
    import dataclasses

    if args.kind == "data":
        _answers(args)
        return
    from .train.config import TrainConfig
    from .train.loop import train

    args.device = _device(args)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    metrics = train(config)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}))


def _answers(args: argparse.Namespace) -> None:
    from .api import eos_ids
    from .loading import load_model
    from .train.selfdistill import AnswerSettings, encode_prompts, generate_answers, training_prompts

    index, count = _worker(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    settings = AnswerSettings(tuple(args.temperatures), args.max_new_tokens, args.max_prompt_tokens,
                              args.shard_size, args.seed)
    texts = training_prompts(args.prompts, args.limit, args.split)
    target, tokenizer = load_model(args.target, args.dtype, _device(args), weights=None)
    prompts = encode_prompts(tokenizer, texts, settings.max_prompt_tokens)
    written = generate_answers(target, prompts, args.out, settings, eos_ids(target, tokenizer), args.batch_size,
                               (index, count))
    print(json.dumps({"prompts": len(prompts), "skipped_long_prompts": len(texts) - len(prompts),
                      "answers_written": written, "out": args.out}))


def _serve(args: argparse.Namespace) -> None:
    for name, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if args.request_timeout <= 0:
        raise UsageError(f"--request-timeout must be > 0, got {args.request_timeout}")
    defaults = given_options(args, SERVE_DEFAULTS)
    draft = None if defaults.get("method") == "ar" and args.draft == DEFAULT_DRAFT else args.draft
    _decided(defaults, draft)  # the server's own defaults must make a valid request
    try:
        import uvicorn

        from .serve.app import ServeConfig, Server, create_app
    except ImportError as error:
        raise UsageError(f"serving needs the [serve] extra: pip install 'fuzzyspec[serve]' ({error.name} is "
                         "missing)") from None
    device = _device(args)
    from .loading import EMBEDDED

    pair = _load_pair(args, draft, device, long_running=True)
    config = ServeConfig(model_name=args.model_name or args.target or EMBEDDED, defaults=defaults,
                         max_batch=args.max_batch, max_queue=args.max_queue, request_timeout=args.request_timeout,
                         max_body_bytes=args.max_body_bytes, names=(("target", str(args.target)), ("draft", str(draft))))
    server = Server(pair, config)
    from .core import parallel

    if pair.step.shards > 1 and parallel.rank() != 0:  # rank 0 serves; this rank steps along with it
        server.scheduler.follow()
        return
    if pair.step.compile:
        server.warm_up()
    app = create_app(server)
    print(f"fuzzyspec: serving {config.model_name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                         access_log=args.access_log))
    server.scheduler.on_failure = lambda: setattr(http, "should_exit", True)
    http.run()
    if server.scheduler.failure is not None:  # a rank of a sharded target was lost: the server stopped
        raise server.scheduler.failure


def _lm_eval(args: argparse.Namespace) -> None:
    _started()  # (its start-up is not one load: the collector runs from here)
    try:
        from .eval.lmeval import run_cli
    except ImportError as error:
        raise UsageError(f"lm-eval needs the [lmeval] extra: pip install 'fuzzyspec[lmeval]' ({error.name} is "
                         "missing)") from None
    run_cli(args.arguments)


def _tune(args: argparse.Namespace) -> None:
    """Measure the profile (eager, and compiled unless --no-compile), keep it, and print it with its choices."""
    from . import tuning
    from .api import ModelPair
    from .core.step import TargetStep

    device = _device(args)
    drafter = _decided({}, args.draft)  # checks the options and the drafter's name before anything loads
    loaded = _load_pair(argparse.Namespace(**{**vars(args), "compile": False}), args.draft, device, False)
    report: dict = {"machine": tuning.machine(device), "profiles": {}}
    for compiled in ([False, True] if args.compile is None else [args.compile]):
        if compiled:
            _persist_compiled_code()
        key = tuning.profile_key(args.target, args.weights, args.dtype, device, compiled)
        step = TargetStep(loaded.target, compile=compiled)
        step.on_compile, step.profile = loaded.step.on_compile, tuning.load(key)
        pair = ModelPair(loaded.target, loaded.tokenizer, loaded.draft, step, key)
        widths = tuple(args.widths or ((1, 2, 4, 6, 8, 17) if compiled else tuning.WIDTHS))
        measured = tuning.measure(pair, drafter, widths, progress=tuning.progress_line)
        tuning.save(key, step.profile)
        options = tuning.options_of(pair, drafter)
        expected = tuning.outlook(step.profile, options)
        found = report["profiles"]["compiled" if compiled else "eager"] = {
            "key": key, **measured,
            "choices": {name: {rate: shape for rate, (shape, _) in picks.items()} for name, picks in expected.items()},
            "speedup": {name: {rate: x for rate, (_, x) in picks.items()} for name, picks in expected.items()}}
        if options:  # (the planner's view of this drafter: from what acceptance it drafts, and what decoding met)
            found["chain_pays_from"] = tuning.pays_from(step.profile, options["chains"])
            found["acceptance_met"] = tuning.acceptance_met(step.profile, pair.draft.name, options)
    from .loading import auto_may_hold_int4

    if args.weights == "auto" and auto_may_hold_int4(args.target, args.dtype, device) and "eager" in report["profiles"]:
        report["weights"] = _compare_weights(args, device, report["profiles"]["eager"]["target_ms"])
    if len(report["profiles"]) == 2:
        eager, compiled = (report["profiles"][mode]["target_ms"][1] for mode in ("eager", "compiled"))
        report["compile_pays"] = compiled < 0.9 * eager
        tuning.note(report["profiles"]["compiled"]["key"], compile_pays=report["compile_pays"], eager_ms=eager,
                    compiled_ms=compiled)
    if args.json:
        print(json.dumps(report))
        return
    print(f"machine: {report['machine']}")
    for mode, profile in report["profiles"].items():
        one = profile["target_ms"][min(profile["target_ms"])]
        print(f"\n{mode}: target step, ms by width (and x width 1)" + ("; first call, s" if profile["compile_s"] else ""))
        for width, ms in profile["target_ms"].items():
            first = f"  {profile['compile_s'][width]:6.1f}" if width in profile["compile_s"] else ""
            print(f"  {width:>3}  {ms:8.1f}  x{ms / one:.2f}{first}")
        for key, sizes in profile["draft_ms"].items():
            print(f"  {key}: " + ", ".join(f"{size}: {ms:.1f} ms" for size, ms in sizes.items()))
        for name, picked in profile["choices"].items():
            print(f"  {name}: drafted (depth x breadth, the planner's x AR) at a chain's first-draft acceptance " +
                  ", ".join(f"{rate:g} -> {depth}x{breadth}, x{profile['speedup'][name][rate]:.2f}"
                            for rate, (depth, breadth) in picked.items()))
        if "chain_pays_from" in profile:
            pays_from = profile["chain_pays_from"]
            print("  a chain pays " + (f"from a first-draft acceptance of {pays_from:g}" if pays_from is not None
                                       else "at no first-draft acceptance") + " by these costs")
        for rule, met in profile.get("acceptance_met", {}).items():
            print(f"  met in decoding here ({rule}): first drafts passed {met['first_draft']:.2f}; a new row drafts " +
                  ", ".join(f"{name} {depth}x{breadth}, x{speed:.2f}"
                            for name, ((depth, breadth), speed) in met["picks"].items()))
    if "weights" in report:
        ms = report["weights"]["step_ms"]
        print("\nweights: one step " + ", ".join(f"{form} {value:.1f} ms" for form, value in ms.items()) +
              f": --weights auto holds {report['weights']['fastest']}")
    if "compile_pays" in report:
        print(f"\ncompiled steps {'pay' if report['compile_pays'] else 'do not pay'} here: serve and bench "
              f"{'compile' if report['compile_pays'] else 'stay eager'} by default")


def _compare_weights(args: argparse.Namespace, device: str, measured_ms: dict[int, float]) -> dict:
    """Time one eager step of the GGUF target in the other weights form (int4, or dequantized to its float
    dtype) beside the step just measured in the form ``--weights auto`` holds now, and note the faster form,
    which auto then holds on this machine (so a later tune measures both again, whichever auto holds)."""
    from . import tuning
    from .core.step import TargetStep
    from .loading import FLOAT_WEIGHTS, load_model, resolve_dtype, weight_form

    # Asked of the loader itself (a profile key names the int4 form with its kernel's ISA, "int4 (avx2)": read
    # from there, int4 was taken for a float form, timed against itself, and noise could pin auto to floats).
    form = weight_form(args.target, "auto", args.dtype, device)

    width = min(measured_ms)
    dtype = str(resolve_dtype("auto", device)).removeprefix("torch.")
    float_form = next(name for name, float_dtype in FLOAT_WEIGHTS.items() if float_dtype == dtype)
    other = float_form if form == "int4" else "int4"
    tuning.progress_line(f"the same target with {other} weights, to compare")
    model, _ = load_model(args.target, "auto", device, weights=other)
    other_ms, _ = tuning.measure_target(TargetStep(model), (width,))
    int4_ms, float_ms = (measured_ms[width], other_ms[width]) if form == "int4" else (other_ms[width], measured_ms[width])
    fastest = "int4" if int4_ms <= float_ms else float_form
    tuning.note(tuning.weights_key(args.target, device), fastest_weights=fastest, int4_ms=int4_ms, float_ms=float_ms)
    return {"step_ms": {"int4": int4_ms, dtype: float_ms}, "fastest": fastest}


COMMANDS = {"generate": _generate, "calibrate": _calibrate, "bench": _bench, "serve": _serve, "train": _train,
            "lm-eval": _lm_eval, "tune": _tune}


def main(argv: Sequence[str] | None = None) -> int:
    return _main(argv)[0]


def _main(argv: Sequence[str] | None = None) -> tuple[int, str | None]:
    """``main``'s exit code, and the command it ran (None where the arguments named none)."""
    command = None
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        command = args.command
        if args.command is None:
            parser.print_usage(sys.stderr)
            raise UsageError("a command is required: generate, calibrate, bench, serve, tune, train or lm-eval "
                             "(fuzzyspec --help)")
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        if args.threads is not None:
            if args.threads < 1:
                raise UsageError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        from .core import parallel
        from .loading import quiet_transformers

        quiet_transformers()
        if parallel.launched() and parallel.rank() != 0:
            sys.stdout = open(os.devnull, "w")  # rank 0 alone prints; every rank still reports its errors
        COMMANDS[args.command](args)
    except UsageError as error:
        print(f"fuzzyspec: error: {error}", file=sys.stderr)
        return 2, command
    except OptionError as error:  # a decoding option, said as the user wrote it
        print(f"fuzzyspec: error: {error.spelled(flag(error.option))}", file=sys.stderr)
        return 2, command
    except (ValueError, OSError) as error:  # LoadError is a ValueError; every message is meant for the user
        log.debug("failed", exc_info=True)
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"fuzzyspec: error: {text}", file=sys.stderr)
        return 2, command
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130, command
    except RuntimeError as error:  # a peer of a tensor-parallel launch died or went silent: one line, every rank
        from .core import parallel

        if not parallel.launched():
            raise
        log.debug("failed", exc_info=True)
        print(f"fuzzyspec: error (rank {parallel.rank()}): {parallel.describe(error)}", file=sys.stderr)
        return 1, command
    return 0, command


def run() -> None:
    """The console script and ``python -m fuzzyspec``: ``main`` in a process of its own.

    Python's cyclic garbage collector scans every object it tracks, again and again as objects are made. Start-up
    (torch, transformers, the models) makes some 400,000 that live as long as the process, and those scans took 0.7
    s of a 4 s ``generate``, so the collector waits until the command has loaded what it needs (``_started``). At
    exit everything is frozen: the interpreter's own last collections scanned it all once more, another 0.7 s."""
    gc.disable()
    code, command = _main()
    gc.freeze()
    if command == "generate" and code == 0:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """End an answered ``generate`` at once: what Python's own exit does that anyone relies on is done first (the other
    threads joined, as a kernel build started for nothing finishes; the exit handlers run, which flush the logs and
    call ``weakref.finalize``'s callbacks), then the process ends without tearing the interpreter down. That tear-down
    (clearing every module, freeing the models' objects one by one) took 0.15 s of a 3.2 s main command on a 2-core
    AVX2 EPYC, after the answer was out; every file this command writes is closed when written. Only where the
    interpreter offers its exit handlers to be run (CPython's ``atexit._run_exitfuncs``)."""
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_handlers is None:
        return
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a reader that went away: as Python's own exit, nothing more to say)
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
