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
from .tree_rules import walk
from .trees import TreeProposal, keep_path, model_mask, tree_inputs

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
    tree: bool = False  # EAGLE-2 draft trees instead of chains (EAGLE heads only)
    tree_total_tokens: int = 16
    tree_depth: int = 5
    tree_top_k: int = 4

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
        for name in ("tree_total_tokens", "tree_depth", "tree_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def draft_only(self) -> bool:
        """FSD with T = inf accepts every drafted chain: the target has nothing to decide.
        (In a tree the target still picks which child to follow.)"""
        return self.method == "fsd" and self.threshold == math.inf and not self.tree


Callback = Callable[[Tensor], bool]


def target_features(hidden_states: tuple[Tensor, ...], drafter: Drafter) -> Tensor:
    """The target's hidden states a feature-reading drafter asks for (``feature_layers``, indices
    into ``hidden_states``), concatenated on the last dimension."""
    layers = getattr(drafter, "feature_layers", [-1])
    return torch.cat([hidden_states[i] for i in layers], -1) if len(layers) > 1 else hidden_states[layers[0]]


def _divergences(config: DecodeConfig, target_logits: Tensor, p: Tensor, draft_logits: Tensor, q: Tensor) -> Tensor:
    """D(p, q) row by row, on the processed distributions or (``raw_divergence``) the raw ones."""
    if config.raw_divergence:
        p, q = raw_probs(target_logits), raw_probs(draft_logits)
    return divergence(p, q, config.divergence, top_k=config.divergence_top_k, top_p=config.divergence_top_p)


@dataclass
class _Step:
    """What one verification yields: the new tokens ([1, m]) and what the statistics record."""

    new: Tensor
    proposed: int
    accepted: int
    d: Tensor | None
    accept_s: float  # time in the divergence and the rule (the acceptance step)


def _chain_step(target: torch.nn.Module, cache: DynamicCache, sequence: Tensor, proposal: Proposal,
                config: DecodeConfig, vocab_size: int, generator: torch.Generator, drafter: Drafter | None,
                wants_features: bool) -> _Step:
    """Verify a chain of drafts in one target pass; keep the accepted ones in the cache."""
    drafts, sampling = proposal.tokens, config.sampling
    k = drafts.shape[1]
    # Feed what the cache lacks (the whole prompt at first, then the newest token) and the drafts.
    cached = cache.get_seq_length()
    out = target(input_ids=torch.cat([sequence[:, cached:], drafts], 1), past_key_values=cache, use_cache=True,
                 logits_to_keep=k + 1, output_hidden_states=wants_features)
    logits = out.logits[..., :vocab_size]
    start = time.perf_counter()
    p = sampling.probs(logits)
    # Greedy SD reads neither q nor D: a reduced-vocabulary proposal is then never widened.
    needs_q = config.method in FUZZY or not sampling.greedy
    draft_logits, q = proposal.full() if needs_q and k else (proposal.logits, proposal.probs)
    d = _divergences(config, logits[:, :k], p[:, :k], draft_logits, q) if config.method in FUZZY else None
    rule = RULES["sd" if config.method == "ar" else config.method]
    accepted, next_token = rule(drafts, p, q, d, config.threshold, sampling.greedy, generator)
    n = int(accepted[0])
    accept_s = time.perf_counter() - start
    crop_to(cache, sequence.shape[1] + n)  # keep the accepted drafts; next_token is fed next step
    if wants_features:  # the target's features of every fed token that stays
        drafter.observe(cached, target_features(out.hidden_states, drafter)[:, : sequence.shape[1] - cached + n])
    return _Step(torch.cat([drafts[:, :n], next_token.view(1, 1)], 1), k, n, d, accept_s)


def _tree_step(target: torch.nn.Module, cache: DynamicCache, sequence: Tensor, proposal: TreeProposal,
               config: DecodeConfig, vocab_size: int, generator: torch.Generator, drafter: Drafter,
               wants_features: bool) -> _Step:
    """Verify a draft tree in one target pass; keep the accepted path in the cache."""
    sampling, tree = config.sampling, proposal.tree
    cached = cache.get_seq_length()
    feed = sequence[:, cached:]
    m = feed.shape[1]
    mask, positions = tree_inputs(tree, cached, m)
    out = target(input_ids=torch.cat([feed, tree.tokens[None]], 1), attention_mask=model_mask(target, mask),
                 position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=len(tree) + 1,
                 output_hidden_states=wants_features)
    logits = out.logits[0, :, :vocab_size]  # row 0: the root, row i + 1: node i
    start = time.perf_counter()
    p = sampling.probs(logits)
    expanded = proposal.q.sum(-1) > 0  # rows with drafted children: only there is D defined
    d = None
    if config.method in FUZZY:
        draft_logits, q = proposal.full()
        d = torch.full((len(tree) + 1,), math.inf, device=p.device)
        d[expanded] = _divergences(config, logits[expanded], p[expanded], draft_logits[expanded], q[expanded])
    path, token = walk(config.method, tree, p, proposal.q, d, config.threshold, sampling.greedy, generator)
    accept_s = time.perf_counter() - start
    keep_path(cache, cached + m, path)
    if wants_features:
        hidden = target_features(out.hidden_states, drafter)
        path_rows = torch.tensor(path, dtype=torch.long, device=hidden.device) + m
        drafter.observe(cached, torch.cat([hidden[:, :m], hidden[:, path_rows]], 1))
    new = torch.cat([tree.tokens[path], torch.tensor([token], device=tree.tokens.device)])[None]
    # A tree step can accept at most its depth: that is what "proposed" counts for trees.
    return _Step(new, int(tree.depth.max()), len(path), d[expanded][None] if d is not None else None, accept_s)


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
    trees = config.tree and drafter is not None
    if trees and not getattr(drafter, "drafts_trees", False):
        raise ValueError("tree drafting needs an EAGLE head as the drafter")
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

    # A drafter that reads the target's features needs target passes even when every draft is accepted.
    draft_only = config.draft_only and not wants_features
    while (remaining := config.max_new_tokens - (sequence.shape[1] - prompt_len)) > 0:
        new = drafter.propose(sequence, min(gamma, remaining), sampling, generator).tokens if draft_only else None
        if new is not None and new.shape[1]:
            stats.record_step(new.shape[1], new.shape[1], None)
        else:
            tree = drafter.propose_tree(sequence, sampling) if trees else None
            if tree is not None:
                step = _tree_step(target, cache, sequence, tree, config, vocab_size, generator, drafter,
                                  wants_features)
            else:
                # At most remaining - 1 drafts: the step adds one target token after them.
                num = min(gamma, remaining - 1) if drafter is not None else 0
                proposal = drafter.propose(sequence, num, sampling, generator) if num else no_drafts
                step = _chain_step(target, cache, sequence, proposal, config, vocab_size, generator, drafter,
                                   wants_features)
            stats.accept_s += step.accept_s
            stats.target_forwards += 1
            stats.record_step(step.proposed, step.accepted, step.d)
            new = step.new
            if config.gamma_schedule == "heuristic" and tree is None and step.proposed:
                gamma = gamma + 2 if step.accepted == step.proposed else max(1, gamma - 1)

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
