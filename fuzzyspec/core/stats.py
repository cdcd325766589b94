"""Per-call decoding statistics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass
class Stats:
    """Counters for one ``decode`` call.

    target_forwards counts every target pass (the first one also reads the
    prompt), so ``mean_accepted`` = new_tokens / target_forwards is the mean
    number of tokens each target pass yields (accepted drafts + 1; 1 for AR).
    ``position_acceptance[i]`` is the rate at which draft i + 1 was accepted among
    the steps where it was proposed and every draft before it was accepted.
    ``accept_s`` is the time spent in the divergence and the acceptance rule.
    """

    method: str = ""
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    cached_tokens: int = 0  # the prompt's first positions an earlier row left in the cache (not computed again)
    proposed: int = 0
    accepted: int = 0
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    divergences: list[Tensor] = field(default_factory=list)
    wall_s: float = 0.0
    first_token_s: float = 0.0
    accept_s: float = 0.0

    def record_step(self, proposed: int, accepted: int, d: Tensor | None) -> None:
        self.proposed += proposed
        self.accepted += accepted
        grow = proposed - len(self.reached_at)
        if grow > 0:
            self.reached_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(min(accepted + 1, proposed)):
            self.reached_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        if d is not None and d.numel():
            self.divergences.append(d.reshape(-1).float())  # left on the device: read when summarised

    @property
    def mean_accepted(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def position_acceptance(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted_at, self.reached_at) if r]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def divergence_quantiles(self) -> dict[str, float] | None:
        if not self.divergences:
            return None
        values = torch.cat([d.cpu() for d in self.divergences])
        qs = torch.quantile(values, torch.tensor(QUANTILES))
        return {f"q{int(q * 100)}": float(v) for q, v in zip(QUANTILES, qs)} | {"mean": float(values.mean())}

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "mean_accepted": self.mean_accepted,
            "acceptance_rate": self.acceptance_rate,
            "position_acceptance": self.position_acceptance,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "divergence_quantiles": self.divergence_quantiles(),
            "wall_s": self.wall_s,
            "first_token_s": self.first_token_s,
            "accept_s": self.accept_s,
            "tokens_per_s": self.tokens_per_s,
        }
