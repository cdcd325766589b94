"""Acceptance rules: which drafted tokens to keep, and which token comes next.

Shapes, for a batch of ``B`` rows with ``k`` drafted tokens each (``k`` may be 0):

- ``tokens``: ``[B, k]`` drafted tokens x_1..x_k;
- ``q``: ``[B, k, V]`` the draft's distributions that x_i was drawn from, or None when the
  drafter chose each x_i deterministically (prompt lookup): q_i is then certain of x_i, and the
  rules use that point mass without building it;
- ``p``: ``[B, k + 1, V]`` the target's distributions at the same positions, plus
  one more after x_k (for the bonus token);
- ``d``: ``[B, k]`` divergences D(p_i, q_i) (only the fuzzy rules read it).

Every rule returns ``(accepted, next_token)``, both ``[B]``: the number of
leading drafts kept, and the token emitted after them (a correction at the
first rejected position, or a bonus token from p_{k+1} when all ``k`` are kept).
So each call yields ``accepted + 1`` tokens per row.

Greedy mode (``greedy=True``) uses no random numbers: the target "samples" by
argmax. Sampling mode draws from ``generator``; ``sd`` and ``fsd_hybrid`` draw
the same numbers in the same order, which is what makes ``fsd_hybrid`` at
T = 0 reproduce ``sd`` exactly under one seed.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .sampling import sample

Verdict = tuple[Tensor, Tensor]


def leading_accepted(accept: Tensor) -> Tensor:
    """Length of the run of True at the start of each row of ``accept`` ([B, k] -> [B])."""
    return accept.long().cumprod(-1).sum(-1)


def _at(dist: Tensor, position: Tensor) -> Tensor:
    """Row b of the result is dist[b, position[b]]: [B, n, V], [B] -> [B, V]."""
    index = position.view(-1, 1, 1).expand(-1, 1, dist.shape[-1])
    return dist.gather(1, index).squeeze(1)


def _residual(tokens: Tensor, p: Tensor, q: Tensor | None, position: Tensor) -> Tensor:
    """max(0, p_n - q_n) at each row's position n, with q_{k+1} taken as 0 (so the bonus is p_{k+1}).

    Unnormalised (sampling normalises). If it is all zero, which exact
    arithmetic rules out whenever SD rejected, p_n is returned instead.
    A point mass q_n leaves p_n with the drafted token x_n removed.
    """
    p_n = _at(p, position)
    if q is None:
        k = tokens.shape[1]
        rejected = position < k
        drafted = tokens.gather(1, position.clamp_max(max(k - 1, 0)).view(-1, 1)) if k else position.view(-1, 1)
        residual = p_n.scatter(1, drafted, 0.0) if k else p_n
        residual = torch.where(rejected.view(-1, 1), residual, p_n)
    else:
        q_padded = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[-1])], 1)
        residual = (p_n - _at(q_padded, position)).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p_n, residual)


def _sd_test(tokens: Tensor, p: Tensor, q: Tensor | None, generator: torch.Generator | None) -> Tensor:
    """Bernoulli(min(1, p_i(x_i) / q_i(x_i))) for every draft, as u * q_i(x_i) <= p_i(x_i)."""
    k = tokens.shape[1]
    p_x = p[:, :k].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) if q is not None else torch.ones_like(p_x)
    u = torch.rand(tokens.shape, generator=generator, device=tokens.device) if k else p_x
    return u * q_x <= p_x


def _greedy_match(tokens: Tensor, p: Tensor) -> Tensor:
    return tokens == p[:, : tokens.shape[1]].argmax(-1)


def sd(tokens: Tensor, p: Tensor, q: Tensor | None, d: Tensor | None, threshold: float,
       greedy: bool, generator: torch.Generator | None = None) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023); lossless.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection n emit a draw from normalize(max(0, p_n - q_n)); if all k are
    accepted emit a draw from p_{k+1}. The emitted tokens are distributed
    exactly as the target's own samples. Greedy: accept while x_i = argmax p_i,
    then emit argmax p_n. ``d`` and ``threshold`` are ignored.
    """
    if greedy:
        accepted = leading_accepted(_greedy_match(tokens, p))
        return accepted, _at(p, accepted).argmax(-1)
    accepted = leading_accepted(_sd_test(tokens, p, q, generator))
    return accepted, sample(_residual(tokens, p, q, accepted), generator)


def fsd(tokens: Tensor, p: Tensor, q: Tensor | None, d: Tensor, threshold: float,
        greedy: bool, generator: torch.Generator | None = None) -> Verdict:
    """Fuzzy speculative decoding (Holsman, Huang & Dhingra 2025), the paper's rule.

    Accept x_i iff D(p_i, q_i) <= T, deterministically; at the first position n
    with D > T emit a draw from p_n itself (argmax p_n in greedy mode); if all
    k are accepted emit a draw from p_{k+1}. Not lossless: T trades the target's
    quality for the draft's speed. T = inf accepts every draft.
    """
    accepted = leading_accepted(d <= threshold)
    p_n = _at(p, accepted)
    return accepted, p_n.argmax(-1) if greedy else sample(p_n, generator)


def fsd_hybrid(tokens: Tensor, p: Tensor, q: Tensor | None, d: Tensor, threshold: float,
               greedy: bool, generator: torch.Generator | None = None) -> Verdict:
    """SD's test, relaxed: accept x_i if SD accepts it OR D(p_i, q_i) <= T.

    At the first position n that fails both, emit a draw from SD's residual
    normalize(max(0, p_n - q_n)) (argmax p_n in greedy mode); bonus from p_{k+1}.
    T = 0 gives exactly ``sd`` (the relaxed test is skipped there, so no rounding of D can matter).
    """
    # At T = 0 the relaxation adds nothing by definition, not merely up to rounding: exactly sd.
    relaxed = (d <= threshold) if threshold > 0 else torch.zeros_like(tokens, dtype=torch.bool)
    if greedy:
        accepted = leading_accepted(_greedy_match(tokens, p) | relaxed)
        return accepted, _at(p, accepted).argmax(-1)
    accepted = leading_accepted(_sd_test(tokens, p, q, generator) | relaxed)
    return accepted, sample(_residual(tokens, p, q, accepted), generator)


Rule = Callable[[Tensor, Tensor, Tensor | None, Tensor | None, float, bool, torch.Generator | None], Verdict]

RULES: dict[str, Rule] = {"sd": sd, "fsd": fsd, "fsd-hybrid": fsd_hybrid}
