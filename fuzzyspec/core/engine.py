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

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .config import DecodeConfig
from .draft import Draft, Drafter
from .judge import Verdict, judge
from .kvcache import PaddedCache
from .sampling import Sampling, sample
from .scoring import TokenLogprob, log_probs, token_logprobs
from .stats import Stats

Callback = Callable[[Tensor], bool]


def target_features(hidden_states: tuple[Tensor, ...], drafter: Drafter) -> Tensor:
    """The target's hidden states a feature-reading drafter asks for (``feature_layers``, indices
    into ``hidden_states``), concatenated on the last dimension."""
    layers = drafter.feature_layers or [-1]
    return torch.cat([hidden_states[i] for i in layers], -1) if len(layers) > 1 else hidden_states[layers[0]]


@dataclass
class Job:
    """A sequence waiting to be decoded: its prompt ([1, L]), config and drafter; ``on_tokens`` sees each step's
    new tokens ([1, m]) and may return True to stop; ``logprobs``: record the target's log-probability of
    every emitted token and of its ``logprobs`` likeliest alternatives (``Row.token_logprobs``)."""

    input_ids: Tensor
    config: DecodeConfig
    drafter: Drafter | None = None
    on_tokens: Callback | None = None
    logprobs: int | None = None


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
    token_logprobs: list[TokenLogprob] = field(default_factory=list)

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
        """Start decoding ``input_ids`` ([1, L]) under ``config``; it runs from the next ``step`` (see ``Job``)."""
        return self.add_many([Job(input_ids, config, drafter, on_tokens, logprobs)])[0]

    @torch.inference_mode()
    def add_many(self, jobs: list[Job]) -> list[Row]:
        """Start decoding several sequences, prefilled together in one left-padded pass. Every job is checked
        before anything changes, so a bad one leaves the batch as it was."""
        for job in jobs:
            _check(job)
        prompts = [job.input_ids.to(self.device) for job in jobs]
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
        readers = [job.drafter for job in jobs if job.drafter is not None and job.drafter.wants_target_features]
        out = fresh.forward(self.target, heads, real, 1, hidden_states=bool(readers)) if width else None
        self._retire(everything=True)
        self.cache.extend(fresh)
        added = []
        for b, (job, input_ids) in enumerate(zip(jobs, prompts)):
            config, drafter = job.config, job.drafter
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
            row = Row(config, drafter, job.on_tokens, generator, Stats(method=config.method), time.perf_counter(),
                      input_ids, input_ids.shape[1], config.gamma, logprobs=job.logprobs)
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
                log_p = log_probs(logits[b, kept], row.config.sampling)
                row.token_logprobs += token_logprobs(log_p, new, row.logprobs)
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


def _check(job: Job) -> None:
    if job.input_ids.dim() != 2 or job.input_ids.shape[0] != 1 or job.input_ids.shape[1] < 1:
        raise ValueError("a prompt is one sequence of at least one token, shaped [1, L]")
    job.config.check_drafter(job.drafter)
    if job.logprobs is not None and job.config.draft_only:
        raise ValueError("fsd with T = inf runs the drafter alone: there are no target log-probabilities")


def admit(engine: Engine, take: Callable[[int], list[Job]], max_rows: int, group: int = 1
          ) -> list[tuple[Job, Row]]:
    """Let waiting sequences join a running batch between steps: ``take(n)`` hands over up to n jobs. Rows
    join while the batch has room for ``group`` of them (a join prefills its group in one pass and merges
    caches once, so joining one by one would pay that per row), or whenever the batch is empty."""
    free = max_rows - len(engine.rows)
    if free <= 0 or (engine.rows and free < group):
        return []
    jobs = take(free)
    return list(zip(jobs, engine.add_many(jobs))) if jobs else []


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
    rows = engine.add_many([Job(*job) for job in zip(prompts, configs, drafters, strict=True)])
    while engine.rows:
        engine.step()
    return [(row.tokens, row.stats) for row in rows]
