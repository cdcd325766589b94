"""The decoding loop: draft, verify in one target pass, accept, roll back the caches.

``decode`` runs AR (no drafter), SD, FSD and FSD-hybrid alike: the rule is a
function from ``rules.RULES`` and the drafter anything with ``propose``. The
target keeps a KV cache of every token but the newest; each step feeds what
the cache lacks (the prompt at first, then the newest token) with the drafts,
and crops the cache back to what was accepted, so no prefix is recomputed. With
no drafts the first step is exactly Hugging Face's prefill.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from .divergences import canonical_name, divergence
from .drafters import Drafter, Proposal
from .kvcache import crop_to
from .rules import FUZZY, RULES
from .sampling import Sampling, raw_probs
from .stats import Stats

METHODS = ("ar", "sd", "fsd", "fsd-hybrid")
SCHEDULES = ("constant", "heuristic")


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how one sequence is decoded.

    method: ``ar``, ``sd``, ``fsd`` or ``fsd-hybrid``.
    gamma: drafts per step (the start value under the ``heuristic`` schedule,
        which adds 2 after a fully accepted step and takes 1 away otherwise).
    draft_confidence: stop drafting when the draft's top probability is below it.
    divergence, threshold: D and T of the fuzzy rules; ``divergence_top_k`` and
        ``divergence_top_p`` configure its truncated forms.
    raw_divergence: compute D on unprocessed softmax distributions, as the FSD
        reference code did, instead of on the processed ones.
    eos_token_ids: generation ends at the first of these (which is kept).
    """

    method: str = "fsd"
    gamma: int = 5
    gamma_schedule: str = "constant"
    draft_confidence: float = 0.0
    divergence: str = "js"
    threshold: float = 0.3
    divergence_top_k: int = 50
    divergence_top_p: float = 0.9
    raw_divergence: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = 128
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; valid: {', '.join(METHODS)}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if self.gamma_schedule not in SCHEDULES:
            raise ValueError(f"unknown gamma schedule {self.gamma_schedule!r}; valid: {', '.join(SCHEDULES)}")
        if not 0 <= self.draft_confidence <= 1:
            raise ValueError(f"draft confidence must be in [0, 1], got {self.draft_confidence}")
        canonical_name(self.divergence)
        if math.isnan(self.threshold) or self.threshold < 0:
            raise ValueError(f"threshold must be a number >= 0 (inf allowed), got {self.threshold}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def draft_only(self) -> bool:
        """FSD with T = inf accepts every draft: the target has nothing to decide."""
        return self.method == "fsd" and self.threshold == math.inf


Callback = Callable[[Tensor], bool]


def _divergences(config: DecodeConfig, logits: Tensor, p: Tensor, proposal: Proposal) -> Tensor:
    """D(p_i, q_i) at each drafted position, on processed or (``raw_divergence``) raw distributions."""
    k = proposal.tokens.shape[1]
    if config.raw_divergence:
        p, q = raw_probs(logits[:, :k]), raw_probs(proposal.logits)
    else:
        p, q = p[:, :k], proposal.probs
    return divergence(p, q, config.divergence, top_k=config.divergence_top_k, top_p=config.divergence_top_p)


@torch.inference_mode()
def decode(target: torch.nn.Module, drafter: Drafter | None, input_ids: Tensor, config: DecodeConfig,
           vocab_size: int, on_tokens: Callback | None = None) -> tuple[Tensor, Stats]:
    """Generate after ``input_ids`` ([1, L]); returns the new tokens ([1, n]) and statistics.

    ``on_tokens`` sees each step's new tokens ([1, m]) and may return True to
    stop (for stop strings). ``vocab_size`` is the shared vocabulary width:
    logit columns past it (padding rows) are dropped.
    """
    if input_ids.shape[0] != 1:
        raise ValueError("decode runs one sequence at a time (batch size 1)")
    if input_ids.shape[1] < 1:
        raise ValueError("the prompt must hold at least one token")
    if config.method != "ar" and drafter is None:
        raise ValueError(f"method {config.method!r} needs a draft model")
    if config.method == "ar":
        drafter = None
    rule = RULES["sd" if config.method == "ar" else config.method]
    fuzzy = config.method in FUZZY
    sampling = config.sampling
    generator = torch.Generator(device=input_ids.device)
    if config.seed is None:
        generator.seed()  # a fresh random seed for this generator only; torch's global one is untouched
    else:
        generator.manual_seed(config.seed)
    stats = Stats(method=config.method)
    if drafter is not None:
        drafter.reset()
        draft_forwards_before = drafter.forwards
    wants_features = getattr(drafter, "wants_target_features", False)
    no_drafts = Proposal.empty(1, vocab_size, input_ids.device)
    cache = DynamicCache()
    sequence, prompt_len, gamma = input_ids, input_ids.shape[1], config.gamma
    start = time.perf_counter()

    while (remaining := config.max_new_tokens - (sequence.shape[1] - prompt_len)) > 0:
        if config.draft_only:
            new = drafter.propose(sequence, min(gamma, remaining), sampling, generator).tokens
            stats.record_step(new.shape[1], new.shape[1], None)
        else:
            # At most remaining - 1 drafts: the step adds one target token after them.
            num = min(gamma, remaining - 1) if drafter is not None else 0
            proposal = drafter.propose(sequence, num, sampling, generator) if num else no_drafts
            drafts = proposal.tokens
            k = drafts.shape[1]
            # Feed what the cache lacks (the whole prompt at first, then the newest token) and the drafts.
            cached = cache.get_seq_length()
            feed = torch.cat([sequence[:, cached:], drafts], 1)
            out = target(input_ids=feed, past_key_values=cache, use_cache=True, logits_to_keep=k + 1,
                         output_hidden_states=wants_features)
            logits = out.logits[..., :vocab_size]
            stats.target_forwards += 1
            rule_start = time.perf_counter()
            p = sampling.probs(logits)
            d = _divergences(config, logits, p, proposal) if fuzzy else None
            accepted, next_token = rule(drafts, p, proposal.probs, d, config.threshold, sampling.greedy, generator)
            n = int(accepted[0])
            stats.accept_s += time.perf_counter() - rule_start
            crop_to(cache, sequence.shape[1] + n)  # keep the accepted drafts; next_token is fed next step
            if wants_features:  # the target's features of every fed token that stays
                drafter.observe(cached, out.hidden_states[-1][:, : sequence.shape[1] - cached + n])
            new = torch.cat([drafts[:, :n], next_token.view(1, 1)], 1)
            stats.record_step(k, n, d)
            if config.gamma_schedule == "heuristic" and k:
                gamma = gamma + 2 if n == k else max(1, gamma - 1)

        new = new[:, :remaining]
        done = False
        if config.eos_token_ids:
            is_eos = torch.isin(new[0], torch.tensor(config.eos_token_ids, device=new.device))
            if bool(is_eos.any()):
                new = new[:, : int(is_eos.long().argmax()) + 1]
                done = True
        if sequence.shape[1] == prompt_len:
            stats.first_token_s = time.perf_counter() - start
        sequence = torch.cat([sequence, new], 1)
        if on_tokens is not None and on_tokens(new):
            done = True
        if done:
            break

    stats.new_tokens = sequence.shape[1] - prompt_len
    stats.draft_forwards = drafter.forwards - draft_forwards_before if drafter is not None else 0
    stats.wall_s = time.perf_counter() - start
    return sequence[:, prompt_len:], stats
