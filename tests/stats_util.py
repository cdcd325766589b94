"""A chi-square goodness-of-fit test without SciPy."""
from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed ``counts`` under ``probs``; cells with expected count < 5 are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    statistic = ((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), statistic / 2))


def two_token_check(target, prompt: torch.Tensor, run, runs: int = 1500, sampling=None) -> tuple[float, int]:
    """Decode two tokens ``runs`` times (``run(seed)`` -> (tokens [1, 2], stats)) and compare their joint
    distribution with the target's own p(t1) p(t2 | t1) over its vocabulary, under ``sampling``'s processing
    (default: the softmax alone): (chi-square p-value, drafts accepted in all)."""
    vocab = target.config.vocab_size
    probs = sampling.probs if sampling is not None else (lambda logits: logits.softmax(-1))
    with torch.no_grad():
        p1 = probs(target(prompt).logits[0, -1])
        following = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab).view(vocab, 1)], 1)
        p2 = probs(target(following).logits[:, -1])
    counts, accepted = torch.zeros(vocab, vocab), 0
    for seed in range(runs):
        tokens, stats = run(seed)
        counts[tokens[0, 0], tokens[0, 1]] += 1
        accepted += stats.accepted
    return chi_square_p_value(counts, p1[:, None] * p2), accepted
