"""Draft trees: verifying many candidate continuations in one target pass.

A tree hangs below the root, the newest accepted token. Node i holds a token,
the index of its parent (-1: a child of the root) and its depth (1 for the
root's children). Nodes are numbered so that a parent comes before its children.

One target pass scores every node: each node attends to the cached prefix,
to the tokens fed before the tree (the root among them) and to its own
ancestors, and sits at position root + depth. Afterwards the cache keeps
only the accepted path (``keep_path``), so nothing is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from .vocab import DraftVocab


@dataclass
class Tree:
    tokens: Tensor  # [n] long
    parents: Tensor  # [n] long, -1 for the root's children; parents[i] < i

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.parents.shape != (n,) or bool((self.parents >= torch.arange(n, device=self.parents.device)).any()):
            raise ValueError("a tree needs one parent per node, each parent numbered before its child")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth(self) -> Tensor:
        """[n] depth of each node (1 for the root's children)."""
        depth = torch.zeros_like(self.parents)
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return depth

    def ancestors(self) -> Tensor:
        """[n, n] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool, device=self.parents.device)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


@dataclass
class TreeProposal:
    """``tree``: the drafted nodes; ``q`` [n + 1, N]: the draft distribution at the root (row 0)
    and at each node (row i + 1; zeros for nodes that were not expanded). With a reduced draft
    vocabulary (``vocab``) the N columns are its tokens; ``full`` widens to the target's."""

    tree: Tree
    q: Tensor
    logits: Tensor  # [n + 1, N] the draft's raw logits behind q (zeros where q is)
    vocab: DraftVocab | None = None

    def full(self) -> tuple[Tensor, Tensor]:
        """(logits, q) over the target's vocabulary: -inf and 0 outside a reduced draft vocabulary."""
        if self.vocab is None:
            return self.logits, self.q
        return self.vocab.expand(self.logits, float("-inf")), self.vocab.expand(self.q)


def tree_inputs(tree: Tree, cached: int, feed_len: int) -> tuple[Tensor, Tensor]:
    """The 4D attention mask [1, 1, q, cached + q] (True: may attend) and position ids [1, q] for
    one pass over ``feed_len`` ordinary tokens (ending with the root) followed by the tree's nodes."""
    n, device = len(tree), tree.parents.device
    q = feed_len + n
    mask = torch.zeros(q, cached + q, dtype=torch.bool, device=device)
    mask[:, :cached] = True
    mask[:feed_len, cached:cached + feed_len] = torch.ones(feed_len, feed_len, dtype=torch.bool,
                                                            device=device).tril()
    mask[feed_len:, cached:cached + feed_len] = True
    mask[feed_len:, cached + feed_len:] = tree.ancestors()
    root_position = cached + feed_len - 1
    positions = torch.cat([torch.arange(cached, cached + feed_len, device=device), root_position + tree.depth])
    return mask[None, None], positions[None]


def model_mask(model: torch.nn.Module, allowed: Tensor) -> Tensor:
    """A 4D mask ``allowed`` (True: may attend) in the form ``model``'s attention takes it: as it is for
    SDPA, additive for eager attention (which would add a boolean mask to the scores, masking nothing)."""
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    raise ValueError(f"trees and batching need custom attention masks, which {implementation!r} attention does "
                     "not take: load the model with attn_implementation='sdpa' or 'eager'")


def tree_forward(model: torch.nn.Module, cache: DynamicCache, feed: Tensor, tree: Tree) -> Tensor:
    """Logits [1, feed_len + n, V] of the ordinary tokens ``feed`` ([1, m], ending with the root)
    and of every tree node, from one pass; the cache grows by m + n positions."""
    cached = cache.get_seq_length()
    mask, positions = tree_inputs(tree, cached, feed.shape[1])
    tokens = torch.cat([feed, tree.tokens[None]], 1)
    return model(input_ids=tokens, attention_mask=model_mask(model, mask), position_ids=positions,
                 past_key_values=cache, use_cache=True).logits


def keep_path(cache: DynamicCache, base: int, path: list[int]) -> None:
    """Keep the first ``base`` cache positions and the tree nodes ``path`` (indices into the nodes,
    which start at position ``base``), in that order; drop the other nodes."""
    index = torch.tensor(list(range(base)) + [base + i for i in path], dtype=torch.long)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
        layer.values = layer.values.index_select(-2, index.to(layer.values.device))
