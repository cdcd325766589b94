"""Reduced draft vocabularies: a drafter that predicts only the N tokens the target emits most.

A draft step's cost on a CPU is dominated by the bytes it reads, and a full
LM head over a 49k vocabulary is most of them. EAGLE-3 and FR-Spec restrict
the drafter's output layer to the N most frequent tokens and map its ids back
to the target's; the target's greedy tokens fall in that set almost always.

Conventions (those of the EAGLE-3 releases, so their heads load too):

- draft id ``i`` (0 <= i < N) is target id ``i + d2t[i]``; the target ids are
  kept in ascending order, so ``d2t`` is non-negative and non-decreasing;
- ``t2d`` ([V] bool) marks the target ids the draft can propose.

The draft's distribution q over the target vocabulary is its N-way softmax
with zeros everywhere else, so every acceptance rule stays exact: SD's
residual max(0, p - q) simply keeps all of p's mass outside the N tokens.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor, nn


class DraftVocab:
    """The map between a drafter's N output ids and the target's V ids."""

    def __init__(self, target_ids: Tensor, target_size: int) -> None:
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= target_size:
            raise ValueError(f"a draft vocabulary needs distinct target ids in [0, {target_size}), ascending")
        self.target_ids = ids  # [N]: target id of each draft id
        self.target_size = target_size
        self._copies: dict[torch.device, Tensor] = {}  # target_ids on other devices (``ids_on``)

    def __len__(self) -> int:
        return self.target_ids.numel()

    @classmethod
    def from_maps(cls, d2t: Tensor, t2d: Tensor | None = None) -> "DraftVocab":
        """From the stored offsets ``d2t`` ([N]) and mask ``t2d`` ([V]); without ``t2d`` V is taken as the
        largest target id + 1, which callers should check against the target."""
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        ids = torch.arange(d2t.numel()) + d2t
        size = int(t2d.numel()) if t2d is not None else int(ids.max()) + 1
        vocab = cls(ids, size)
        if t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), ids):
            raise ValueError("the draft vocabulary's d2t and t2d maps disagree")
        return vocab

    def maps(self) -> dict[str, Tensor]:
        """``d2t`` offsets and ``t2d`` mask, as stored beside a drafter's weights."""
        t2d = torch.zeros(self.target_size, dtype=torch.bool)
        t2d[self.target_ids] = True
        return {"d2t": self.target_ids - torch.arange(len(self)), "t2d": t2d}

    def to(self, device: torch.device | str) -> "DraftVocab":
        moved = DraftVocab.__new__(DraftVocab)
        moved.target_ids, moved.target_size, moved._copies = self.target_ids.to(device), self.target_size, {}
        return moved

    def ids_on(self, device: torch.device) -> Tensor:
        """``target_ids`` on ``device``, copied there once: a copy from pageable host memory to a GPU waits for
        everything queued before it, and drafting maps ids at every tree level."""
        if self.target_ids.device == device:
            return self.target_ids
        if device not in self._copies:
            self._copies[device] = self.target_ids.to(device)
        return self._copies[device]

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft ids -> target ids, any shape."""
        return self.ids_on(draft_ids.device)[draft_ids]

    def expand(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """[..., N] values over draft ids -> [..., V] over target ids, ``fill`` elsewhere (0 for
        probabilities, -inf for logits)."""
        full = values.new_full((*values.shape[:-1], self.target_size), fill)
        full[..., self.ids_on(values.device)] = values
        return full

    def restrict(self, values: Tensor) -> Tensor:
        """[..., V] over target ids -> [..., N], the draft's columns only."""
        return values.index_select(-1, self.ids_on(values.device))

    def coverage(self, tokens: Iterable[int] | np.ndarray) -> float:
        """Share of ``tokens`` (target ids) that the draft can propose."""
        tokens = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        if tokens.size == 0:
            return 0.0
        member = np.zeros(self.target_size, dtype=bool)
        member[self.target_ids.numpy()] = True
        return float(member[tokens].mean())


def token_counts(sequences: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each target id occurs in ``sequences`` ([V] int64)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for sequence in sequences:
        counts += np.bincount(np.asarray(sequence, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def most_frequent(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The ``size`` most frequent target ids (ties broken by the lower id), always including ``always``
    (end-of-sequence tokens, say: a draft that cannot propose EOS never ends an answer)."""
    vocab_size = len(counts)
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary size must be between 1 and {vocab_size}, got {size}")
    forced = sorted({int(t) for t in always if 0 <= int(t) < vocab_size})
    order = np.lexsort((np.arange(vocab_size), -np.asarray(counts)))  # by count descending, then id
    chosen = list(forced)
    taken = set(forced)
    for token in order:
        if len(chosen) >= size:
            break
        if int(token) not in taken:
            chosen.append(int(token))
    return DraftVocab(torch.tensor(sorted(chosen[:size])), vocab_size)


def reduced_lm_head(lm_head: nn.Module, vocab: DraftVocab, rows: Tensor | None = None) -> nn.Module:
    """A frozen copy of ``lm_head``'s rows for the draft vocabulary's tokens: logits over N, not V. A float head
    gives float rows; an 8-bit head (a GGUF target's) gives 4-bit rows whose highest logits are worked out again
    from its 8-bit ones (``RoundedRows``; ``rows``: those 4-bit rows as ``RoundedRows.rounded`` made them)."""
    from .int4 import Int8Linear

    if isinstance(lm_head, Int8Linear):
        return RoundedRows(lm_head, vocab, rows)
    weight = lm_head.weight
    head = nn.Linear(weight.shape[1], len(vocab), bias=False, device=weight.device, dtype=weight.dtype)
    head.weight.data.copy_(weight.detach().index_select(0, vocab.target_ids.to(weight.device)))
    head.requires_grad_(False)
    return head


RESCORED = 8  # logits per output that ``RoundedRows`` works out again: a default tree's 4 children, and room


class RoundedRows(nn.Module):
    """The draft vocabulary's rows of an 8-bit LM head (``int4.Int8Linear``) held at 4 bits (Q4_1, rounded from the
    8-bit rows), the ``RESCORED`` highest logits of each output then worked out again from the 8-bit rows.

    Why 4 bits: the rows are read from memory after every target pass, where their bytes are most of what a draft
    step costs (on an AVX-512 CPU, 16,384 rows: 193 us cold in 4 bits, 382 in 8). Why the top logits again: the
    rounding moves which token comes first. Greedy chains of 4 from the shipped EAGLE head beside the embedded
    4-bit target, on the same 24 everyday answers: first drafts passed 48.1% of the time with 4-bit rows and 50.4%
    with float ones (1.769 against 1.828 tokens a pass); with the top 4 or 16 logits worked out again, 50.3% and
    50.4% (1.828 both). Over all 64 everyday prompts, less: 1.829 tokens a pass with 4-bit rows alone against
    1.858 with float rows or the top 8 again. Those few rows are read from the target's float copy of its 8-bit head (its tied
    embedding, which lookups read anyway), so nothing is held twice. One call of our kernel (``top_again``) does it
    in 8 us (PyTorch's topk, gathers and scatter took 37); in decoding no speed difference was shown (a fixed
    1-token chain 1.125x compiled AR against 1.124x with the 4-bit rows alone: benchmarks/ab_draft_rows.py,
    results_planner_ab_epyc.txt O62)."""

    def __init__(self, lm_head: nn.Module, vocab: DraftVocab, rows: Tensor | None = None) -> None:
        """``rows``: the bytes ``rounded`` makes, made earlier (40-50 ms of a load on 2 cores: kept on disk)."""
        from .int4 import Int4Linear

        super().__init__()
        exact = lm_head.weight.detach().float()  # [V, H]: the 8-bit rows' values (a GGUF target's: float32 already)
        ids = self._ids(lm_head, vocab)
        self.rows = Int4Linear.packed_as(self.rounded(lm_head, vocab) if rows is None else rows, len(ids),
                                         exact.shape[1])
        self.exact = exact.contiguous()  # (a plain tensor: not this module's to save or move)
        self.register_buffer("target_ids", ids, persistent=False)
        self.out_features, self.in_features = self.rows.out_features, self.rows.in_features

    @staticmethod
    def rounded(lm_head: nn.Module, vocab: DraftVocab) -> Tensor:
        """The kernel's bytes of the draft vocabulary's rows of ``lm_head``, rounded to Q4_1 (``Int4Linear.rounded``)."""
        from .int4 import Int4Linear

        return Int4Linear.rounded(lm_head.weight.detach(), RoundedRows._ids(lm_head, vocab)).packed

    @staticmethod
    def _ids(lm_head: nn.Module, vocab: DraftVocab) -> Tensor:
        weight = lm_head.weight
        if int(vocab.target_ids[-1]) >= weight.shape[0]:  # (the kernel reads rows by these ids unchecked)
            raise ValueError(f"a draft vocabulary up to token {int(vocab.target_ids[-1])} for an LM head of "
                             f"{weight.shape[0]} rows")
        return vocab.target_ids.to(weight.device)

    def forward(self, x: Tensor) -> Tensor:
        inputs = x.reshape(-1, x.shape[-1]).float().contiguous()
        logits = self.rows(inputs).float().contiguous()
        torch.ops.fuzzyspec_int4.top_again(logits, inputs, self.exact, self.target_ids, RESCORED)
        return logits.view(*x.shape[:-1], logits.shape[-1])
