"""Attention that gives a query the same numbers whatever else is in its pass, on the CPU.

A step that verifies drafts scores a row's newest token and its drafts in one pass; AR scores one token a step.
PyTorch's attention (``scaled_dot_product_attention``) computes a query differently in the two (its blocking
and reductions follow the shapes), so a verification gave a token logits that differ in the last bits from a
one-token step's. With int4 weights the kernel rounds each token's activations to 8 bits, which turns such
last-bit differences into whole quanta: on the embedded model a 6-token chain's logits moved by up to 0.75, and
greedy ``sd`` left AR's text on 11 of 13 prompts (12 of them everyday ones).

``attend`` (``layer_kernel.cpp``) visits, for each query and head, the cached positions its mask allows in
increasing order: scores s_i = scale q.k_i, m = max s_i, p_i = exp(s_i - m), out = sum p_i v_i / sum p_i, each
sum in a fixed order (past 128 positions, in spans of equal size that a query's count of positions alone decides,
whose sums are combined in their order: threads share a long context's work that way). A drafted node's allowed
positions are the row's cache, then its ancestors and itself at increasing write positions: the keys and values, in the order, that AR sees for the same token once that path
is accepted. So the node gets AR's numbers bit for bit, in a chain or a tree. With the int4 kernel (which is
also batch-invariant), an int4 target's verification then gives every token exactly a one-token step's
logits, and greedy ``sd`` reproduces its AR text on every prompt tried (13 of 13).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import kernels


def runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``attend`` serves a model computing in ``dtype`` on ``device``: float32 on a CPU where our kernels
    run (elsewhere PyTorch's attention does)."""
    return device.type == "cpu" and dtype == torch.float32 and kernels.available()


def attend(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of ``query`` [B, k, heads, D] over a cache's ``keys`` and ``values`` [B, kv_heads, capacity, D]
    (float32, or float16 read as the floats it holds; their first B rows serve where they hold more), where ``mask``
    [B, 1, k, capacity] (bool) allows: [B, k, heads, D] in float32, each query's result independent of the rest of
    the pass (module docstring)."""
    return torch.ops.fuzzyspec_attention.attend(query, keys, values, mask, scale)
