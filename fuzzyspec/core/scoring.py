"""The target's log-probabilities of given tokens: for quality (NLL), lm-eval likelihoods, and the
log-probabilities a server reports. Written once, so all of them read the same numbers."""
from __future__ import annotations

import torch
from torch import Tensor

from .sampling import Sampling

TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # (token, log p(token), top alternatives)


@torch.inference_mode()
def target_logits(target: torch.nn.Module, ids: Tensor, first: int, vocab_size: int | None = None) -> Tensor:
    """One teacher-forced pass over ``ids`` ([1, L]): the logits [L - first, V] that predicted tokens
    ``first .. L - 1`` (``first`` >= 1), cut to ``vocab_size`` columns."""
    count = ids.shape[1] - first
    logits = target(input_ids=ids[:, :-1], logits_to_keep=count).logits[0, -count:]
    return logits[:, :vocab_size] if vocab_size is not None else logits


def log_probs(logits: Tensor, sampling: Sampling | None = None) -> Tensor:
    """Log-probabilities (float32) of the raw softmax, or under ``sampling``'s processing (temperature,
    top-k, top-p; a token those filter out gets a very negative, finite value)."""
    if sampling is None:
        return torch.log_softmax(logits.float(), -1)
    return sampling.probs(logits).clamp_min(1e-45).log()


def token_logprobs(log_p: Tensor, tokens: list[int], top: int = 0) -> list[TokenLogprob]:
    """Each token's log-probability under row i of ``log_p`` ([n, V]) and the ``top`` likeliest tokens there."""
    best = log_p.topk(top) if top else None
    picked = log_p.gather(-1, torch.tensor(tokens, device=log_p.device)[:, None])[:, 0].tolist()
    return [(token, value, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i, (token, value) in enumerate(zip(tokens, picked))]
