"""Drafters by name: the one place that turns ``--draft NAME`` into a drafter, for the CLI, the Python API,
bench, the server and the transformers hook alike.

Names:

- ``default``: the drafter of the default job (``api.DEFAULT_JOB``) for the embedded target;
- ``draft``: the draft LM shipped for the embedded target; ``eagle``: the EAGLE head shipped for it;
- ``eagle:DIR``: any EAGLE head folder (ours, or an official EAGLE-1/2 or EAGLE-3 release);
- ``self:N``: the target's own first N layers (no training; weak);
- ``lookup`` or ``lookup:N``: prompt lookup with n-grams of up to N tokens (default 3; no weights);
- anything else: a draft model sharing the target's vocabulary (HF id, folder, ``.gguf`` file, or a
  folder saved by ``fuzzyspec train draft``).

Loading gives a ``DrafterSource``: the weights, loaded once, and ``new()``, which makes a fresh
drafter for one sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .draftlm import is_shared_draft, load_draft_lm
from .drafters import Drafter, ModelDrafter
from .eagle import EagleDrafter, load_any_head
from .loading import EMBEDDED, LoadError, check_vocabularies, load_model, logit_width, self_draft, shipped
from .lookup import LookupDrafter
from .options import DEFAULT_JOB

DEFAULT_DRAFT = "default"
SHIPPED_KINDS = ("draft", "eagle")


@dataclass
class DrafterSource:
    """A loaded drafter: ``name`` as asked, ``module`` its weights (None for prompt lookup), ``new`` a
    fresh per-sequence drafter, ``width`` the target-vocabulary columns its logits cover."""

    name: str
    module: torch.nn.Module | None
    new: Callable[[], Drafter]
    width: int | None = None
    drafts_trees: bool = False


def load_drafter(name: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 target_name: str | None = None, dtype: str = "auto", device: str = "cpu") -> DrafterSource:
    """Load the drafter ``name`` (see the module docstring) for ``target``."""
    if name == DEFAULT_DRAFT:
        name = DEFAULT_JOB["draft"]
    if name in SHIPPED_KINDS:
        if target_name not in (None, EMBEDDED):
            raise LoadError("the shipped drafters are for the embedded target only: pass --draft for this target")
        folder = shipped(name)
        if not (folder / "config.json").is_file():
            raise LoadError(f"the shipped drafter is missing from {folder}: reinstall fuzzyspec")
        return _head(name, folder, target, vocab_size) if name == "eagle" else _draft_lm(name, folder, target,
                                                                                          vocab_size)
    if name.startswith("eagle:"):
        folder = Path(name[len("eagle:"):]).expanduser()
        if not folder.is_dir():
            raise LoadError(f"EAGLE head folder not found: {folder}")
        return _head(name, folder, target, vocab_size)
    if name == "lookup" or name.startswith("lookup:"):
        size = name[len("lookup:"):] if ":" in name else "3"
        if not size.isdigit() or int(size) < 1:
            raise LoadError(f"prompt lookup is written lookup or lookup:N with N >= 1 (longest n-gram), got {name!r}")
        return DrafterSource(name, None, lambda: LookupDrafter(int(size)))
    if name.startswith("self:"):
        count = name[len("self:"):]
        if not count.isdigit():
            raise LoadError(f"a self draft is written self:N with N a number of layers, got {name!r}")
        draft = self_draft(target, int(count))
        return DrafterSource(name, draft, lambda: ModelDrafter(draft, vocab_size), logit_width(draft))
    if is_shared_draft(name):
        return _draft_lm(name, name, target, vocab_size)
    draft, draft_tokenizer = load_model(name, dtype, device)
    if tokenizer is not None:  # the transformers hook has no tokenizer: the logit widths are checked there
        check_vocabularies(tokenizer, draft_tokenizer)
    return DrafterSource(name, draft, lambda: ModelDrafter(draft, vocab_size), logit_width(draft))


def _draft_lm(name: str, folder: str | Path, target: PreTrainedModel, vocab_size: int) -> DrafterSource:
    draft = load_draft_lm(folder, target)
    return DrafterSource(name, draft, lambda: ModelDrafter(draft, vocab_size), logit_width(draft))


def _head(name: str, folder: str | Path, target: PreTrainedModel, vocab_size: int) -> DrafterSource:
    try:
        head = load_any_head(folder, target)
    except (OSError, ValueError) as error:
        raise LoadError(str(error)) from error
    return DrafterSource(name, head, lambda: EagleDrafter(head, target, vocab_size), drafts_trees=True)
