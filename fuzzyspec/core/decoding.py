"""The decoding engine: AR, SD, FSD and FSD-hybrid, for any drafter, chains and trees, one sequence or many.

One ``Engine.step`` runs one round for every row of the batch:

1. each row's drafter proposes a ``Draft``, a tree of tokens below the row's newest
   token (a chain is a tree with one child per node; AR rows and drafters with
   nothing to say propose none), within the row's budget (gamma, its schedule,
   draft-confidence stops, the tree shape, the tokens left);
2. the target scores every row's newest token and all of its drafts in ONE forward
   pass over a padded KV cache (``kvcache.PaddedCache``): each draft attends to its
   row's cache, the newest token and its own ancestors, at position newest + depth;
3. each row's rule (``rules`` for chains, vectorised; ``tree_rules.walk`` for trees)
   keeps a path of drafts and emits one more token from the target;
4. each row keeps the newest token and its accepted path in the cache (a path's
   entries move up; rejected positions become invalid, and positions no row kept
   are cropped), feature-reading drafters get the target's hidden states of what
   stays, and rows that reach EOS, their length or a stop callback leave.

Rows join between steps (``add``/``add_many`` prefill their prompts together), and
each carries its own ``DecodeConfig`` (rule, divergence, threshold, sampling, length,
seed, gamma schedule, tree shape) and random generator, so a row decodes as it would
alone (exactly so in greedy mode, up to floating-point rounding). ``decode`` is a
batch of one. FSD with T = inf on chains accepts every draft: such rows run their
drafter alone, with no target pass (except drafters that need the target's features).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .divergences import canonical_name, divergence, point_divergence
from .draft import Budget, Draft, Drafter
from .kvcache import PaddedCache
from ..options import METHODS, OPTIONS, SCHEDULES
from .rules import FUZZY, RULES
from .sampling import Sampling, raw_probs, sample
from .stats import Stats
from .tree_rules import walk

_DEFAULT = {option.name: option.default for option in OPTIONS}  # the defaults are declared in options.OPTIONS


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that decides how one sequence is decoded (each option's help: ``options.OPTIONS``).

    method: ``ar``, ``sd``, ``fsd`` or ``fsd-hybrid``.
    gamma: drafts per step (the start value under the ``heuristic`` schedule,
        which adds 2 after a fully accepted step and takes 1 away otherwise).
    draft_confidence: stop drafting when the draft's top probability is below it.
    divergence, threshold: D and T of the fuzzy rules; ``divergence_top_k`` and
        ``divergence_top_p`` configure its truncated forms.
    raw_divergence: compute D on unprocessed softmax distributions, as the FSD
        reference code did, instead of on the processed ones.
    greedy_drafts: draft the draft's argmax even when sampling, as the reference code did.
    eos_token_ids: generation ends at the first of these (which is kept).
    tree: draft EAGLE-2 trees (total nodes, depth, children per node) instead of chains.
    """

    method: str = _DEFAULT["method"]
    gamma: int = _DEFAULT["gamma"]
    gamma_schedule: str = _DEFAULT["gamma_schedule"]
    draft_confidence: float = _DEFAULT["draft_confidence"]
    divergence: str = _DEFAULT["divergence"]
    threshold: float = _DEFAULT["threshold"]
    divergence_top_k: int = _DEFAULT["divergence_top_k"]
    divergence_top_p: float = _DEFAULT["divergence_top_p"]
    raw_divergence: bool = _DEFAULT["raw_divergence"]
    greedy_drafts: bool = _DEFAULT["greedy_drafts"]
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = _DEFAULT["max_new_tokens"]
    seed: int | None = _DEFAULT["seed"]
    eos_token_ids: tuple[int, ...] = ()
    tree: bool = _DEFAULT["tree"]
    tree_total_tokens: int = _DEFAULT["tree_total_tokens"]
    tree_depth: int = _DEFAULT["tree_depth"]
    tree_top_k: int = _DEFAULT["tree_top_k"]

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
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("tree_total_tokens", "tree_depth", "tree_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def draft_only(self) -> bool:
        """FSD with T = inf accepts every drafted chain: the target has nothing to decide.
        (In a tree the target still picks which child to follow.)"""
        return self.method == "fsd" and self.threshold == math.inf and not self.tree

    def budget(self, gamma: int, remaining: int) -> Budget | None:
        """What the drafter may propose with ``remaining`` tokens to go: None when nothing (AR, or one token
        left, which the target gives). A verified step adds one token after the drafts."""
        if self.method == "ar":
            return None
        if self.draft_only:
            return Budget(min(gamma, remaining), None, self.draft_confidence, self.greedy_drafts)
        if remaining < 2:
            return None
        tree = (self.tree_total_tokens, self.tree_depth, self.tree_top_k) if self.tree else None
        return Budget(min(gamma, remaining - 1), tree, self.draft_confidence, self.greedy_drafts)


Callback = Callable[[Tensor], bool]


def target_features(hidden_states: tuple[Tensor, ...], drafter: Drafter) -> Tensor:
    """The target's hidden states a feature-reading drafter asks for (``feature_layers``, indices
    into ``hidden_states``), concatenated on the last dimension."""
    layers = drafter.feature_layers or [-1]
    return torch.cat([hidden_states[i] for i in layers], -1) if len(layers) > 1 else hidden_states[layers[0]]


@dataclass
class Verdict:
    """A rule's decision on one row's draft: the accepted nodes (root's child first), the token after them,
    what the statistics record (drafts that could have been accepted, and D where a fuzzy rule read it)."""

    path: list[int]
    token: int
    proposed: int
    d: Tensor | None


def judge(config: DecodeConfig, draft: Draft | None, logits: Tensor, generator: torch.Generator | None
          ) -> Verdict:
    """Apply the row's rule to its draft, given the target's logits [n + 1, V] at the root and every node."""
    sampling = config.sampling
    p = sampling.probs(logits)
    rule = "sd" if config.method == "ar" else config.method
    fuzzy = rule in FUZZY
    n = len(draft) if draft is not None else 0
    if n == 0:
        token = p[0].argmax() if sampling.greedy else sample(p[0], generator)
        return Verdict([], int(token), 0, None)
    d = None
    if draft.is_chain:
        if fuzzy:
            d = _divergences(config, draft, logits[:n], p[:n], slice(0, n))
        # q matters to SD's test only where the chain was drawn from it; a chosen token is a point mass.
        q = draft.widened(slice(0, n))[1][None] if draft.sampled and not sampling.greedy else None
        accepted, token = RULES[rule](draft.tokens[None], p[None], q, d[None] if d is not None else None,
                                      config.threshold, sampling.greedy, generator)
        return Verdict(list(range(int(accepted[0]))), int(token[0]), n, d)
    lazy = None
    if fuzzy:
        if draft.q is None:
            raise ValueError("fuzzy rules on a draft tree need the draft's distributions")
        lazy = _TreeDivergences(config, draft, logits, p)
    path, token = walk(rule, draft, p, lazy, config.threshold, sampling.greedy, generator)
    return Verdict(path, token, max(draft.depths), lazy.computed() if lazy is not None else None)


class _TreeDivergences:
    """D(p, q) at the rows of a tree that the walk reads, computed on first read: the walk visits at most
    depth + 1 of a tree's rows, and a divergence over the whole vocabulary is the costly part of a step."""

    def __init__(self, config: DecodeConfig, draft: Draft, logits: Tensor, p: Tensor) -> None:
        self.config, self.draft, self.logits, self.p = config, draft, logits, p
        self.values: dict[int, Tensor] = {}

    def __getitem__(self, row: int) -> Tensor:
        if row not in self.values:
            rows = slice(row, row + 1)
            self.values[row] = _divergences(self.config, self.draft, self.logits[rows], self.p[rows], rows)[0]
        return self.values[row]

    def computed(self) -> Tensor | None:
        return torch.stack(list(self.values.values())) if self.values else None


def _divergences(config: DecodeConfig, draft: Draft, target_logits: Tensor, p: Tensor, rows) -> Tensor:
    """D(p, q) at the draft's ``rows``: on the processed distributions or (``raw_divergence``) the raw ones;
    a draft without distributions is a point mass on each drafted token."""
    options = dict(top_k=config.divergence_top_k, top_p=config.divergence_top_p)
    if config.raw_divergence:
        p = raw_probs(target_logits)
    if draft.q is None:
        return point_divergence(p, draft.tokens[rows], config.divergence, **options)
    draft_logits, q = draft.widened(rows)
    if config.raw_divergence:
        q = raw_probs(draft_logits)
    return divergence(p, q, config.divergence, **options)


@dataclass
class Row:
    """One sequence of the batch and everything that decides and records its decoding."""

    config: DecodeConfig
    drafter: Drafter | None
    on_tokens: Callback | None
    generator: torch.Generator
    stats: Stats
    started: float
    sequence: Tensor  # [1, L]: the prompt and every emitted token
    prompt_len: int
    gamma: int
    finish_reason: str | None = None  # "stop" (EOS or the callback) or "length" once finished
    logprobs: int | None = None  # record each emitted token's log-probability and this many top alternatives
    # (token, log p(token), [(token, log p), ...] the top ``logprobs``) per emitted token, under the row's
    # sampling processing of the target's distribution
    token_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.sequence[0, self.prompt_len:].tolist()

    @property
    def generated(self) -> int:
        return self.sequence.shape[1] - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - self.generated

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Continuous batched decoding: rows join with ``add``, ``step`` advances them all, finished rows leave.

    ``slots`` are the cache rows in order; a finished row leaves its slot empty (None) until enough
    slots are empty to be worth the copy of dropping them (``retire_fraction``). ``rows`` are the
    rows still decoding.
    """

    def __init__(self, target: torch.nn.Module, vocab_size: int, compact_after: int = 64,
                 retire_fraction: float = 0.25) -> None:
        self.target, self.vocab_size = target, vocab_size
        self.compact_after, self.retire_fraction = compact_after, retire_fraction
        self.device = target.get_input_embeddings().weight.device
        self.cache = PaddedCache(valid=torch.zeros(0, 0, dtype=torch.bool, device=self.device))
        self.slots: list[Row | None] = []

    @property
    def rows(self) -> list[Row]:
        return [row for row in self.slots if row is not None]

    @torch.inference_mode()
    def add(self, input_ids: Tensor, config: DecodeConfig, drafter: Drafter | None = None,
            on_tokens: Callback | None = None, logprobs: int | None = None) -> Row:
        """Start decoding ``input_ids`` ([1, L]) under ``config``; it runs from the next ``step``. ``logprobs``:
        record the target's log-probability of every emitted token and of its ``logprobs`` likeliest
        alternatives (``Row.token_logprobs``)."""
        row = self.add_many([input_ids], [config], [drafter], [on_tokens])[0]
        if logprobs is not None:
            if config.draft_only:
                raise ValueError("fsd with T = inf runs the drafter alone: there are no target log-probabilities")
            row.logprobs = logprobs
        return row

    @torch.inference_mode()
    def add_many(self, prompts: list[Tensor], configs: list[DecodeConfig],
                 drafters: list[Drafter | None] | None = None,
                 callbacks: list[Callback | None] | None = None) -> list[Row]:
        """Start decoding several prompts ([1, L] each), prefilled together in one left-padded pass."""
        drafters = drafters or [None] * len(prompts)
        callbacks = callbacks or [None] * len(prompts)
        for input_ids, config, drafter in zip(prompts, configs, drafters, strict=True):
            _check(input_ids, config, drafter)
        prompts = [input_ids.to(self.device) for input_ids in prompts]
        # Everything but the newest token goes into the cache now; the newest is fed at the first step.
        width = max(input_ids.shape[1] for input_ids in prompts) - 1
        heads = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        real = torch.zeros(len(prompts), width, dtype=torch.bool, device=self.device)
        for b, input_ids in enumerate(prompts):
            n = input_ids.shape[1] - 1
            if n:
                heads[b, width - n:] = input_ids[0, :-1]
                real[b, width - n:] = True
        fresh = PaddedCache(valid=torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.device))
        readers = [d for d in drafters if d is not None and d.wants_target_features]
        out = fresh.forward(self.target, heads, real, 1, hidden_states=bool(readers)) if width else None
        self._retire(everything=True)
        self.cache.extend(fresh)
        added = []
        for b, (input_ids, config, drafter, on_tokens) in enumerate(zip(prompts, configs, drafters, callbacks)):
            generator = torch.Generator(device=self.device)
            if config.seed is None:
                generator.seed()
            else:
                generator.manual_seed(config.seed)
            if drafter is not None:
                drafter.reset()
                if drafter.wants_target_features and out is not None and input_ids.shape[1] > 1:
                    n = input_ids.shape[1] - 1
                    drafter.observe(0, target_features(out.hidden_states, drafter)[b: b + 1, width - n:])
            row = Row(config, drafter, on_tokens, generator, Stats(method=config.method), time.perf_counter(),
                      input_ids, input_ids.shape[1], config.gamma)
            row.stats.draft_forwards = -(drafter.forwards if drafter is not None else 0)  # counted from here
            self.slots.append(row)
            added.append(row)
        return added

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One draft-and-verify round for every row; returns the rows that finished (they leave the batch)."""
        drafts: dict[int, Draft | None] = {}
        for b, row in enumerate(self.slots):
            if row is None:
                continue
            budget = row.config.budget(row.gamma, row.remaining) if row.drafter is not None else None
            draft = row.drafter.propose(row.sequence, budget, row.config.sampling, row.generator) \
                if budget is not None else None
            if row.config.draft_only and not row.drafter.wants_target_features and draft is not None and len(draft):
                row.stats.record_step(len(draft), len(draft), None)  # the draft decodes alone: nothing to verify
                self._emit(row, draft.tokens.tolist())
            else:
                drafts[b] = draft
        if drafts:
            self._verify(drafts)
        finished = [row for row in self.slots if row is not None and row.done]
        for row in finished:
            row.stats.new_tokens = row.generated
            row.stats.wall_s = time.perf_counter() - row.started
            row.stats.draft_forwards += row.drafter.forwards if row.drafter is not None else 0
        self.slots = [None if row is None or row.done else row for row in self.slots]
        self._retire()
        if self.cache.rows and self.cache.holes > self.compact_after:
            self.cache.compact()
        return finished

    def _verify(self, drafts: dict[int, Draft | None]) -> None:
        """Score the newest token and the drafts of the rows in ``drafts`` in one target pass, and judge them."""
        sizes = {b: len(d) if d is not None else 0 for b, d in drafts.items()}
        width = 1 + max(sizes.values())
        rows = len(self.slots)
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        valid = torch.zeros(rows, width, dtype=torch.bool, device=self.device)
        chains = all(d is None or d.is_chain for d in drafts.values())
        allowed = None if chains else torch.zeros(rows, width, width, dtype=torch.bool, device=self.device)
        depths = None if chains else torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for b, draft in drafts.items():
            row, n = self.slots[b], sizes[b]
            tokens[b, 0] = row.sequence[0, -1]
            valid[b, : 1 + n] = True
            if n:
                tokens[b, 1: 1 + n] = draft.tokens
            if not chains:
                allowed[b, 0, 0] = True
                if n:
                    allowed[b, 1: 1 + n, 0] = True
                    allowed[b, 1: 1 + n, 1: 1 + n] = draft.ancestors()
                    depths[b, 1: 1 + n] = torch.tensor(draft.depths, device=self.device)
        readers = {b for b in drafts if self.slots[b].drafter is not None and self.slots[b].drafter.wants_target_features}
        start = self.cache.length
        out = self.cache.forward(self.target, tokens, valid, width, allowed, depths, hidden_states=bool(readers))
        logits = out.logits[..., : self.vocab_size]
        verdicts = self._next_tokens([b for b in drafts if sizes[b] == 0], logits)
        for b, draft in drafts.items():
            row, n = self.slots[b], sizes[b]
            clock = time.perf_counter()
            verdict = verdicts.get(b) or judge(row.config, draft, logits[b, : 1 + n], row.generator)
            row.stats.accept_s += time.perf_counter() - clock
            kept = [0] + [1 + node for node in verdict.path]
            self.cache.keep(b, start, width, kept)
            if b in readers:
                features = target_features(out.hidden_states, row.drafter)[b: b + 1, kept]
                row.drafter.observe(row.sequence.shape[1] - 1, features)
            row.stats.target_forwards += 1
            row.stats.record_step(verdict.proposed, len(verdict.path), verdict.d)
            if row.config.gamma_schedule == "heuristic" and verdict.proposed and (draft is None or draft.is_chain):
                row.gamma = row.gamma + 2 if len(verdict.path) == verdict.proposed else max(1, row.gamma - 1)
            new = (draft.tokens[verdict.path].tolist() if verdict.path else []) + [verdict.token]
            if row.logprobs is not None:  # token i came from the target's distribution at kept column i
                log_p = row.config.sampling.probs(logits[b, kept]).clamp_min(1e-45).log()
                top = log_p.topk(row.logprobs) if row.logprobs else None
                row.token_logprobs += [(token, float(log_p[i, token]), list(zip(top.indices[i].tolist(),
                                                                                 top.values[i].tolist())) if top else [])
                                       for i, token in enumerate(new)]
            self._emit(row, new)
        self.cache.crop_unused()

    def _next_tokens(self, slots: list[int], logits: Tensor) -> dict[int, Verdict]:
        """The next token of every row with no drafts, all at once: greedy rows take the argmax; sampling
        rows draw from their own processed distribution with their own generator."""
        if not slots:
            return {}
        last = logits[slots, 0]
        tokens = last.argmax(-1)
        by_sampling: dict[Sampling, list[int]] = {}
        for i, b in enumerate(slots):
            if not self.slots[b].config.sampling.greedy:
                by_sampling.setdefault(self.slots[b].config.sampling, []).append(i)
        for sampling, members in by_sampling.items():
            probs = sampling.probs(last[members])
            for j, i in enumerate(members):
                tokens[i] = sample(probs[j], self.slots[slots[i]].generator)
        return {b: Verdict([], token, 0, None) for b, token in zip(slots, tokens.tolist())}

    def _emit(self, row: Row, new: list[int]) -> None:
        """Append a step's tokens to the row, stopping at EOS, the length limit or the callback."""
        new = new[: row.remaining]
        eos = set(row.config.eos_token_ids)
        cut = next((i + 1 for i, token in enumerate(new) if token in eos), None)
        if cut is not None:
            new = new[:cut]
        if row.generated == 0:
            row.stats.first_token_s = time.perf_counter() - row.started
        added = torch.tensor([new], dtype=torch.long, device=self.device)
        row.sequence = torch.cat([row.sequence, added], 1)
        if row.logprobs is not None:  # drop the entries of tokens cut off here
            del row.token_logprobs[row.generated:]
        stop = row.on_tokens is not None and bool(row.on_tokens(added))
        if cut is not None or stop:
            row.finish_reason = "stop"
        elif row.remaining <= 0:
            row.finish_reason = "length"

    def _retire(self, everything: bool = False) -> None:
        """Drop empty slots from the cache: all of them, or once they are ``retire_fraction`` of the batch."""
        empty = sum(row is None for row in self.slots)
        if not empty or (not everything and empty < max(1, self.retire_fraction * len(self.slots))
                         and empty < len(self.slots)):
            return
        keep = torch.tensor([i for i, row in enumerate(self.slots) if row is not None], dtype=torch.long)
        self.slots = [row for row in self.slots if row is not None]
        self.cache.select(keep)


def _check(input_ids: Tensor, config: DecodeConfig, drafter: Drafter | None) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError("a prompt is one sequence of at least one token, shaped [1, L]")
    if config.method != "ar" and drafter is None:
        raise ValueError(f"method {config.method!r} needs a drafter")
    if config.tree and drafter is not None and not drafter.drafts_trees:
        raise ValueError("tree drafting needs a drafter that drafts trees (an EAGLE head)")


@torch.inference_mode()
def decode(target: torch.nn.Module, drafter: Drafter | None, input_ids: Tensor, config: DecodeConfig,
           vocab_size: int, on_tokens: Callback | None = None) -> tuple[Tensor, Stats]:
    """Generate after ``input_ids`` ([1, L]): a batch of one. Returns the new tokens ([1, n]) and statistics.

    ``on_tokens`` sees each step's new tokens ([1, m]) and may return True to stop (for stop
    strings). ``vocab_size`` is the shared vocabulary width: logit columns past it are dropped.
    """
    engine = Engine(target, vocab_size)
    row = engine.add(input_ids, config, None if config.method == "ar" else drafter, on_tokens)
    while engine.rows:
        engine.step()
    return row.sequence[:, row.prompt_len:], row.stats


def decode_batch(target: torch.nn.Module, prompts: list[Tensor], configs: list[DecodeConfig],
                 drafters: list[Drafter | None], vocab_size: int) -> list[tuple[list[int], Stats]]:
    """Decode every prompt ([1, L] each) under its config and drafter, all in one batch."""
    engine = Engine(target, vocab_size)
    rows = engine.add_many(prompts, configs, drafters)
    while engine.rows:
        engine.step()
    return [(row.tokens, row.stats) for row in rows]
