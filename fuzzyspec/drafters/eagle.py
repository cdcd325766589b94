"""The EAGLE drafter: chains or EAGLE-2 dynamic trees from an EAGLE head (EAGLE-1/2 or EAGLE-3), fed the
target's features."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ..core.draft import BaseDrafter, Budget, Draft, GrownShape
from ..core.host import upload
from ..core.int4 import Int8Linear
from ..core.kvcache import common_prefix, crop_to
from ..core.sampling import Sampling
from ..core.vocab import RoundedRows, reduced_lm_head
from ..train.config import trained_length
from .chain import draft_chain
from .eagle3 import Eagle3Head, is_eagle3, load_eagle3
from .eagle_head import EagleHead, load_head
from .head_step import WIDTHS, head_step

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PreTrainedModel

Head = EagleHead | Eagle3Head


def load_any_head(folder: str | Path, target: PreTrainedModel) -> Head:
    """An EAGLE-3 head or an EAGLE-1/2 head, whichever layout ``folder`` holds, its ``window`` set
    (``trained_length``)."""
    head = load_eagle3(folder, target) if is_eagle3(folder) else load_head(folder, target)
    head.window = trained_length(folder)
    return head


def head_logits(head: Head, target: PreTrainedModel, rows: Tensor | None = None) -> Callable[[Tensor], Tensor]:
    """How a head's outputs become draft logits (float32): an EAGLE-3 head's own LM head; an EAGLE-1/2
    head's predicted features through the target's LM head, only its draft vocabulary's rows when it has
    one (so a draft step reads N rows, not V). Made once per loaded head, shared by its drafters. ``rows``: the
    bytes ``head_rows`` made, made earlier."""
    if isinstance(head, Eagle3Head):
        return head.logits
    lm_head = target.get_output_embeddings()
    if head.vocab is not None:
        lm_head = reduced_lm_head(lm_head, head.vocab, rows)
    return lambda out: lm_head(out).float()


def head_rows(head: Head, target: PreTrainedModel) -> Tensor | None:
    """The 4-bit rows of a 4-bit target's LM head that ``head_logits`` reads this head's logits through
    (``vocab.RoundedRows``), as the kernel's bytes; None where it reads none."""
    lm_head = target.get_output_embeddings()
    if isinstance(head, Eagle3Head) or head.vocab is None or not isinstance(lm_head, Int8Linear):
        return None
    return RoundedRows.rounded(lm_head, head.vocab)


class EagleDrafter(BaseDrafter):
    """Drafts chains, or EAGLE-2 trees, with an EAGLE head (EAGLE-1/2 or EAGLE-3), fed the target's features.

    The engine hands it the target's hidden states at ``feature_layers`` (indices into the
    target's ``hidden_states``, concatenated; ``observe``) after each verification. Head
    positions computed from true features stay in its KV cache; those computed from its
    own predictions are recomputed next time.

    Trees (a budget with a tree shape: total nodes, depth, top_k) follow EAGLE-2's
    context-aware dynamic tree (Li et al. 2024): from the root, the ``top_k`` most likely
    tokens under the head become children; then for ``depth - 1`` more levels the ``top_k``
    frontier nodes of highest confidence (the product of draft probabilities along the path)
    are expanded, each into its own ``top_k`` children, in one head pass per level with tree
    attention. Finally all drafted nodes are reranked by confidence and the best ``total``
    kept (a child is never more confident than its parent, so the kept set holds its
    ancestors). EAGLE-2's published setting is total 60, depth 6, top_k 10.
    """

    wants_target_features = True
    drafts_trees = True

    def __init__(self, head: Head, target: PreTrainedModel, vocab_size: int,
                 logits: Callable[[Tensor], Tensor] | None = None) -> None:
        """``logits``: ``head_logits(head, target)``, passed in when several drafters share one head."""
        super().__init__()
        self.head = head
        self.embed = target.get_input_embeddings()
        self.step = head_step(head, self.embed)  # the head's calls, over its own cache (eager or compiled)
        self.vocab_size = vocab_size
        self.vocab = head.vocab
        self.feature_layers = head.feature_layers
        self._head_logits = logits or head_logits(head, target)

    def reset(self) -> None:
        if getattr(self, "cache", None) is None:
            self.cache = self.step.borrow_cache(self)
        crop_to(self.cache, 0)
        self.features: Tensor | None = None  # true target features of positions since .. known - 1, then room
        self.known = 0
        self.since = math.inf  # (a row whose prompt's start its slot held is given features from a later position)
        self.tokens: Tensor | None = None  # the sequence those features belong to, until the engine vouches for it
        self.true_positions = 0  # head cache positions computed from true features and tokens
        self.offset = 0  # the text position of the head cache's first (it reads a long prompt's end alone: _root)

    def observe(self, start: int, features: Tensor) -> None:
        """True target features ([1, n, F]) of positions start .. start + n - 1."""
        end = start + features.shape[1]
        if self.features is None or end > self.features.shape[1]:  # room by doubling: no copy of them all per step
            grown = features.new_empty(1, max(end, 2 * self.known), features.shape[2])
            if self.features is not None:
                grown[:, : self.known] = self.features[:, : self.known]
            self.features = grown
        self.features[:, start:end] = features
        self.known = end
        self.since = min(self.since, start)
        self.true_positions = min(self.true_positions, start)

    def accepted(self, count: int) -> None:
        self.tokens = None  # the next sequence extends the last one: no need to compare them on the device

    def first_feature(self, length: int) -> int:
        window = getattr(self.head, "window", None)  # (see _root)
        return length - window // 2 if window and length > window else 0

    def true_features(self) -> tuple[int, Tensor] | None:
        return (self.since, self.features[:, self.since: self.known]) if self.features is not None else None

    @torch.inference_mode()
    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft | None:
        if self.features is None:  # nothing to draft from before the target's first pass
            return None
        hidden = self._root(sequence)
        if budget.tree is not None:
            return self._tree(hidden, budget.tree, sampling, budget.distributions)

        def advance(token: Tensor) -> Tensor:
            nonlocal hidden
            hidden = self.step(self.cache, token, hidden, compiled=self.compiled)
            self.forwards += 1
            return self._logits(hidden[:, -1])

        return draft_chain(self._logits(hidden[:, -1]), advance, budget, sampling, generator, self.vocab)

    def _root(self, sequence: Tensor) -> Tensor:
        """Bring the head's cache up to date with the true features; return the predicted feature
        ([1, 1, H]) of the newest token, whose logits give the first draft. Where the text outgrows the head's
        ``window`` (the positions it trained on, ``trained_length``), the head reads its last half window alone, as if
        the text began there (its rotary embedding sees only distances), and again each time they grow to a whole
        one: a pass over half a window every half window's tokens."""
        # Head position j reads token offset + j + 1 and feature offset + j: F positions, with offset + F <= len - 1.
        count = min(self.known, sequence.shape[1] - 1)
        if self.tokens is not None:
            self.true_positions = min(self.true_positions, common_prefix(self.tokens, sequence) - 1)
        kept = max(0, min(self.true_positions, count - 1))  # always feed at least one position
        window = getattr(self.head, "window", None) or math.inf
        if count - self.offset > window or kept < self.offset:  # past what it trained on: it reads the text's end
            self.offset = kept = max(0, count - int(window) // 2)  # (the cache's positions start there now: anew)
        crop_to(self.cache, kept - self.offset)
        hidden = self.step(self.cache, sequence[:, kept + 1: count + 1], self.features[:, kept:count],
                           compiled=self.compiled)[:, -1:]
        self.forwards += 1
        self.true_positions, self.tokens = count, sequence
        return hidden

    def _logits(self, hidden: Tensor) -> Tensor:
        """Draft logits of the head's outputs [..., H]: over the draft vocabulary, or the shared V columns."""
        logits = self._head_logits(hidden)
        return logits if self.vocab is not None else logits[..., : self.vocab_size]

    def _tree(self, root_hidden: Tensor, shape: tuple[int, int, int], sampling: Sampling,
              distributions: bool = True) -> Draft:
        """An EAGLE-2 dynamic tree below the newest token (see the class docstring); its nodes' distributions
        kept where ``distributions`` (the rule reads them).

        It is grown on the device and not read there: which nodes each level expands and their children, then the
        nodes kept and the tree's shape (``GrownShape``), from which the engine lays out the verification there;
        the shape reaches the host with the step's outcome, in the step's one read. (A read at every level waited
        for every head call in turn, and on a GPU a read waits for everything queued.) So every level expands
        ``top_k`` nodes and gives each ``top_k`` children, in a fixed layout (``_layout``): the root's children are
        nodes 0 .. k - 1, and level l's children (l = 2 .. depth) come k x k at a time, expanded node by expanded
        node, likeliest child first. A child of probability 0 (a sampling filter's) gets the score -inf, and so do
        its children; under a filter, how many nodes are left is read, so that none of them is kept.

        Where the head's calls run through CUDA graphs, a whole tree's growth (its levels' head calls and every
        choice between them) is one more, captured per tree shape and head cache (``HeadStep.trees``) once that
        shape has been grown twice without (a capture costs more than a growth). On an H200 a tree step took 6.9 ms
        against the target pass's 1.1-1.3, most of it the host launching a few hundred small operations while the
        GPU waited; with the growth captured, 5.8 ms."""
        total, max_depth, top_k = shape
        device = root_hidden.device
        base = self.cache.get_seq_length()  # head positions from true features; tree nodes go after them
        k = min(top_k, len(self.vocab) if self.vocab is not None else self.vocab_size)
        count = k + (max_depth - 1) * k * k
        n = min(total, count)
        layout = _layout(k, max_depth, device)
        filtered = k > 1 and bool(sampling.top_k or sampling.top_p < 1)
        graphs = getattr(self.step, "trees", None)
        captured = graphs is not None and self.compiled and k > 1 and max_depth > 1 and not filtered
        if captured:
            self.cache.make_room(base + (max_depth - 2) * k + next((w for w in WIDTHS if w >= k), k))
            key = (k, max_depth, n, distributions, sampling.greedy, sampling.temperature, self.vocab_size)
            # (the cache's tensors are arguments so that a graph is captured per cache)
            arguments = (root_hidden, upload([base], device), self.cache.keys, self.cache.values)
            captured = graphs.ready(key, arguments)
        if captured:
            def grow(hidden: Tensor, start: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, ...]:
                found = self._levels(hidden, base, k, max_depth, sampling, layout, start)
                return self._select(*found, n, max_depth, layout, distributions)

            picked, _ = graphs(key, grow, arguments)
            picked = tuple(tensor.clone() for tensor in picked)  # (the next replay overwrites them)
            self.forwards += max_depth - 1
        else:
            tokens, scores, level_q, level_logits, expanded = self._levels(root_hidden, base, k, max_depth, sampling,
                                                                           layout)
            crop_to(self.cache, base)  # tree positions were computed from predictions: drop them
            if filtered:  # a filter may leave children of probability 0: not kept
                n = min(n, int((scores > -math.inf).sum()))  # (a read of the device, for such rows alone)
            if k == 1 or max_depth == 1:  # a chain of the likeliest tokens, or the root's likeliest children: known
                parents = torch.arange(-1, n - 1) if k == 1 else torch.full((n,), -1)
                if not distributions:
                    return Draft(tokens[:n], parents, vocab=self.vocab)
                blank = sum(map(len, level_q))  # (a leaf's row: zeros, after every pass's)
                rows = upload([0] + [1 + node if k == 1 and node < max_depth - 1 else blank for node in range(n)],
                              device)
                return Draft(tokens[:n], parents, *_rows(level_q, level_logits, rows), self.vocab, sampled=False)
            picked = self._select(tokens, scores, level_q, level_logits, expanded, n, max_depth, layout,
                                  distributions)
        tokens, grown = picked[0], GrownShape(*picked[1:4], k)
        if not distributions:
            return Draft(tokens, None, vocab=self.vocab, grown=grown)
        return Draft(tokens, None, *picked[4:], self.vocab, sampled=False, grown=grown)

    def _levels(self, root_hidden: Tensor, base: int, k: int, max_depth: int, sampling: Sampling, layout: "_Layout",
                start: Tensor | None = None) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """A tree's levels, as ``_tree`` grows them: every node's token and score (its log confidence), in the
        layout's order; each head pass's q and logits (the root's, then each level's expanded nodes'); and each
        level's expanded nodes, as places in the frontier. The head's calls write at ``base`` on, or at ``start``
        (a tensor on the device, inside a capture: see ``HeadStep``), where the cache's length then stays."""
        device = root_hidden.device
        root_logits = self._logits(root_hidden[:, -1])[0]
        root_q = sampling.probs(root_logits)
        level_logits, level_q = [root_logits[None]], [root_q[None]]
        values, ids = root_q.topk(k)
        scores = values.double().log()  # a node's log confidence: the sum of its path's draft log-probabilities
        tokens = self._target_ids(ids)
        found_scores, found_tokens, expanded = [scores], [tokens], []
        hidden = root_hidden[0, -1].expand(k, -1)  # the hidden state each frontier node's parent left
        own = torch.eye(k, dtype=torch.bool, device=device)
        seen = own  # which of the tree's positions in the head's cache each node expanded last saw (itself included)
        for level in range(2, max_depth + 1):
            # The likeliest k of the frontier (ties: the earlier drafted), fed to the head at once: each sees the true
            # positions, and of the tree's, the expanded nodes above it (its parent's row of ``seen``) and itself.
            if level > 2:  # (deeper nodes hang from the last pass's rows)
                chosen = scores.sort(descending=True, stable=True).indices[:k]
                parent_row = chosen // k
                seen, features = torch.cat([seen[parent_row], own], 1), hidden[parent_row]
                expanding = tokens[chosen]
            else:  # (the root's k children, likeliest first already, all hang from the root)
                chosen, features, expanding = layout.first, hidden, tokens
            if start is None:
                hidden = self.step(self.cache, expanding[None], features[None],
                                   upload([[base - 2 + level] * k], device), seen, compiled=self.compiled)[0]
                self.forwards += 1
            else:
                hidden = self.step(self.cache, expanding[None], features[None], (start + level - 2).expand(1, k),
                                   seen, compiled=True, start=start + (level - 2) * k)[0]
            logits = self._logits(hidden)
            probs = sampling.probs(logits)
            level_logits.append(logits)
            level_q.append(probs)
            values, ids = probs.topk(k)
            scores = ((scores[chosen] if level > 2 else scores)[:, None] + values.double().log()).flatten()
            tokens = self._target_ids(ids).flatten()
            expanded.append(chosen)
            found_scores.append(scores)
            found_tokens.append(tokens)
        return torch.cat(found_tokens), torch.cat(found_scores), level_q, level_logits, expanded

    @staticmethod
    def _select(tokens: Tensor, scores: Tensor, level_q: list[Tensor], level_logits: list[Tensor],
                expanded: list[Tensor], n: int, max_depth: int, layout: "_Layout",
                distributions: bool) -> tuple[Tensor, ...]:
        """The ``n`` nodes a tree keeps of ``_levels``' (of ``max_depth`` > 1 levels of k > 1 children): their
        tokens, parents, ancestors and depths (``GrownShape``'s), and where ``distributions``, their q and logits
        rows, the root's first. The likeliest n nodes (ties: the earlier drafted): no child is likelier than its
        parent, which was drafted before it, so they hold their ancestors. Laid out by depth, then likelihood."""
        count, device = tokens.shape[0], tokens.device
        ranked = scores.sort(descending=True, stable=True).indices[:n]
        order = ranked[layout.depth[ranked].sort(stable=True).indices]
        expanded_nodes = layout.frontier + torch.cat(expanded)  # each level's expanded nodes, as nodes
        # each node's parent, as a node (the root's children: ``count``, a node past the tree, its own parent)
        up = torch.cat([torch.where(layout.top, count, expanded_nodes[layout.parent]), layout.past])
        lines = [order]
        for _ in range(max_depth - 1):
            lines.append(up[lines[-1]])
        lineage = torch.stack(lines, 1)  # [n, depth]: each kept node, its parent, its parent's, ...
        ancestors = (lineage[:, :, None] == order).any(1)
        is_parent = lineage[:, 1:2] == order
        parents = torch.where(is_parent.any(1), is_parent.int().argmax(1), -1)
        shape = (tokens[order], parents, ancestors, layout.depth[order])
        if not distributions:
            return shape
        blank = sum(map(len, level_q))  # (a leaf's row: zeros, after every pass's)
        row_of = torch.full((count,), blank, dtype=torch.long, device=device)  # an expanded node's row of level_q
        row_of[expanded_nodes] = torch.arange(1, 1 + expanded_nodes.shape[0], device=device)
        rows = torch.cat([row_of.new_zeros(1), row_of[order]])
        return shape + _rows(level_q, level_logits, rows)

    def _target_ids(self, ids: Tensor) -> Tensor:
        """Draft ids (of the head's logits) as target ids."""
        return self.vocab.to_target(ids) if self.vocab is not None else ids


def _rows(level_q: list[Tensor], level_logits: list[Tensor], rows: Tensor) -> tuple[Tensor, Tensor]:
    """The q and logits rows ``rows`` of a tree's head passes (each pass's [1 or k, V] stacked; a leaf's row, past
    them all: zeros), gathered at once."""
    zeros = level_q[0].new_zeros(1, level_q[0].shape[-1])
    return tuple(torch.cat([*found, zeros]).float().index_select(0, rows) for found in (level_q, level_logits))


@dataclass(frozen=True)
class _Layout:
    """Where each node of an EAGLE-2 tree grown on the device sits (``EagleDrafter._tree``), for trees of k children a
    node and ``depth`` levels: each node's ``depth`` [count], and whether it is a child of the root (``top``); its
    ``parent`` [count], as the place among the levels' expanded nodes (as they are listed, k a level) of the one it
    hangs from (0 for the root's children); where the frontier each expanded node was chosen from begins
    (``frontier`` [(depth - 1) k]); ``past`` ([count]: the node past the tree's, which stands for the root); and
    ``first`` (0 .. k - 1: the root's children, all of which the first level expands)."""

    depth: Tensor
    top: Tensor
    parent: Tensor
    frontier: Tensor
    past: Tensor
    first: Tensor


@functools.cache
def _layout(k: int, depth: int, device: torch.device) -> _Layout:
    count = k + (depth - 1) * k * k
    depths = [1] * k + [2 + (node - k) // (k * k) for node in range(k, count)]
    parents = [0] * k + [(node - k) // k for node in range(k, count)]
    frontiers = [k + k * k * (level - 1) if level else 0 for level in range(depth - 1) for _ in range(k)]
    made = [torch.tensor(values, dtype=torch.long, device=device)
            for values in (depths, parents, frontiers, [count], range(k))]
    return _Layout(made[0], made[0] == 1, *made[1:])
