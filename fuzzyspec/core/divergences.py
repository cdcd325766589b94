"""Divergences between the target's and the draft's next-token distributions.

Every function takes probability tensors ``p`` (target) and ``q`` (draft) of
shape ``[..., V]`` and returns one non-negative float32 value per position,
shape ``[...]``. ``divergence`` computes in float64 whatever the input dtype:
in float32, JS and KL of two distinct but nearly equal distributions round to
exactly 0, and a rule would take them for equal.

Zeros: ``0 * log 0`` counts as 0. A term ``a * log(a / b)`` with ``a > 0`` and
``b = 0`` is infinite in exact arithmetic; here such a zero ``b`` is replaced by
``EPS`` (1e-10), so the term is large (about 23 nats per unit of mass) but
finite. Only zeros are replaced: a tiny positive ``b`` keeps its exact value. No
NaN or inf ever comes out, so a threshold test never sees one.

Truncated forms (``topk_*``, ``topp_*``) keep the target's most likely tokens
(the top ``top_k``, or the smallest set holding ``top_p`` of the target's mass)
and pool everything else of each distribution into one extra bucket, without
renormalising, then apply the base divergence to those ``n + 1`` bins.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..options import OptionError

EPS = 1e-10


def _xlogy_ratio(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise a * log(a / b), 0 where a == 0; a zero b counts as EPS."""
    return torch.xlogy(a, a) - torch.xlogy(a, torch.where(b > 0, b, EPS))


def kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(a || b) = sum_v a(v) log(a(v) / b(v)).

    Summed as a log(a / b) - a + b, which equals it for normalised a and b and is non-negative term by
    term: distributions that sum to 1 only up to rounding then give a tiny positive KL, never a
    negative one clamped to 0."""
    return (_xlogy_ratio(a, b) - a + b).sum(-1).clamp_min(0)


def kl_pq(p: Tensor, q: Tensor) -> Tensor:
    """KL(p || q): the target relative to the draft."""
    return kl(p, q)


def kl_qp(p: Tensor, q: Tensor) -> Tensor:
    """KL(q || p): the draft relative to the target."""
    return kl(q, p)


def _entropy(a: Tensor) -> Tensor:
    return torch.special.entr(a).sum(-1)


def js(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon: 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2; in [0, ln 2].

    Computed as H(m) - (H(p) + H(q)) / 2 (H the entropy), the same quantity with
    half the work: this runs once per drafted token.
    """
    m = 0.5 * (p + q)
    return (_entropy(m) - 0.5 * (_entropy(p) + _entropy(q))).clamp(0, math.log(2))


def js_legacy(p: Tensor, q: Tensor) -> Tensor:
    """0.5 KL(m || p) + 0.5 KL(m || q), m = (p + q) / 2.

    What the FSD reference code computed under the name ``js_div``; kept so its
    published thresholds can be reproduced. Unbounded, unlike ``js``.
    """
    m = 0.5 * (p + q)
    return 0.5 * (kl(m, p) + kl(m, q))


def tv(p: Tensor, q: Tensor) -> Tensor:
    """Total variation: 0.5 sum_v |p(v) - q(v)|; in [0, 1]."""
    return (0.5 * (p - q).abs().sum(-1)).clamp(0, 1)


def hellinger(p: Tensor, q: Tensor) -> Tensor:
    """Hellinger: sqrt(0.5 sum_v (sqrt p(v) - sqrt q(v))^2); in [0, 1]."""
    return (0.5 * (p.sqrt() - q.sqrt()).square().sum(-1)).clamp(0, 1).sqrt()


BASE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "kl_pq": kl_pq,
    "kl_qp": kl_qp,
    "js": js,
    "js_legacy": js_legacy,
    "tv": tv,
    "hellinger": hellinger,
}

# The FSD reference code's names, mapped to what that code actually computed.
ALIASES: dict[str, str] = {
    "kl_div": "kl_qp",
    "kl_div_reversed": "kl_pq",
    "js_div": "js_legacy",
    "tv_div": "tv",
    "top_k_kl_div": "topk_kl_qp",
    "top_k_js_div": "topk_js_legacy",
    "top_k_tv_div": "topk_tv",
}

NAMES: tuple[str, ...] = tuple(
    [*BASE] + [f"topk_{n}" for n in BASE] + [f"topp_{n}" for n in BASE]
)


def canonical_name(kind: str) -> str:
    """Resolve an alias; raise OptionError (a ValueError) listing the valid names for an unknown one."""
    name = ALIASES.get(kind, kind)
    if name not in NAMES:
        valid = ", ".join([*NAMES, *ALIASES])
        raise OptionError("divergence", f"{kind!r} is unknown; valid: {valid}")
    return name


def _bucketed(p: Tensor, q: Tensor, top_k: int | None, top_p: float | None) -> tuple[Tensor, Tensor]:
    """Keep the target's top tokens and pool each distribution's rest into one bucket."""
    if top_k is not None:
        index = p.topk(min(top_k, p.shape[-1]), dim=-1).indices
        keep = torch.ones_like(index, dtype=torch.bool)
    else:
        p_sorted, index = p.sort(dim=-1, descending=True)
        # A token is kept while the mass before it is below top_p; the first one always is.
        keep = (p_sorted.cumsum(-1) - p_sorted) < top_p
    p_kept = p.gather(-1, index) * keep
    q_kept = q.gather(-1, index) * keep
    p_rest = (1 - p_kept.sum(-1, keepdim=True)).clamp_min(0)
    q_rest = (1 - q_kept.sum(-1, keepdim=True)).clamp_min(0)
    return torch.cat([p_kept, p_rest], -1), torch.cat([q_kept, q_rest], -1)


def _log(a: Tensor) -> Tensor:
    return torch.where(a > 0, a, EPS).log()


def _point_kl_pq(p: Tensor, at: Tensor) -> Tensor:
    # sum_{v != x} p_v log(p_v / EPS) + p_x log p_x, with the EPS floor that ``kl`` applies to q's zeros
    return (torch.xlogy(p, p).sum(-1) - math.log(EPS) * (1 - at)).clamp_min(0)


def _point_js(p: Tensor, at: Tensor) -> Tensor:
    # H(m) - H(p) / 2 with m = (p + point) / 2: only the drafted token's term differs from p / 2
    half = 0.5 * (1 + at)
    return (0.5 * torch.xlogy(at, at) + 0.5 * math.log(2) * (1 - at) - torch.xlogy(half, half)).clamp(0, math.log(2))


def _point_js_legacy(p: Tensor, at: Tensor) -> Tensor:
    # 0.5 KL(m || p) + 0.5 KL(m || point), m = (p + point) / 2, split into the drafted token and the rest
    half = 0.5 * (1 + at)
    rest_entropy_terms = torch.xlogy(p, p).sum(-1) - torch.xlogy(at, at)  # sum_{v != x} p_v log p_v
    to_p = -0.5 * math.log(2) * (1 - at) + half * (half.log() - _log(at))
    to_point = 0.5 * rest_entropy_terms - 0.5 * (1 - at) * (math.log(2) + math.log(EPS)) + half * half.log()
    return (0.5 * (to_p + to_point)).clamp_min(0)


POINT: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "kl_pq": _point_kl_pq,
    "kl_qp": lambda p, at: -_log(at),
    "js": _point_js,
    "js_legacy": _point_js_legacy,
    "tv": lambda p, at: (1 - at).clamp(0, 1),
    "hellinger": lambda p, at: (1 - at.sqrt()).clamp(0, 1).sqrt(),
}


def point_divergence(p: Tensor, tokens: Tensor, kind: str = "js", *, top_k: int = 50, top_p: float = 0.9) -> Tensor:
    """D(p, q) where q is certain of ``tokens`` ([...]): what a deterministic drafter (prompt lookup, a
    tree's top-k choice) proposes. Equals ``divergence(p, one_hot(tokens))`` without building the one-hot."""
    name = canonical_name(kind)
    p = p.double()
    if name.startswith(("topk_", "topp_")):
        # Bucketing keeps p's top tokens and pools the rest: the point mass lands on the drafted token's
        # kept bucket, or on the pooled one.
        if name.startswith("topk_"):
            if top_k < 1:
                raise ValueError(f"top_k must be >= 1, got {top_k}")
            index = p.topk(min(top_k, p.shape[-1]), dim=-1).indices
            keep = torch.ones_like(index, dtype=torch.bool)
        else:
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {top_p}")
            p_sorted, index = p.sort(dim=-1, descending=True)
            keep = (p_sorted.cumsum(-1) - p_sorted) < top_p
        p_kept = p.gather(-1, index) * keep
        p = torch.cat([p_kept, (1 - p_kept.sum(-1, keepdim=True)).clamp_min(0)], -1)
        hit = (index == tokens.unsqueeze(-1)) & keep
        tokens = torch.where(hit.any(-1), hit.long().argmax(-1), torch.full_like(tokens, p.shape[-1] - 1))
        name = name[5:]
    at = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return POINT[name](p, at).float()


def divergence(p: Tensor, q: Tensor, kind: str = "js", *, top_k: int = 50, top_p: float = 0.9) -> Tensor:
    """D(p, q) per position: ``p``, ``q`` are ``[..., V]`` probabilities, the result is ``[...]`` float32.

    ``kind`` is a name from ``NAMES`` or an alias from ``ALIASES``; ``top_k`` and
    ``top_p`` set the truncation of the ``topk_*`` and ``topp_*`` forms.
    """
    name = canonical_name(kind)
    p, q = p.double(), q.double()
    if name.startswith("topk_"):
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        p, q = _bucketed(p, q, top_k, None)
        name = name[5:]
    elif name.startswith("topp_"):
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        p, q = _bucketed(p, q, None, top_p)
        name = name[5:]
    return BASE[name](p, q).float()
