"""Drafters by name: the one place that turns ``--draft NAME`` into a drafter, for the CLI, the Python API,
bench, the server, the transformers hook and the lm-eval model alike.

Names:

- ``default``: the drafter of the default job (``options.DEFAULT_JOB``) for the embedded target, copying from the
  text so far where its last 3 tokens occurred before (``lookup.CopyFirst``);
- ``draft``: the draft LM shipped for the embedded target; ``eagle``: the EAGLE head shipped for it;
- ``eagle:DIR``: any EAGLE head folder (ours, or an official EAGLE-1/2 or EAGLE-3 release);
- ``self:N``: the target's own first N layers (no training; weak);
- ``lookup`` or ``lookup:N``: prompt lookup with n-grams of up to N tokens (default 3; no weights);
- anything else: a draft model sharing the target's vocabulary (a folder, a ``.gguf`` file, a folder
  saved by ``fuzzyspec train draft``, or a Hugging Face id ``org/name``).

``describe`` checks a name and says what it drafts without loading anything (so a bad name is refused
at once, before any model loads); ``load_drafter`` loads it into a ``DrafterSource``: the weights, loaded
once, and ``new(vocab_size)``, which makes a fresh drafter for one sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..core.draft import Drafter
from ..core.int4 import Int8Linear, holds_blocks, packing, round_linears, roundable
from ..files import made_once
from ..loading import EMBEDDED, LoadError, check_model_name, check_vocabularies, load_model, shipped
from ..options import DEFAULT_DRAFT, DEFAULT_JOB
from .draftlm import DraftLM, is_shared_draft, load_draft_lm, self_draft
from .eagle import EagleDrafter, Head, head_logits, head_rows, load_any_head
from .head_step import head_step
from .lookup import CopyFirst, LookupDrafter
from .model import ModelDrafter

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SHIPPED_KINDS = ("draft", "eagle")
NAMES_HELP = ("'default' (the default job's drafter), 'draft', 'eagle', eagle:DIR, lookup, lookup:N, self:N, or a "
              "draft model: a folder, a .gguf file or a Hugging Face id (org/name)")


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter name stands for, known before anything loads."""

    name: str
    drafts_trees: bool


@dataclass
class DrafterSource:
    """A loaded drafter: ``name`` as asked, ``module`` its weights (None for prompt lookup), ``make`` what makes
    a per-sequence drafter, ``width`` the target-vocabulary columns its logits cover (None: any), ``prepare``
    (where its drafters run compiled steps of their own) what compiles those ahead for a cache of a capacity."""

    name: str
    module: torch.nn.Module | None
    make: Callable[[int], Drafter]
    width: int | None = None
    drafts_trees: bool = False
    prepare: Callable[..., None] | None = None  # (capacity, on_compile=None: told before it compiles)

    def new(self, vocab_size: int) -> Drafter:
        """A fresh drafter for one sequence of a pair sharing ``vocab_size`` logit columns."""
        drafter = self.make(vocab_size)
        drafter.name = self.name
        return drafter


def describe(name: str) -> DrafterSpec:
    """Check a drafter name (see the module docstring) and say what it drafts, loading nothing. A name that
    is neither one of ours, nor a path that exists, nor a Hugging Face id that can be had is refused with
    a ``LoadError`` listing the valid names."""
    if name in (DEFAULT_DRAFT, *SHIPPED_KINDS):
        return DrafterSpec(name, (DEFAULT_JOB["draft"] if name == DEFAULT_DRAFT else name) == "eagle")
    if name.startswith("eagle:"):
        folder = Path(name[len("eagle:"):]).expanduser()
        if not folder.is_dir():
            raise LoadError(f"EAGLE head folder not found: {folder}")
        return DrafterSpec(name, True)
    if name == "lookup" or name.startswith("lookup:"):
        size = name[len("lookup:"):] if ":" in name else "3"
        if not size.isdigit() or int(size) < 1:
            raise LoadError(f"prompt lookup is written lookup or lookup:N with N >= 1 (longest n-gram), got {name!r}")
        return DrafterSpec(name, False)
    if name.startswith("self:"):
        if not name[len("self:"):].isdigit():
            raise LoadError(f"a self draft is written self:N with N a number of layers, got {name!r}")
        return DrafterSpec(name, False)
    check_model_name(name, f"unknown drafter {name!r}; valid: {NAMES_HELP}")
    return DrafterSpec(name, False)


def load_drafter(name: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None,
                 target_name: str | None = None, dtype: str = "auto", device: str = "cpu", weights: str = "auto"
                 ) -> DrafterSource:
    """Load the drafter ``name`` (see the module docstring) for ``target``; a draft model in ``weights``'s form."""
    describe(name)
    source = _load(DEFAULT_JOB["draft"] if name == DEFAULT_DRAFT else name, target, tokenizer, target_name, dtype,
                   device, weights)
    source.name = name
    on_cpu = target.get_input_embeddings().weight.device.type == "cpu"
    if name == DEFAULT_DRAFT and on_cpu:  # the default job copies from the text where it can (``lookup.CopyFirst``)
        make = source.make
        source.make = lambda vocab_size: CopyFirst(make(vocab_size))
    return source


def _load(name: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, target_name: str | None,
          dtype: str, device: str, weights: str) -> DrafterSource:
    if name in SHIPPED_KINDS:
        if target_name not in (None, EMBEDDED):
            raise LoadError("the shipped drafters are for the embedded target only: pass --draft for this target")
        folder = shipped(name)
        if not (folder / "config.json").is_file():
            raise LoadError(f"the shipped drafter is missing from {folder}: reinstall fuzzyspec")
        return _head(name, folder, target) if name == "eagle" else _draft_lm(name, load_draft_lm(folder, target),
                                                                              target)
    if name.startswith("eagle:"):
        return _head(name, Path(name[len("eagle:"):]).expanduser(), target)
    if name == "lookup" or name.startswith("lookup:"):
        size = int(name[len("lookup:"):]) if ":" in name else 3
        return DrafterSource(name, None, lambda vocab_size: LookupDrafter(size))
    if name.startswith("self:"):
        try:
            return _draft_lm(name, DraftLM(self_draft(target, int(name[len("self:"):]))))
        except ValueError as error:
            raise LoadError(str(error)) from None
    if is_shared_draft(name):
        return _draft_lm(name, load_draft_lm(name, target), target)
    draft, draft_tokenizer = load_model(name, dtype, device, weights)
    if tokenizer is not None:  # the transformers hook has no tokenizer: the logit widths are checked there
        check_vocabularies(tokenizer, draft_tokenizer)
    return _draft_lm(name, DraftLM(draft))


def _in_targets_form(drafter: torch.nn.Module, target: PreTrainedModel) -> torch.nn.Module:
    """A drafter of a target held at its GGUF's 4-bit bytes reads its own float layers as Q8_0 (``int4``): its
    float32 products would cost a 4-bit target's step half again per draft token."""
    if holds_blocks(target):
        round_linears(drafter)
    return drafter


def _in_targets_blocks(head: Head, folder: Path, target: PreTrainedModel) -> torch.Tensor | None:
    """An EAGLE head beside a 4-bit target in the target's form: its layers at Q8_0 (as ``_in_targets_form``), and
    the 4-bit rows of the target's LM head its logits are read through (``eagle.head_rows``; returned). Both are
    made from the head's folder and the target's GGUF once a machine and kept (``files.made_once``): they took
    60-80 ms of every load on 2 cores, about what the default job's decoding gains over AR on a short answer."""
    if not holds_blocks(target):
        return None

    def make() -> dict:
        return {"layers": {name: Int8Linear.rounded(linear).packed for name, linear in roundable(head)},
                "rows": head_rows(head, target)}

    gguf = getattr(target, "gguf_file", None)  # (a target of another source: made each time)
    made = make() if gguf is None else \
        made_once(f"head-{folder.name}", [*sorted(p for p in folder.iterdir() if p.is_file()), gguf], make,
                  form=packing())
    round_linears(head, made["layers"])
    return made["rows"]


def _draft_lm(name: str, draft: DraftLM, target: PreTrainedModel | None = None) -> DrafterSource:
    if target is not None:
        _in_targets_form(draft.model, target)
    def make(vocab_size: int) -> ModelDrafter:
        return ModelDrafter(draft.model, vocab_size, draft.vocab, draft.window)

    return DrafterSource(name, draft.model, make, draft.width)


def _head(name: str, folder: Path, target: PreTrainedModel) -> DrafterSource:
    try:
        head = load_any_head(folder, target)
        rows = _in_targets_blocks(head, folder, target)
    except (OSError, ValueError) as error:
        raise LoadError(str(error)) from error
    logits = head_logits(head, target, rows)
    step = head_step(head, target.get_input_embeddings())  # made here, so every drafter of the head shares it
    return DrafterSource(name, head, lambda vocab_size: EagleDrafter(head, target, vocab_size, logits),
                         drafts_trees=True, prepare=step.prepare if step.compiles else None)

