"""Decoding options, declared once: name, default, help, and the name each interface gives them.

``core.config.DecodeConfig`` holds the values and ``DecodeConfig.from_options`` decides a request
from them; this table says how each option is spelled on the command line (``--name-with-dashes``),
in a server request (``request``) and in the transformers hook (``fsd_<name>``, where ``hook``), and
how its value is read from text. A bad value raises ``OptionError``, which names the option, so each
interface can say it the way its user wrote it. Nothing here imports torch, so ``fuzzyspec --help``
stays fast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

METHODS = ("ar", "sd", "fsd", "fsd-hybrid")
FUZZY = ("fsd", "fsd-hybrid")
SCHEDULES = ("constant", "cost", "heuristic")
DIVERGENCE_HELP = ("js, js_legacy, kl_pq, kl_qp, tv, hellinger, or their topk_*/topp_* forms; the FSD reference "
                   "code's names (js_div, kl_div, ...) are aliases")

DEFAULT_DRAFT = "default"  # the registry's name for the default job's drafter
# What runs when nothing says otherwise (``DecodeConfig.from_options`` applies it; the README says why):
# the shipped EAGLE head drafting EAGLE-2 trees, checked by exact SD, so the output is the target's own
# distribution; and with any drafter, drafts sized by this machine's measured costs (none where
# speculation does not pay). FSD trades some quality for speed, so it is asked for, never assumed.
DEFAULT_JOB: dict[str, Any] = {"draft": "eagle", "tree": True, "gamma_schedule": "cost"}
JOB_HELP = ("the default job is lossless: the shipped EAGLE head drafts EAGLE-2 trees and exact SD checks them, "
            "so the text is distributed exactly as the target's own; fsd and fsd-hybrid trade quality for speed "
            "and are opt-in")
# A server answers OpenAI clients: their default temperature, and a length when a request asks none.
SERVE_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": 256}


class OptionError(ValueError):
    """A bad value for a decoding option. ``option`` is its table name (or another request field, such as
    ``draft`` or ``target_acceptance``); ``problem`` says what is wrong and reads after the option's name."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option, self.problem = option, problem

    def spelled(self, name: str) -> str:
        """The message with the option spelled as the user wrote it (``--max-new-tokens``, ``max_tokens``)."""
        return f"{name} {self.problem}"


@dataclass(frozen=True)
class Option:
    name: str               # the field of DecodeConfig or Sampling
    default: Any
    help: str
    request: str | None     # the server's request field; None: set for the whole server only
    hook: bool = True       # the transformers hook takes it as fsd_<name> (else from HF's generation config)
    choices: tuple[str, ...] | None = None
    group: str = "decoding"
    shown_default: str | None = None  # the default as --help says it, where the default job decides it

    @property
    def flag(self) -> str:
        return flag(self.name)


def flag(name: str) -> str:
    """The command-line spelling of an option or field name."""
    return "--" + name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("method", "sd", f"how drafts are accepted: ar (no drafts), sd (exact), fsd, fsd-hybrid; {JOB_HELP}",
           "method", choices=METHODS, shown_default="sd; ar without a drafter; fsd with --target-acceptance"),
    Option("divergence", "js", f"D of the fuzzy rules: {DIVERGENCE_HELP}", "fsd_divergence"),
    Option("threshold", 0.3, "T of the fuzzy rules (inf: accept every draft); unused by ar and sd", "fsd_threshold"),
    Option("gamma", 5, "drafted tokens per step at most (a chain's length; the start value under the heuristic "
           "schedule)", "gamma"),
    Option("gamma_schedule", "constant", "how much each step drafts: cost (the size that maximises tokens per second "
           "under this machine's measured costs and the row's acceptance, up to --gamma or --tree-depth; none where "
           "speculation does not pay), constant (always the cap), or heuristic (chains: +2 after a fully accepted "
           "step, -1 otherwise)", "gamma_schedule", choices=SCHEDULES, shown_default="cost"),
    Option("draft_confidence", 0.0, "stop drafting when the draft's top probability falls below this",
           "draft_confidence"),
    Option("greedy_drafts", False, "draft the draft's most likely tokens even when sampling, as the FSD reference "
           "code did (sd stays exact: a drafted argmax is a point mass)", "greedy_drafts"),
    Option("raw_divergence", False, "compute D on unprocessed distributions, as the FSD reference code did", None),
    Option("divergence_top_k", 50, "k of the topk_* divergences", None),
    Option("divergence_top_p", 0.9, "p of the topp_* divergences", None),
    Option("tree", False, "draft EAGLE-2 dynamic trees instead of chains (needs an EAGLE head as the drafter)",
           "tree", group="trees", shown_default="on with the default drafter, else off"),
    Option("tree_total_tokens", 16, "nodes kept per tree", "tree_total_tokens", group="trees"),
    Option("tree_depth", 5, "tree depth (at most, under the cost schedule)", "tree_depth", group="trees"),
    Option("tree_top_k", 4, "children per expanded node, and nodes expanded per level (at most, under the cost "
           "schedule, which may narrow a tree down to a chain where wide steps are dear)", "tree_top_k",
           group="trees"),
    Option("temperature", 0.0, "0 = greedy", "temperature", hook=False, group="sampling"),
    Option("top_k", 0, "0 = off", "top_k", hook=False, group="sampling"),
    Option("top_p", 1.0, "1 = off", "top_p", hook=False, group="sampling"),
    Option("seed", None, "random seed (none: a fresh one)", "seed", group="sampling"),
    # 512: 29 of 32 everyday answers of the embedded target end by then; at 128, 16 of them were cut off, the
    # README's own example among them (benchmarks/results_start_up_epyc_2026-11-27.txt). The other 3 ran to 1,024.
    Option("max_new_tokens", 512, "tokens to generate at most", "max_tokens", hook=False, group="sampling"),
)
BY_NAME = {option.name: option for option in OPTIONS}


def _number(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise OptionError(name, f"must be a number, got {text!r}") from None


def parse_threshold(text: str, name: str = "threshold") -> float:
    value = _number(text, name)
    if math.isnan(value) or value < 0:
        raise OptionError(name, f"must be >= 0 (inf allowed), got {text}")
    return value


def _parse_int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise OptionError(name, f"must be an integer, got {text!r}") from None


def _parse_float(text: str, name: str) -> float:
    value = _number(text, name)
    if not math.isfinite(value):
        raise OptionError(name, f"must be a finite number, got {text}")
    return value


def parse_bool(text: str, name: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise OptionError(name, f"must be true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


def value_parser(option: Option) -> Callable[[str], Any]:
    """The function that reads an option's value from text, raising OptionError on bad text."""
    if option.name == "threshold":
        read: Callable[[str, str], Any] = parse_threshold
    elif isinstance(option.default, bool):
        read = parse_bool
    elif isinstance(option.default, int) or option.name == "seed":
        read = _parse_int
    elif isinstance(option.default, float):
        read = _parse_float
    else:
        return str
    return lambda text: read(text, option.name)


def check_acceptance(value: float, name: str = "target_acceptance") -> None:
    """A requested acceptance rate (the share of drafted tokens accepted) must be in (0, 1)."""
    if not 0 < value < 1:
        raise OptionError(name, f"must be in (0, 1), got {value}")
