"""Reference-free quality of generated text: what the target thinks of it, and how far it strays
from the target's own greedy output. Neither needs a labelled dataset, so they apply to any prompt."""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.scoring import log_probs, target_logits, token_logprobs


def target_nll(target: torch.nn.Module, prompt_ids: Tensor, tokens: list[int], vocab_size: int | None = None
               ) -> float | None:
    """The target's mean negative log-likelihood (nats per token) of ``tokens`` after ``prompt_ids`` ([1, L]),
    teacher-forced in one pass; None for an empty completion. Lower means closer to what the target would
    write itself; it is a quality proxy, not a correctness measure."""
    if not tokens:
        return None
    full = torch.cat([prompt_ids, torch.tensor([tokens], device=prompt_ids.device)], 1)
    scored = token_logprobs(log_probs(target_logits(target, full, prompt_ids.shape[1], vocab_size)), tokens)
    return -sum(value for _, value, _ in scored) / len(tokens)


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """The index of the first token where ``tokens`` and ``reference`` differ (the common length when
    one is a prefix of the other and both are equal up to it)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def greedy_agreement(tokens: list[int], reference: list[int]) -> dict[str, float]:
    """``exact_match``: 1.0 when the completion equals the target's greedy output token for token;
    ``first_diff``: the position of the first difference (in tokens)."""
    return {"exact_match": float(tokens == reference), "first_diff": float(first_difference(tokens, reference))}
