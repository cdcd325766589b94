"""What the decoding engine asks of a drafter, and what a drafter answers: ``Budget``, ``Draft``, ``Drafter``.

A drafter plugs in by implementing ``Drafter`` (``BaseDrafter`` gives the optional parts) and
registering a name in ``fuzzyspec.drafters.registry``. One drafter object serves one sequence at a time (it
may keep caches between steps; ``reset`` clears them). Every proposal is a ``Draft``: a tree of
tokens below the sequence's newest one, of which a chain is the case with one child per node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from .vocab import DraftVocab
from .sampling import Sampling


@dataclass(frozen=True)
class Budget:
    """What a drafter may propose at one step.

    ``tokens``: at most this many chain tokens (0: none, but a copy, asked only of a drafter that ``copies``).
    ``copy``: at most this many tokens for a draft copied from the text so far (``drafters.lookup.CopyFirst``; 0:
    none may be). ``tree``: (total nodes, depth, children per
    node) for drafters that draft trees, or None for a chain. ``min_confidence``: stop a chain
    before a token whose draft distribution's top probability is below it (the first token is
    always proposed). ``greedy``: propose the draft's most likely tokens even when sampling (the
    draft is then deterministic, and its ``Draft`` is not ``sampled``). ``distributions``: whether the row's
    rule reads the draft's distributions (``Draft.q`` and ``logits``: fuzzy rules, and SD on sampled chains);
    where it does not, a drafter may leave them out (a greedy chain then needs no softmax at all).
    """

    tokens: int
    tree: tuple[int, int, int] | None = None
    min_confidence: float = 0.0
    greedy: bool = False
    distributions: bool = True
    copy: int = 0


@dataclass
class GrownShape:
    """A draft tree's shape on the device, for a tree grown there (``Draft.grown``): ``parents`` [n] (-1: a child of
    the root), ``ancestors`` [n, n] bool (entry (i, j): node j is node i or one of its ancestors), ``depths`` [n]
    (1 for the root's children), and ``breadth``, the most children a node may have."""

    parents: Tensor
    ancestors: Tensor
    depths: Tensor
    breadth: int


@dataclass
class Draft:
    """Drafted tokens, as a tree hanging below the newest token of the sequence (the root).

    ``tokens`` [n]: target ids, on the drafter's device. ``parents`` [n]: -1 for a child of the root, else
    an earlier node (parents[i] < i); the tree's shape is host metadata, kept on the CPU (copied there if
    given on another device), so the engine reads it without waiting for the device. A tree grown on the device
    gives its shape there instead (``grown``, and ``parents`` None): the engine lays out its verification from it
    there, and the shape comes to the host with the step's outcome, in the step's one read (``learn_shape``).
    ``q`` [n + 1, N]: row 0 is the draft distribution the root's children came from, row i + 1 node i's (zeros where a
    node was not expanded); None when every token was chosen with certainty (a point mass on it: prompt lookup), which
    the rules use without building it. ``logits`` [n + 1, N]: the raw logits behind q (None with q). ``vocab``: the
    reduced draft vocabulary of q's N columns (None: N is the target's V). ``sampled``: children were drawn from q
    (chains under sampling: SD's min(1, p/q) test applies); otherwise they were picked deterministically (argmax, top-k,
    lookup), which the rules treat as point masses. ``planned``: the draft is the one the row's draft size was planned
    for; False for one proposed beside it (a copy from the text so far, ``drafters.lookup.CopyFirst``), whose cost and
    acceptance say nothing of the planned drafter's, so the engine counts neither toward the sizes it plans.
    """

    tokens: Tensor
    parents: Tensor | None
    q: Tensor | None = None
    logits: Tensor | None = None
    vocab: DraftVocab | None = None
    sampled: bool = False
    planned: bool = True
    grown: "GrownShape | None" = None  # a tree's shape on the device, for a tree grown there (``parents`` None)
    is_chain: bool = field(init=False)  # one child per node
    parent_ids: list[int] | None = field(init=False, repr=False)  # ``parents`` as a list, read once (None: not yet)

    def __post_init__(self) -> None:
        if self.parents is None:
            if self.grown is None:
                raise ValueError("a draft tree needs its parents, on the host or (grown) on the device")
            self.parent_ids, self.is_chain = None, False
            return
        parents = self.parents.cpu()
        self.learn_shape(parents.tolist() if parents.dim() == 1 else [], parents)

    def learn_shape(self, parent_ids: list[int], parents: Tensor | None = None) -> None:
        """The tree's parents, on the host: given (``parents``, as a tensor too), or read from the device (a tree
        grown there)."""
        n = self.tokens.shape[0]
        if (parents is not None and parents.shape != (n,)) or len(parent_ids) != n or \
                any(parent >= i for i, parent in enumerate(parent_ids)):
            raise ValueError("a draft tree needs one parent per node, each parent numbered before its child")
        self.parents = parents if parents is not None else torch.tensor(parent_ids, dtype=torch.long)
        self.parent_ids = parent_ids
        self.is_chain = self.grown is None and parent_ids == list(range(-1, n - 1))

    def read_shape(self) -> None:
        """Bring a tree grown on the device's shape to the host now (a read of the device), where it is needed
        before the step's outcome is read."""
        if self.parent_ids is None:
            self.learn_shape(self.grown.parents.tolist())

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def chain(tokens: Tensor, q: Tensor | None = None, logits: Tensor | None = None,
              vocab: DraftVocab | None = None, sampled: bool = False) -> "Draft":
        """A chain of k tokens; ``q``/``logits`` [k, N] are the distributions token i was drafted from."""
        k = tokens.shape[0]
        parents = torch.arange(-1, k - 1)
        if q is not None:  # the last node was not expanded: a zero row
            q = torch.cat([q, q.new_zeros(1, q.shape[-1])])
            logits = torch.cat([logits, logits.new_zeros(1, logits.shape[-1])]) if logits is not None else None
        return Draft(tokens, parents, q, logits, vocab, sampled)

    @property
    def depths(self) -> list[int]:
        """Depth of each node (1 for the root's children)."""
        depths: list[int] = []
        for parent in self.parent_ids:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def children(self) -> list[list[int]]:
        """Row r's children as node indices, in drafting order (row 0 is the root, row i + 1 node i)."""
        children: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for node, parent in enumerate(self.parent_ids):
            children[parent + 1].append(node)
        return children

    def ranks(self, path: list[int]) -> list[int]:
        """Each node of ``path``'s place among its parent's children (1: the first drafted). Drafters that
        branch list a node's children likeliest first, so this is how likely the draft found it."""
        return [sum(parent == self.parent_ids[node] for parent in self.parent_ids[:node]) + 1 for node in path]

    def ancestors(self) -> Tensor:
        """[n, n] bool, on the CPU: entry (i, j) is True when node j is node i or one of its ancestors. (Made as
        lists, then one tensor: a tensor operation per node costs a few microseconds each, tens on some hosts.)"""
        n = len(self)
        rows: list[list[bool]] = []
        for i, parent in enumerate(self.parent_ids):
            row = list(rows[parent]) if parent >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).reshape(n, n)

    def widened(self, rows: Tensor | slice = slice(None)) -> tuple[Tensor, Tensor]:
        """(logits, q) of ``rows`` over the target's vocabulary: -inf and 0 outside a reduced vocabulary."""
        logits, q = self.logits[rows], self.q[rows]
        if self.vocab is None:
            return logits, q
        return self.vocab.expand(logits, float("-inf")), self.vocab.expand(q)


@runtime_checkable
class Drafter(Protocol):
    """Everything the engine calls on a drafter.

    ``propose`` sees the whole sequence so far ([1, L]: prompt and every emitted token) and
    returns a Draft within ``budget`` (or None: nothing to propose now, the step runs the target
    alone). ``sampling`` is the row's: a drafter that samples draws from ``generator``.
    A drafter that reads the target's hidden states sets ``wants_target_features`` and
    ``feature_layers`` (indices into the target's ``hidden_states``, concatenated on the last
    dimension); after every target pass it gets ``observe(start, features)``: the features
    ([1, n, F]) of sequence positions start .. start + n - 1 that stay in the sequence.
    After every step that verified its draft, ``accepted(count)`` says how many of the draft's tokens
    were kept (the nodes of a tree's accepted path): the next ``propose`` gets the sequence it last saw,
    those tokens and at least one more, so a drafter can keep what it computed for them without comparing
    tokens on the device. ``forwards`` counts the drafter's model passes, for statistics. ``compiled``: the
    engine's word that the target's steps run compiled, so a drafter that can runs its own compiled too.
    ``copies``: it may propose a draft copied from the text so far, at no model pass, even at a step whose
    planned size is 0 (it is then asked with ``Budget.tokens`` 0, and answers a copy or None).
    Optional (``BaseDrafter`` has them): ``first_feature(length)``, the first position whose features it reads, and
    ``true_features()``, the features it holds.
    """

    forwards: int
    name: str  # what it is called (the registry's name); costs are measured per name
    wants_target_features: ClassVar[bool]
    drafts_trees: ClassVar[bool]
    copies: ClassVar[bool]
    feature_layers: list[int]
    compiled: bool

    def reset(self) -> None: ...

    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft | None: ...

    def observe(self, start: int, features: Tensor) -> None: ...

    def accepted(self, count: int) -> None: ...


class BaseDrafter:
    """Defaults for the optional parts of ``Drafter``."""

    wants_target_features: ClassVar[bool] = False
    drafts_trees: ClassVar[bool] = False
    copies: ClassVar[bool] = False
    feature_layers: list[int] = []
    compiled: bool = False

    def __init__(self) -> None:
        self.forwards = 0
        self.name = type(self).__name__

    def reset(self) -> None:
        pass

    def observe(self, start: int, features: Tensor) -> None:
        pass

    def accepted(self, count: int) -> None:
        pass

    def first_feature(self, length: int) -> int:
        """The first of a ``length``-token text's positions whose target features a drafter that reads them
        (``wants_target_features``) reads, freshly reset: the engine may skip computing the ones before (a slot
        that holds a prompt's first tokens, ``Engine.add_many``). 0: it reads them all."""
        return 0

    def true_features(self) -> tuple[int, Tensor] | None:
        """The target features it holds of the text (from which position, and they: [1, n, F]; None: none), which
        the engine keeps with its row's slot when the row ends, for a row whose prompt begins with the same text."""
        return None
