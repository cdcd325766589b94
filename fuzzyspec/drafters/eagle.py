"""The EAGLE drafter: chains or EAGLE-2 dynamic trees from an EAGLE head (EAGLE-1/2 or EAGLE-3), fed the
target's features."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..core.draft import BaseDrafter, Budget, Draft
from ..core.host import upload
from ..core.kvcache import common_prefix, crop_to
from ..core.sampling import Sampling
from ..core.vocab import reduced_lm_head
from ..train.config import trained_length
from .chain import draft_chain
from .eagle3 import Eagle3Head, is_eagle3, load_eagle3
from .eagle_head import EagleHead, load_head
from .head_step import head_step

Head = EagleHead | Eagle3Head


def load_any_head(folder: str | Path, target: PreTrainedModel) -> Head:
    """An EAGLE-3 head or an EAGLE-1/2 head, whichever layout ``folder`` holds, its ``window`` set
    (``trained_length``)."""
    head = load_eagle3(folder, target) if is_eagle3(folder) else load_head(folder, target)
    head.window = trained_length(folder)
    return head


def head_logits(head: Head, target: PreTrainedModel) -> Callable[[Tensor], Tensor]:
    """How a head's outputs become draft logits (float32): an EAGLE-3 head's own LM head; an EAGLE-1/2
    head's predicted features through the target's LM head, only its draft vocabulary's rows when it has
    one (so a draft step reads N rows, not V). Made once per loaded head, shared by its drafters."""
    if isinstance(head, Eagle3Head):
        return head.logits
    lm_head = target.get_output_embeddings()
    if head.vocab is not None:
        lm_head = reduced_lm_head(lm_head, head.vocab)
    return lambda out: lm_head(out).float()


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
            return self._tree(sequence, hidden, budget.tree, sampling, budget.distributions)

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

    def _tree(self, sequence: Tensor, root_hidden: Tensor, shape: tuple[int, int, int], sampling: Sampling,
              distributions: bool = True) -> Draft:
        """An EAGLE-2 dynamic tree below the newest token (see the class docstring); its nodes' distributions
        kept where ``distributions`` (the rule reads them).

        It grows on the device: which nodes each level expands, and their children, are chosen there, and the
        whole tree is read once, at the end (a read at every level waited for the device at every head call, and
        on a GPU a read is a wait for everything queued). So every level expands ``top_k`` nodes and gives each
        ``top_k`` children, in a fixed layout: the root's children are nodes 0 .. k - 1, and level l's children
        (l = 2 .. depth) come k x k at a time, expanded node by expanded node, likeliest child first. A child of
        probability 0 (a sampling filter's) gets the score -inf: it is never kept, nor expanded but to fill a
        level, and its children are -inf too."""
        total, max_depth, top_k = shape
        device = root_hidden.device
        base = self.cache.get_seq_length()  # head positions from true features; tree nodes go after them
        root_logits = self._logits(root_hidden[:, -1])[0]
        root_q = sampling.probs(root_logits)
        k = min(top_k, root_q.shape[-1])
        # every head pass's logits and q, stacked at the end: row 0 the root's, then each level's expanded nodes
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
            chosen = scores.sort(descending=True, stable=True).indices[:k]
            if level > 2:  # (the root's children all hang from the root; deeper nodes from the last pass's rows)
                parent_row = chosen // k
                seen, features = torch.cat([seen[parent_row], own], 1), hidden[parent_row]
            else:
                features = hidden
            hidden = self.step(self.cache, tokens[chosen][None], features[None],
                               upload([[base - 2 + level] * k], device), seen, compiled=self.compiled)[0]
            self.forwards += 1
            logits = self._logits(hidden)
            probs = sampling.probs(logits)
            level_logits.append(logits)
            level_q.append(probs)
            values, ids = probs.topk(k)
            scores = (scores[chosen][:, None] + values.double().log()).flatten()
            tokens = self._target_ids(ids).flatten()
            expanded.append(chosen)
            found_scores.append(scores)
            found_tokens.append(tokens)
        crop_to(self.cache, base)  # tree positions were computed from predictions: drop them
        # the tree's one read: every node's score and token, and which of its frontier each level expanded (their
        # children come k x k after the root's, row by row: so each node's parent)
        read = torch.cat([torch.cat(found_scores), torch.cat(found_tokens).double(), *(
            [torch.cat(expanded).double()] if expanded else [])]).tolist()
        count = k + (max_depth - 1) * k * k
        node_scores, node_tokens = read[:count], read[count: 2 * count]
        frontiers = [0] + [k + k * k * level for level in range(max_depth - 2)]  # where each level's frontier began
        expanded_nodes = [frontiers[i // k] + int(node) for i, node in enumerate(read[2 * count:])]
        depth = [1] * k + [2 + (node - k) // (k * k) for node in range(k, count)]
        node_parents = [-1] * k + [expanded_nodes[(node - k) // k] for node in range(k, count)]
        row_of = {node: 1 + row for row, node in enumerate(expanded_nodes)}  # an expanded node's row of level_q

        kept = sorted((node for node in range(count) if node_scores[node] > -math.inf),
                      key=lambda node: -node_scores[node])[:total]
        kept_set = set(kept)
        for node in list(kept):  # ties aside a child never outranks its parent; make sure anyway
            while node_parents[node] >= 0 and node_parents[node] not in kept_set:
                node = node_parents[node]
                kept_set.add(node)
        order = sorted(sorted(kept_set), key=lambda node: (depth[node], -node_scores[node]))
        new_index = {node: i for i, node in enumerate(order)}
        tokens_kept = upload([int(node_tokens[node]) for node in order], device)
        parents_kept = torch.tensor([new_index.get(node_parents[node], -1) for node in order])
        if not distributions:
            return Draft(tokens_kept, parents_kept, vocab=self.vocab)
        # each kept node's row (a leaf's: zeros, after the last level), gathered at once rather than copied one by one
        blank = sum(map(len, level_q))
        rows = upload([0] + [row_of.get(node, blank) for node in order], root_q.device)
        zeros = root_q.new_zeros(1, root_q.shape[-1])
        q = torch.cat([*level_q, zeros]).float().index_select(0, rows)
        logits = torch.cat([*level_logits, zeros]).float().index_select(0, rows)
        return Draft(tokens_kept, parents_kept, q, logits, self.vocab, sampled=False)

    def _target_ids(self, ids: Tensor) -> Tensor:
        """Draft ids (of the head's logits) as target ids."""
        return self.vocab.to_target(ids) if self.vocab is not None else ids
