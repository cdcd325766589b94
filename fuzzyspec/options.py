"""Decoding options, declared once: name, default, help, and the name each interface gives them.

``DecodeConfig`` (and ``Sampling`` inside it) hold the values; this table says how they are
spelled on the command line (``--name-with-dashes``), in a server request (``request``), and
in the transformers hook (``fsd_<name>``, where ``hook``). The CLI's generate, calibrate, bench
and serve commands, the server and the hook all build their options from it. Nothing here
imports torch, so ``fuzzyspec --help`` stays fast.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

LOSSES = ("ce", "tv", "js")  # distillation losses (see objectives)

METHODS = ("ar", "sd", "fsd", "fsd-hybrid")
SCHEDULES = ("constant", "heuristic")
FUZZY = ("fsd", "fsd-hybrid")
DIVERGENCE_HELP = ("js, js_legacy, kl_pq, kl_qp, tv, hellinger, or their topk_*/topp_* forms; the FSD reference "
                   "code's names (js_div, kl_div, ...) are aliases")

# What `fuzzyspec generate PROMPT` runs when no option says otherwise (the README says why): the drafter
# by name, and the decoding options that differ from DecodeConfig's defaults.
DEFAULT_JOB: dict[str, Any] = {"draft": "eagle", "method": "sd", "tree": True}


@dataclass(frozen=True)
class Option:
    name: str               # the field of DecodeConfig or Sampling
    default: Any
    help: str
    request: str | None     # the server's request field; None: set for the whole server only
    hook: bool = True       # the transformers hook takes it as fsd_<name> (else from HF's generation config)
    choices: tuple[str, ...] | None = None
    group: str = "decoding"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("method", "fsd", "how drafts are accepted: ar (no drafts), sd (exact), fsd, fsd-hybrid", "method",
           choices=METHODS),
    Option("divergence", "js", f"D of the fuzzy rules: {DIVERGENCE_HELP}", "fsd_divergence"),
    Option("threshold", 0.3, "T of the fuzzy rules (inf: accept every draft)", "fsd_threshold"),
    Option("gamma", 5, "drafted tokens per step (the start value under the heuristic schedule)", "gamma"),
    Option("gamma_schedule", "constant", "constant, or heuristic: +2 after a fully accepted step, -1 otherwise",
           "gamma_schedule", choices=SCHEDULES),
    Option("draft_confidence", 0.0, "stop drafting when the draft's top probability falls below this",
           "draft_confidence"),
    Option("greedy_drafts", False, "draft the draft's most likely tokens even when sampling, as the FSD reference "
           "code did (sd stays exact: a drafted argmax is a point mass)", "greedy_drafts"),
    Option("raw_divergence", False, "compute D on unprocessed distributions, as the FSD reference code did", None),
    Option("divergence_top_k", 50, "k of the topk_* divergences", None),
    Option("divergence_top_p", 0.9, "p of the topp_* divergences", None),
    Option("tree", False, "draft EAGLE-2 dynamic trees instead of chains (needs an EAGLE head as the drafter)",
           "tree", group="trees"),
    Option("tree_total_tokens", 16, "nodes kept per tree", "tree_total_tokens", group="trees"),
    Option("tree_depth", 5, "tree depth", "tree_depth", group="trees"),
    Option("tree_top_k", 4, "children per expanded node, and nodes expanded per level", "tree_top_k",
           group="trees"),
    Option("temperature", 0.0, "0 = greedy", "temperature", hook=False, group="sampling"),
    Option("top_k", 0, "0 = off", "top_k", hook=False, group="sampling"),
    Option("top_p", 1.0, "1 = off", "top_p", hook=False, group="sampling"),
    Option("seed", None, "random seed (none: a fresh one)", "seed", group="sampling"),
    Option("max_new_tokens", 128, "tokens to generate at most", "max_tokens", hook=False, group="sampling"),
)
BY_NAME = {option.name: option for option in OPTIONS}


def parse_threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"threshold must be a number, got {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"threshold must be >= 0 (inf allowed), got {text}")
    return value


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def value_parser(option: Option):
    """The function that reads a non-boolean option's value from text (raising ArgumentTypeError)."""
    if option.name == "threshold":
        return parse_threshold
    if isinstance(option.default, int) or option.name == "seed":
        return _parse_int
    return _parse_float if isinstance(option.default, float) else str


def add_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                  skip: tuple[str, ...] = ()) -> dict[str, argparse._ArgumentGroup]:
    """Add every option (but ``skip``) to ``parser``, defaults from the table overridden by ``defaults``."""
    defaults = defaults or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in OPTIONS:
        if option.name in skip:
            continue
        group = groups.setdefault(option.group, parser.add_argument_group(option.group))
        default = defaults.get(option.name, option.default)
        shown = "" if default is None else f" (default: {default})"
        if isinstance(option.default, bool):  # --tree and --no-tree: a default job may switch it on
            group.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=default, help=option.help)
            continue
        group.add_argument(option.flag, type=value_parser(option), default=default, choices=option.choices,
                           metavar=None if option.choices else option.name.upper(), help=option.help + shown)
    return groups


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options ``add_arguments`` added, as DecodeConfig keyword options."""
    return {option.name: getattr(args, option.name) for option in OPTIONS if hasattr(args, option.name)}


KINDS = ("eagle3", "eagle", "draft")
DEFAULT_DRAFT_VOCAB = 16384


@dataclass
class TrainConfig:
    """How a drafter is trained (see ``train``)."""

    kind: str  # "eagle3", "eagle" (EAGLE-1/2 layout) or "draft"
    out: str
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # the target's dtype; trained weights are kept in float32
    data: str = "sharegpt"  # or a folder from `fuzzyspec train data`, or a TokenDataset .npz
    eval_data: str = "sharegpt"  # held-out data, the same choices (ShareGPT's held-out split by default)
    max_tokens: int = 512  # sequences are cut to this many tokens
    limit: int | None = None  # use only the first N training sequences
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 50
    epochs: float = 1.0
    budget_minutes: float | None = None
    clip: float = 0.5
    seed: int = 0
    eval_sequences: int = 64
    checkpoint_minutes: float = 5.0
    init: str | None = None  # start from this saved drafter (same kind) instead of from scratch
    draft_vocab: int | None = None  # N; None: DEFAULT_DRAFT_VOCAB for eagle3 and draft, the whole for eagle
    loss: str = "ce"  # eagle3 and draft: ce, tv or js (see objectives)
    layers: int = 2  # draft LM: decoder layers, copied from the target's first ones
    ttt_steps: int = 6  # eagle3: unrolled draft steps per sequence ("training-time test")
    ttt_decay: float = 0.8  # eagle3: weight of step s is ttt_decay ** s
    train_lm_head: bool = False  # eagle3: train (and store) its own LM head instead of the target's rows
    feature_layers: list[int] | None = None  # eagle3: target hidden states to fuse (default: 2, L/2, L-3)
    noise: float = 0.1  # eagle: uniform noise on input features
    regression_weight: float = 1.0  # eagle
    ce_weight: float = 0.1  # eagle

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; valid: {', '.join(KINDS)}")
        for name in ("batch_size", "max_tokens", "layers", "eval_sequences", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.epochs > 0:
            raise ValueError("lr and epochs must be > 0")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise ValueError(f"budget_minutes must be > 0, got {self.budget_minutes}")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; valid: {', '.join(LOSSES)}")
        if self.kind == "eagle" and self.draft_vocab is not None:
            raise ValueError("an EAGLE-1/2 head reads the target's own LM head: train eagle3 for a reduced vocabulary")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")
