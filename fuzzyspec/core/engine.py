"""The decoding engine: AR, SD, FSD and FSD-hybrid, for any drafter, chains and trees, one sequence or many.

One ``Engine.step`` runs one round for every row of the batch:

1. each row's drafter proposes a ``Draft``, a tree of tokens below the row's newest
   token (a chain is a tree with one child per node; AR rows and drafters with
   nothing to say propose none), within the row's budget (gamma, its schedule,
   draft-confidence stops, the tree shape, the tokens left);
2. the target scores every row's newest token and all of its drafts in ONE forward
   (``step.TargetStep``) over a static KV cache (``kvcache.StaticCache``): row b's tokens are
   written from its length on, and each attends to its row's cache and its own ancestors, at
   position length + depth;
3. each row's rule (``judge``: ``rules`` for chains, vectorised; ``tree_rules`` for trees)
   keeps a path of drafts and emits one more token from the target; every row's outcome is
   read from the device in one transfer;
4. each row's length moves past its newest token and accepted path (a tree's path is copied
   down within the row; what was rejected is left behind and overwritten by the next step),
   feature-reading drafters get the target's hidden states of what stays, and rows that
   reach EOS, their length or a stop callback leave, freeing their slot.

On a GPU a batch with no drafts at all (AR rows, and rows whose drafter the cost schedule holds back) runs one
step ahead (``Engine.lookahead``): the next step is queued on the device, fed the tokens this one picks there,
before this one's are read, so the host's work around a step overlaps the device's work on the one before.

Rows join between steps (``add``/``add_many`` prefill their prompts together into free slots, each from where
it differs from the text its slot still holds: a chat's next turn computes only its new tokens),
and each carries its own ``DecodeConfig`` (rule, divergence, threshold, sampling, length, seed,
gamma schedule, tree shape) and random generator, so a row decodes as it would alone (exactly
so in greedy mode, up to floating-point rounding). ``decode`` is a batch of one. FSD with
T = inf on chains accepts every draft: such rows run their drafter alone, with no target pass
(except drafters that need the target's features).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .config import DecodeConfig
from .cost import COPY, Acceptance, Option, copy_length, draft_key, plan, population_key, target_key
from .draft import Budget, Draft, Drafter
from .host import DeviceTimer, upload
from .judge import Pending, Verdict, judge, next_token_only
from .kvcache import Held, StaticCache, attention_mask, chain_tree, common_prefix, write_positions
from .parallel import agree
from .sampling import Sampling, argmax, sample
from .scoring import TokenLogprob, log_probs, token_logprobs
from .stats import Stats
from .step import Features, TargetStep

Callback = Callable[[Tensor], bool]
# Steps between plans of the cost schedule's draft sizes (and at once after rows join). What a plan weighs moves
# slowly (a row's rates by a few percent a step, a cost by at most ``cost.STRIDE`` a measurement), while planning
# every step cost 0.16 ms of a compiled 4-bit step's 8 on a 2-core CPU.
PLAN_EVERY = 4
# While a plan holds every row back (none drafts or copies), the next comes twice as many steps later, up to
# HELD_PLAN_EVERY, and after one that drafts, PLAN_EVERY again. A held-back row's acceptance only fades between plans
# and its passes' prices move slowly, so such plans seldom change; but each is host time, and a held-back row runs
# ahead as AR's do on a GPU, where the host's time per step sets the pace: the default job ran 0.79x AR on an H100,
# drafting nothing (2026-11-28), and on the CPU a tiny target's held-back steps took 1.17x AR's, plans a half of that.
# A plan before any pass is priced holds every row back too (every draft's rate is then infinite, and ties go to the
# smaller draft), so the first steps measure AR's pass; it is not doubled: a fresh profile's first answer (a machine's
# first run) had drafted nothing for 8-24 steps, or at all in a 12-token one.
HELD_PLAN_EVERY = 16
# At a profile's REFRESH_AT-th plan in a process, and every REFRESH-th after, the rows planned to draft more than one
# token draft one (a 1-token chain), and that step's pass and drafting are measured afresh (``Profile.remeasure``).
# The planner measures only what it runs, so a narrow pass priced too high by a slow spell was not run again to come
# right: after a profiler had paused an AVX2-class run (emulated, eager; 2026-11-28), a profile held 1-4 token passes
# at about twice their cost and a 5-token pass at its own, and every step verified a 4-child tree, 0.94x AR, where a
# 1-token chain ran 1.12x. The first comes early, so a one-shot answer (some 20-40 plans) mends a profile it loaded.
REFRESH, REFRESH_AT = 64, 8
# Whether engines made without saying run AR steps one ahead (``Engine.lookahead``); None: on a GPU.
LOOKAHEAD: bool | None = None


def target_features(found: Features, drafter: Drafter, layers: int) -> Tensor:
    """The target's hidden states a feature-reading drafter asks for (``feature_layers``, indices as into
    Hugging Face's ``hidden_states``, -1 the last), concatenated on the last dimension."""
    parts = [found[i % (layers + 1)] for i in (drafter.feature_layers or [-1])]
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


@dataclass
class Job:
    """A sequence waiting to be decoded: its prompt ([1, L]), config and drafter; ``on_tokens`` sees each step's
    new tokens ([1, m], on the host) and may return True to stop; ``logprobs``: record the target's log-probability of
    every emitted token and of its ``logprobs`` likeliest alternatives (``Row.token_logprobs``)."""

    input_ids: Tensor
    config: DecodeConfig
    drafter: Drafter | None = None
    on_tokens: Callback | None = None
    logprobs: int | None = None


@dataclass
class _Queued:
    """An AR step queued on the device and not read yet (``Engine.lookahead``): the rows it ran for (slot, row),
    each row's next token picked on the device (``picked``, indexed by slot; the next step's input), its copy
    on its way to the host (``host``), and an event recorded once that copy is done (None on a CPU)."""

    rows: list[tuple[int, "Row"]]
    picked: Tensor
    host: Tensor
    done: "torch.cuda.Event | None"


@dataclass
class Row:
    """One sequence of the batch and everything that decides and records its decoding. The cache's slot
    ``slot`` holds every token of ``sequence`` but the newest."""

    config: DecodeConfig
    drafter: Drafter | None
    on_tokens: Callback | None
    generator: torch.Generator
    stats: Stats
    started: float
    sequence: Tensor  # [1, L]: the prompt and every emitted token
    prompt_len: int
    size: int  # drafts per step: a chain's length or a tree's depth (chosen per step by a schedule)
    breadth: int  # children per drafted node: 1 for a chain (the cost schedule may narrow a tree to one)
    slot: int
    acceptance: Acceptance = field(default_factory=Acceptance)  # for the cost schedule
    copy: int | None = None  # the longest copy from the text it may draft (cost schedule), else --gamma
    copies: Acceptance = field(default_factory=Acceptance)  # its copies' acceptance, kept apart (``copy_length``)
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

    ``target`` is the model, or a ``TargetStep`` (its forward, eager or compiled, shared by every engine
    on that model). ``slots`` are the cache's rows: a finished row frees its slot, and joining rows take
    the lowest free ones, so a step runs over the slots up to the highest one in use.

    ``lookahead`` (default: on a GPU): while no row drafts (AR rows, and rows whose drafter the cost schedule
    holds back, as it does wherever drafting would not pay; without log-probabilities), each step queues the next
    one on the device before it reads its own tokens, and hands drafters that read the target's features those
    of its pass, so they can draft again when the schedule says. The host's work for a step (inputs, emitting,
    callbacks: about as long as a small model's pass on a GPU) then runs while the device computes, instead of
    between its passes. A row that stops at EOS or by its callback has had one more pass queued, whose result
    is dropped; its tokens are the same as without lookahead. On a CPU the device is the host's own threads:
    nothing to overlap.
    """

    def __init__(self, target: torch.nn.Module | TargetStep, vocab_size: int, lookahead: bool | None = None
                 ) -> None:
        self.step_fn = target if isinstance(target, TargetStep) else TargetStep(target)
        self.target, self.vocab_size = self.step_fn.model, vocab_size
        self.device = self.target.get_input_embeddings().weight.device
        self.shards = self.step_fn.shards  # ranks sharing a tensor-parallel target: they step in lockstep
        self.timer = DeviceTimer(self.device)
        self._forward_ms: float | None = None  # this step's forward, once timed (not while it compiled)
        self.cache: StaticCache | None = None
        self.slots: list[Row | None] = []
        self._plan_in = 0  # steps until the next plan (``PLAN_EVERY``)
        self._plan_every = PLAN_EVERY  # steps from this plan to the next (``HELD_PLAN_EVERY``)
        if lookahead is None:
            lookahead = self.device.type == "cuda" if LOOKAHEAD is None else LOOKAHEAD
        self.lookahead = lookahead
        self._queued: _Queued | None = None  # the AR step queued ahead and not read yet

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
        """Start decoding several sequences, prefilled together in one pass into free slots. Every job is
        checked before anything changes, so a bad one leaves the batch as it was."""
        for job in jobs:
            _check(job)
        self._drain()  # (a row that the step queued ahead ends there leaves at the next step)
        prompts = [job.input_ids.to(self.device) for job in jobs]
        longest = max(job.input_ids.shape[1] + job.config.max_new_tokens for job in jobs)
        if self.cache is None:  # (borrowed first: what its free slots hold decides where the rows go)
            self._reserve(len(jobs), longest + 1)
        slots, starts, lent = self._seat(jobs, prompts)
        width = max(job.input_ids.shape[1] - 1 - start for job, start in zip(jobs, starts))
        self._reserve(1 + max(slots), max(longest, max(starts) + width) + 1)
        readers = [job.drafter for job in jobs if job.drafter is not None and job.drafter.wants_target_features]
        found = self._prefill(prompts, slots, starts, readers)
        self.slots += [None] * (1 + max(slots) - len(self.slots))
        added = []
        # a seed left to chance is drawn once for everyone: the ranks of a sharded target must draw alike
        seeds = agree([job.config.seed if job.config.seed is not None else
                       int(torch.randint(2 ** 62, ()).item()) for job in jobs]) if self.shards > 1 else None
        for b, (job, input_ids, slot) in enumerate(zip(jobs, prompts, slots)):
            config, drafter = job.config, job.drafter
            generator = torch.Generator(device=self.device)
            if seeds is not None:
                generator.manual_seed(seeds[b])
            elif config.seed is None:
                generator.seed()
            else:
                generator.manual_seed(config.seed)
            self.cache.lengths[slot] = input_ids.shape[1] - 1  # the newest token is fed at the first step
            self.cache.held[slot] = None  # (its row's own now)
            if drafter is not None:
                drafter.compiled = self.step_fn.compile
                drafter.reset()
                if lent[b] is not None:  # the features its slot held (``_seat``)
                    drafter.observe(*lent[b])
                if drafter.wants_target_features and found and input_ids.shape[1] - 1 > starts[b]:
                    features = target_features(found, drafter, self.step_fn.layer_count)
                    drafter.observe(starts[b], features[b: b + 1, : input_ids.shape[1] - 1 - starts[b]])
            row = Row(config, drafter, job.on_tokens, generator, Stats(method=config.method), time.perf_counter(),
                      input_ids, input_ids.shape[1], config.size_cap, config.tree_top_k if config.tree else 1,
                      slot, logprobs=job.logprobs)
            if drafter is not None and config.gamma_schedule == "cost":  # its estimates start from what the
                # drafter's earlier rows met (and its copies' from earlier copies)
                profile, rule = self.step_fn.profile, (config.method, config.threshold, config.sampling.greedy)
                row.acceptance.population = profile.population(population_key(drafter.name, *rule))
                if drafter.copies:
                    row.copies.population = profile.population(population_key(COPY, *rule))
            row.stats.draft_forwards = -(drafter.forwards if drafter is not None else 0)  # counted from here
            row.stats.cached_tokens = starts[b]
            self.slots[slot] = row
            added.append(row)
        self._plan_in, self._plan_every = 0, PLAN_EVERY  # the new rows' sizes are planned at their first step
        return added

    def _reserve(self, slots: int, length: int) -> None:
        """Make the cache hold ``slots`` rows of ``length`` positions at least (doubling its capacity)."""
        if self.cache is None:
            capacity = self.step_fn.min_capacity
            while capacity < length:
                capacity *= 2
            self.cache = self.step_fn.borrow_cache(slots, capacity)
            return
        capacity = self.cache.capacity
        while capacity < length:
            capacity *= 2
        self.cache.grow(slots, capacity)

    def _seat(self, jobs: list[Job], prompts: list[Tensor]
              ) -> tuple[list[int], list[int], list[tuple[int, Tensor] | None]]:
        """Each job's slot, how many of its prompt's first positions the slot already holds (``StaticCache.held``: a
        chat's next turn begins with the last one's prompt and answer), and the target features it holds that the
        job's drafter reads among those (from where, and they): the free slot that holds the most, else the first
        free slot, else a new one. A drafter that reads features (from ``BaseDrafter.first_feature`` on) gets them
        from the slot where its last row's drafter held them (``true_features``); the rest are computed again."""
        free = [b for b in range(max(len(self.slots), self.cache.slots)) if b >= len(self.slots) or
                self.slots[b] is None]
        slots: list[int] = []
        starts: list[int] = []
        lent: list[tuple[int, Tensor] | None] = []
        for job, input_ids in zip(jobs, prompts):
            length = input_ids.shape[1] - 1  # (the prompt's newest token is fed at the first step)
            drafter = job.drafter if job.drafter is not None and job.drafter.wants_target_features else None
            first = getattr(drafter, "first_feature", lambda n: 0)(length) if drafter is not None else length
            best, start, features = None, 0, None
            for b in free:
                if b in slots:
                    continue
                held = self.cache.held[b] if b < self.cache.slots else None
                shared, reach = 0, first
                if held is not None:
                    shared = common_prefix(held.tokens[None], input_ids[:, :length])
                    if drafter is not None and held.features is not None and held.since <= first and \
                            held.layers == tuple(drafter.feature_layers):
                        reach = max(first, min(held.since + held.features.shape[1], length))
                if best is None or min(shared, reach) > start:
                    best, start = b, min(shared, reach)
                    features = (first, held.features[:, first - held.since: start - held.since]) \
                        if drafter is not None and start > first else None
            if best is None:
                best = max([self.cache.slots, len(self.slots)] + [b + 1 for b in slots])
            slots.append(best)
            starts.append(start)
            lent.append(features)
        return slots, starts, lent

    def _forget(self, rows: int) -> None:
        """A free slot among a step's first ``rows`` keeps nothing (``StaticCache.held``): the step writes a row of
        padding there, from its position 0."""
        for b in range(rows):
            if b >= len(self.slots) or self.slots[b] is None:
                self.cache.held[b] = None

    def _prefill(self, prompts: list[Tensor], slots: list[int], starts: list[int], readers: list[Drafter]
                 ) -> Features:
        """Put every prompt token but the newest into its slot's cache, from ``starts`` on (what the slot held
        before it: ``_seat``), all prompts in one causal pass."""
        width = max(input_ids.shape[1] - 1 - start for input_ids, start in zip(prompts, starts))
        if width == 0:
            return {}
        tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for b, (input_ids, start) in enumerate(zip(prompts, starts)):
            tokens[b, : input_ids.shape[1] - 1 - start] = input_ids[0, start:-1]
        starts = torch.tensor(starts, dtype=torch.long, device=self.device)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = attention_mask(starts, causal.expand(len(prompts), width, width), self.cache.capacity)
        positions = write_positions(starts, width)
        # Rows 0 .. B - 1 (a first request's slot 0): the step reads those cache rows as views, where a list of slots
        # has each layer gather its rows' keys and values (copies of their whole capacity).
        rows = None if slots == list(range(len(slots))) else torch.tensor(slots, device=self.device)
        timed = len(prompts) == 1 and not self.step_fn.compile  # (an eager pass would misprice compiled ones)
        mark = self.timer.start() if timed else None
        _, found = self.step_fn(self.cache, tokens, positions, positions, mask, rows, 1,
                                self._feature_layers(readers))
        if timed:
            self.timer.stop(mark, lambda ms: self.step_fn.profile.observe_prompt(width, ms))
        return found

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One draft-and-verify round for every row; returns the rows that finished (they leave the batch)."""
        clock = time.perf_counter()
        if self._plan_in <= 0:  # (while a step runs ahead, rows' lengths lag its token: only caps read them)
            priced = self._plan()
            # (held back before a pass is measured, only because nothing is priced yet: planned again soon)
            held = priced and not any(self._drafts(row) for row in self.slots if row is not None and not row.done)
            self._plan_every = min(2 * self._plan_every, HELD_PLAN_EVERY) if held else PLAN_EVERY
            self._plan_in = self._plan_every
        self._plan_in -= 1
        if self._ahead():
            return self._step_ahead()
        reading = time.perf_counter()
        self._drain()
        clock += time.perf_counter() - reading  # (reading a step queued ahead is not this step's own time)
        drafts: dict[int, Draft | None] = {}
        proposals: dict[int, tuple[str, int]] = {}  # row -> (its drafting's profile key, size)
        proposal_ms: dict[int, float] = {}
        unplanned = False
        for b, row in enumerate(self.slots):
            if row is None or row.done:  # (done: it ended as a step queued ahead was read; it leaves below)
                continue
            budget = self._budget(row)
            draft = None
            if budget is not None:
                mark = self.timer.start()
                draft = row.drafter.propose(row.sequence, budget, row.config.sampling, row.generator)
                if draft is not None and draft.planned:
                    proposals[b] = (draft_key(row.drafter.name, row.breadth), row.size)
                    self.timer.stop(mark, lambda ms, b=b: proposal_ms.__setitem__(b, ms))
                elif draft is not None:  # (a copy: the step's time is not what the planned sizes cost)
                    unplanned = True
            if row.config.draft_only and not row.drafter.wants_target_features and draft is not None and len(draft):
                row.stats.record_step(len(draft), len(draft), None)  # the draft decodes alone: nothing to verify
                row.drafter.accepted(len(draft))
                self._emit(row, draft.tokens.tolist())
            else:
                drafts[b] = draft
        self._forward_ms = None
        if drafts:
            self._verify(drafts)
        self.timer.flush()
        if self._forward_ms is not None and not unplanned and all(b in drafts for b in proposals):
            self._price(len(drafts), proposals, proposal_ms, 1000 * (time.perf_counter() - clock) - self._forward_ms)
        return self._retire()

    def _retire(self) -> list[Row]:
        """Let the rows that finished leave the batch, freeing their slots; returns them."""
        finished = [row for row in self.slots if row is not None and row.done]
        if self.shards > 1:  # stop callbacks (stop strings, cancellations) run on rank 0 alone: its rows end everywhere
            ended = set(agree(sorted(row.slot for row in finished)))
            for row in self.rows:
                if row.slot in ended and not row.done:
                    row.finish_reason = "stop"
            finished = [row for row in self.slots if row is not None and row.done]
        for row in finished:
            row.stats.new_tokens = row.generated
            row.stats.wall_s = time.perf_counter() - row.started
            row.stats.draft_forwards += row.drafter.forwards if row.drafter is not None else 0
            self.slots[row.slot] = None
            # what the slot keeps for a row whose prompt begins with the same tokens (a chat's next turn)
            tokens = row.sequence[0, : min(self.cache.lengths[row.slot], row.sequence.shape[1] - 1)]
            reader = row.drafter if row.drafter is not None and row.drafter.wants_target_features else None
            features = getattr(reader, "true_features", lambda: None)() if reader is not None else None
            self.cache.held[row.slot] = Held(tokens) if features is None else \
                Held(tokens, features[1], tuple(reader.feature_layers), features[0])
            self.cache.lengths[row.slot] = 0
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        if not self.slots:  # nothing left to decode: the cache goes back to the step, for the next engine
            self._queued = None  # (a pass queued for rows that have ended: its result is not needed)
            self.step_fn.give_back(self.cache)
            self.cache = None
        return finished

    def _ahead(self) -> bool:
        """Whether this step runs one ahead (``lookahead``): no row drafts this step (``_drafts``) or keeps
        log-probabilities."""
        return self.lookahead and self.shards == 1 and not any(
            row.logprobs is not None or self._drafts(row) for row in self.slots if row is not None and not row.done)

    @classmethod
    def _drafts(cls, row: Row) -> bool:
        """Whether ``row`` would ask its drafter for a draft at its planned size now."""
        return cls._budget(row) is not None

    @staticmethod
    def _budget(row: Row) -> Budget | None:
        """What ``row``'s drafter may propose now, at its planned size: None where it is asked nothing (a size-0
        budget allows only a copy, asked only of a drafter that ``copies``)."""
        budget = row.config.budget(row.size, row.remaining, row.breadth, row.copy) if row.drafter is not None else None
        return budget if budget is None or budget.tokens or row.drafter.copies else None

    def _step_ahead(self) -> list[Row]:
        """One AR step for every row, run one ahead: the step queued last time (or, at first, one queued now from
        the emitted tokens) is read after the next one is queued behind it on the device, fed its picks there.
        None is queued where every row ends with this step's token by its length."""
        live = [row for row in self.slots if row is not None and not row.done]
        if live:
            queued = self._queued if self._queued is not None else self._queue(None)
            self._queued = self._queue(queued) if any(row.remaining > 1 for row in live) else None
            self._read(queued)
        self.timer.flush()
        return self._retire()

    def _queue(self, previous: _Queued | None) -> _Queued:
        """Queue one AR step of every row that has not ended, its input each row's newest token: the one
        ``previous`` picked, still on the device, or, with none, the last emitted. Each row's length moves past
        its input at once (an AR step keeps it), so the step after can be queued before this one is read, and a
        drafter that reads the target's features gets its input's (a row that ends before this step is read
        has one feature too many, which nothing reads)."""
        rows_now = [(b, row) for b, row in enumerate(self.slots) if row is not None and not row.done]
        width, rows = self.step_fn.shape(1, len(self.slots))
        self._reserve(rows, max(self.cache.lengths[:rows]) + width)
        self._forget(rows)
        if previous is not None:  # (rows only leave between two queued steps: the slots are the same or fewer)
            tokens = previous.picked[:rows, None]
        else:
            tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
            for b, row in rows_now:
                tokens[b, 0] = row.sequence[0, -1]
        starts = upload(self.cache.lengths[:rows], self.device, torch.long)
        readers = [(b, row) for b, row in rows_now if row.drafter is not None and row.drafter.wants_target_features]
        mark = self.timer.start()
        logits, found = self.step_fn(self.cache, tokens, starts[:, None], write_positions(starts, 1),
                                     attention_mask(starts, chain_tree(rows, 1, self.device), self.cache.capacity),
                                     None, 0, self._feature_layers([row.drafter for _, row in readers]), compiled=True)
        if not self.step_fn.compiling:
            context = max(self.cache.lengths[:rows])
            self.timer.stop(mark, lambda ms: self._forward_took(width, rows, ms, context))
        members = dict(rows_now)
        picked = self._pick([members.get(b) for b in range(rows)], logits[:, 0, : self.vocab_size])
        for b, row in readers:
            features = target_features(found, row.drafter, self.step_fn.layer_count)[b: b + 1]
            row.drafter.observe(self.cache.lengths[b], features)
        for b, _ in rows_now:
            self.cache.lengths[b] += 1
        if self.device.type != "cuda":
            return _Queued(rows_now, picked, picked, None)
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _Queued(rows_now, picked, host, done)

    def _read(self, queued: _Queued) -> None:
        """Wait for a queued step's tokens (for its own copy, not for what was queued after it) and emit them."""
        if queued.done is not None:
            queued.done.synchronize()
        values = queued.host.tolist()
        for b, row in queued.rows:
            # (it ended at the step before: this pass is dropped; its slot may have left the batch already, with
            # the empty slots after the last row's)
            if b >= len(self.slots) or self.slots[b] is not row or row.done:
                continue
            row.stats.target_forwards += 1
            row.stats.record_step(0, 0, None)
            if row.config.gamma_schedule == "cost":  # (as a step that drafts nothing does in ``_verify``)
                row.acceptance.fade()
            self._emit(row, values[b: b + 1])

    def _drain(self) -> None:
        """Read the step queued ahead, if any (before rows join, or a step that cannot run ahead)."""
        if self._queued is not None:
            queued, self._queued = self._queued, None
            self._read(queued)

    def _price(self, rows: int, proposals: dict[int, tuple[str, int]], proposal_ms: dict[int, float],
               outside: float) -> None:
        """File what a step of ``rows`` rows spent ``outside`` its forward (ms): all of it as the cost of a step that
        drafts nothing where no row drafted; else what it spent beyond such a step (all of it, until one such step
        was measured), shared among the drafting rows in proportion to their proposals' times, as the cost of each
        row's draft. So a draft is priced at all it brings to a step (its proposal, and the judging, masks and
        bookkeeping around it), as ``cost.plan`` needs."""
        profile = self.step_fn.profile
        if not proposals:
            profile.observe_outside(rows, outside)
            return
        extra = max(outside - profile.outside_ms(rows), 0.0)
        spent = sum(proposal_ms.get(b, 0.0) for b in proposals)
        for b, (key, size) in proposals.items():
            share = proposal_ms.get(b, 0.0) / spent if spent > 0 else 1 / len(proposals)
            profile.observe_draft(key, size, extra * share)

    def _plan(self) -> bool:
        """Choose the draft depth and breadth of every row under the cost schedule (``cost.plan``) for the next
        ``PLAN_EVERY`` steps: from the measured costs of this target and drafter, and each row's running
        acceptance. Returns whether this batch's AR pass is priced yet, at its rows and context: before it is, every
        draft's rate is infinite, and a plan holding every row back says nothing of what drafting pays."""
        # (what a pass attends over; a batch's passes, and a long context's, are priced apart from one short row's)
        context = max((row.sequence.shape[1] for row in self.slots if row is not None), default=0)
        priced = self.step_fn.profile.target_ms(*self.step_fn.shape(1, len(self.slots)), context) > 0
        planned = [(b, row) for b, row in enumerate(self.slots) if row is not None and row.drafter is not None
                   and row.config.gamma_schedule == "cost" and not row.config.draft_only and row.config.method != "ar"]
        if not planned:
            return priced
        options = [Option.of(row.drafter.name, row.config, max(row.remaining - 1, 0)) for _, row in planned]
        drafts = plan(options, [row.acceptance for _, row in planned], self.step_fn.profile, self.step_fn.shape,
                      len(self.slots) - len(planned), context=context)
        copies = [copy_length(row.copies, self.step_fn.profile, min(row.config.gamma, row.remaining - 1),
                              self.step_fn.shape, len(self.slots), context) if row.drafter.copies else None
                  for _, row in planned]
        profile = self.step_fn.profile
        profile.plans += 1
        if profile.plans % REFRESH == REFRESH_AT % REFRESH:
            drafts = self._refresh([row for _, row in planned], drafts, context)
        if self.shards > 1:  # each rank timed its own steps: rank 0's plan is everyone's
            drafts, copies = agree((drafts, copies))
        for (_, row), (size, breadth), copy in zip(planned, drafts, copies):
            row.size, row.breadth, row.copy = size, breadth, copy
        return priced

    def _refresh(self, rows: list[Row], drafts: list[tuple[int, int]], context: int) -> list[tuple[int, int]]:
        """``drafts`` (each row's (depth, breadth)) with every draft of more than one token made a 1-token chain,
        whose pass and drafting are then measured afresh (see ``REFRESH``)."""
        wider = {i for i, (size, breadth) in enumerate(drafts) if size and (size, breadth) != (1, 1)}
        if not wider:
            return drafts
        profile = self.step_fn.profile
        width, batch = self.step_fn.shape(2, len(self.slots))
        profile.remeasure(target_key(batch, context), width)
        for i in wider:
            profile.remeasure(draft_key(rows[i].drafter.name, 1), 1)
        return [(1, 1) if i in wider else draft for i, draft in enumerate(drafts)]

    def _feature_layers(self, readers: list[Drafter]) -> tuple[int, ...]:
        """The target's layers whose hidden states the drafters ``readers`` read, as the step numbers them."""
        layers = {layer for drafter in readers for layer in drafter.feature_layers or [-1]}
        return tuple(sorted(layer % (self.step_fn.layer_count + 1) for layer in layers))

    def _forward_took(self, width: int, rows: int, ms: float, context: int) -> None:
        self._forward_ms = ms
        self.step_fn.profile.observe_target(width, ms, rows, context)

    def _verify(self, drafts: dict[int, Draft | None]) -> None:
        """Score the newest token and the drafts of the rows in ``drafts`` in one target pass, and judge them.
        The step's inputs are laid out on the host and sent at once; its one read of the device is every
        row's outcome, together."""
        sizes = {b: len(d) if d is not None else 0 for b, d in drafts.items()}
        width, rows = self.step_fn.shape(1 + max(sizes.values()), len(self.slots))
        self._reserve(rows, max(self.cache.lengths[:rows]) + width)
        self._forget(rows)
        tokens = self._tokens(drafts, sizes, rows, width)
        # Each row's tree and depths: a chain's (a row drafting nothing or padding: a chain of none) kept from earlier
        # steps, where made afresh they were ten small operations a step, each cold after a pass
        chains = tuple(sizes[b] if b in drafts and (drafts[b] is None or drafts[b].is_chain) else 0
                       for b in range(rows))
        if all(draft is None or draft.is_chain for draft in drafts.values()):
            tree, depths = _chain_layout(chains, width, self.device)
        else:
            tree, depths = self._tree_layout(drafts, sizes, chains, width)
        readers = {b for b in drafts if self.slots[b].drafter is not None and self.slots[b].drafter.wants_target_features}
        features = self._feature_layers([self.slots[b].drafter for b in readers])
        starts_list = self.cache.lengths[:rows]
        starts = upload(starts_list, self.device, torch.long)
        mask = attention_mask(starts, tree, self.cache.capacity)
        write = write_positions(starts, width)
        positions = write if all(n == width - 1 for n in chains) else starts[:, None] + depths
        mark = self.timer.start()
        logits, found = self.step_fn(self.cache, tokens, positions, write, mask, None, 0, features, compiled=True)
        logits = logits[..., : self.vocab_size]
        if not self.step_fn.compiling:  # a compilation's seconds would price this width out for good
            context = max(starts_list)
            self.timer.stop(mark, lambda ms: self._forward_took(width, rows, ms, context))
        pending = self._next_tokens([b for b in drafts if sizes[b] == 0], logits)
        for b, draft in drafts.items():
            if b not in pending:
                clock = time.perf_counter()
                pending[b] = judge(self.slots[b].config, draft, logits[b, : 1 + sizes[b]], self.slots[b].generator)
                self.slots[b].stats.accept_s += time.perf_counter() - clock
        verdicts = _finish(pending)
        for b, draft in drafts.items():
            row, verdict = self.slots[b], verdicts[b]
            kept = [0] + [1 + node for node in verdict.path]
            self.cache.keep(b, starts_list[b], kept)
            self.cache.lengths[b] = starts_list[b] + len(kept)
            if b in readers:
                features = target_features(found, row.drafter, self.step_fn.layer_count)[b: b + 1]
                # A chain's kept positions (or the newest token's alone) are the pass's first ones: a slice. A tree's
                # kept path is picked out by index (kept rises from 0, so it is a prefix where it ends at its length).
                row.drafter.observe(row.sequence.shape[1] - 1, features[:, : len(kept)] if kept[-1] == len(kept) - 1
                                    else features.index_select(1, upload(kept, self.device)))
            if draft is not None:
                row.drafter.accepted(len(verdict.path))
            row.stats.target_forwards += 1
            row.stats.record_step(verdict.proposed, len(verdict.path), verdict.d)
            planned = draft is None or draft.planned  # (a copy's acceptance is not the planned drafter's)
            if row.config.gamma_schedule == "cost" and planned:
                if verdict.proposed:
                    row.acceptance.record(verdict.proposed, draft.ranks(verdict.path), row.breadth)
                else:
                    row.acceptance.fade()
            elif row.config.gamma_schedule == "cost":
                row.copies.record(verdict.proposed, draft.ranks(verdict.path))
            if row.config.gamma_schedule == "heuristic" and verdict.proposed and planned and \
                    (draft is None or draft.is_chain):
                row.size = row.size + 2 if len(verdict.path) == verdict.proposed else max(1, row.size - 1)
            new = verdict.emitted
            if row.logprobs is not None:  # token i came from the target's distribution at kept column i
                log_p = log_probs(logits[b, kept], row.config.sampling)
                row.token_logprobs += token_logprobs(log_p, new, row.logprobs)
            self._emit(row, new)

    def _tokens(self, drafts: dict[int, Draft | None], sizes: dict[int, int], rows: int, width: int) -> Tensor:
        """[rows, width]: each row's newest token, then its draft's (padding 0)."""
        if rows == 1 and width == 1 + sizes[0]:  # (one row: no writes into a new tensor, each cold after a pass)
            newest = self.slots[0].sequence[:, -1:]
            return torch.cat([newest, drafts[0].tokens[None]], 1) if sizes[0] else newest
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for b, draft in drafts.items():
            tokens[b, 0] = self.slots[b].sequence[0, -1]
            if sizes[b]:
                tokens[b, 1: 1 + sizes[b]] = draft.tokens
        return tokens

    def _tree_layout(self, drafts: dict[int, Draft | None], sizes: dict[int, int], chains: tuple[int, ...],
                     width: int) -> tuple[Tensor, Tensor]:
        """The tree [rows, width, width] and depths [rows, width] of a step where some rows draft trees: laid out
        on the host and sent at once, then the shapes of trees grown on the device written there."""
        tree, depths = (t.clone() for t in _chain_layout(chains, width, torch.device("cpu")))
        grown = []
        for b, draft in drafts.items():
            n = sizes[b]
            if n and not draft.is_chain:
                tree[b, 1: 1 + n, 0] = True
                if draft.grown is not None:
                    grown.append((b, draft))
                else:
                    tree[b, 1: 1 + n, 1: 1 + n] = draft.ancestors()
                    depths[b, 1: 1 + n] = torch.tensor(draft.depths)
        tree, depths = upload(tree, self.device), upload(depths, self.device)
        for b, draft in grown:
            n = sizes[b]
            tree[b, 1: 1 + n, 1: 1 + n] = draft.grown.ancestors
            depths[b, 1: 1 + n] = draft.grown.depths
        return tree, depths

    def _next_tokens(self, slots: list[int], logits: Tensor) -> dict[int, Pending]:
        """The next token of every row with no drafts, all at once (``_pick``)."""
        if not slots:
            return {}
        # (the first rows of the batch, as a single row's or a whole batch's are: a view, not a gathered copy)
        last = logits[: len(slots), 0] if slots == list(range(len(slots))) else logits[slots, 0]
        tokens = self._pick([self.slots[b] for b in slots], last)
        return {b: Pending(tokens[i: i + 1], next_token_only) for i, b in enumerate(slots)}

    @staticmethod
    def _pick(rows: list[Row | None], last: Tensor) -> Tensor:
        """The next token of each of ``rows`` from its logits, ``last`` [len(rows), V], on the device: greedy rows
        take the argmax; sampling rows draw from their own processed distribution with their own generator
        (None: a padding row, which takes the argmax)."""
        tokens = argmax(last)
        by_sampling: dict[Sampling, list[int]] = {}
        for i, row in enumerate(rows):
            if row is not None and not row.config.sampling.greedy:
                by_sampling.setdefault(row.config.sampling, []).append(i)
        for sampling, members in by_sampling.items():
            probs = sampling.probs(last[members])
            for j, i in enumerate(members):
                tokens[i] = sample(probs[j], rows[i].generator)
        return tokens

    def _emit(self, row: Row, new: list[int]) -> None:
        """Append a step's tokens to the row, stopping at EOS, the length limit or the callback."""
        new = new[: row.remaining]
        eos = set(row.config.eos_token_ids)
        cut = next((i + 1 for i, token in enumerate(new) if token in eos), None)
        if cut is not None:
            new = new[:cut]
        if row.generated == 0:
            row.stats.first_token_s = time.perf_counter() - row.started
        added = torch.tensor([new], dtype=torch.long)
        row.sequence = torch.cat([row.sequence, upload(added, self.device)], 1)
        if row.logprobs is not None:  # drop the entries of tokens cut off here
            del row.token_logprobs[row.generated:]
        # (the callback gets the tokens on the host: reading them there waits for nothing, where reading a
        # device copy would wait for the step queued ahead, ``lookahead``)
        stop = row.on_tokens is not None and bool(row.on_tokens(added))
        if cut is not None or stop:
            row.finish_reason = "stop"
        elif row.remaining <= 0:
            row.finish_reason = "length"


@functools.lru_cache(maxsize=256)
def _chain_layout(sizes: tuple[int, ...], width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The tree [rows, width, width] and depths [rows, width] of rows drafting chains of ``sizes`` tokens: each
    node sees itself and the nodes before it; padding sees itself alone, at depth 0. Kept: never written."""
    tree = torch.eye(width, dtype=torch.bool).repeat(len(sizes), 1, 1)
    depths = torch.zeros(len(sizes), width, dtype=torch.long)
    for b, n in enumerate(sizes):
        tree[b, : 1 + n, : 1 + n] = torch.ones(1 + n, 1 + n, dtype=torch.bool).tril()
        depths[b, : 1 + n] = torch.arange(1 + n)
    return tree.to(device), depths.to(device)


def _finish(pending: dict[int, Pending]) -> dict[int, Verdict]:
    """Every row's verdict, from one read of the device: the step's only wait for it."""
    entries = [entry.values for entry in pending.values()]
    values = (entries[0] if len(entries) == 1 else torch.cat(entries)).tolist()
    verdicts, start = {}, 0
    for b, entry in pending.items():
        count = entry.values.shape[0]
        verdicts[b] = entry.finish(values[start: start + count])
        start += count
    return verdicts


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
def decode(target: torch.nn.Module | TargetStep, drafter: Drafter | None, input_ids: Tensor, config: DecodeConfig,
           vocab_size: int, on_tokens: Callback | None = None) -> tuple[Tensor, Stats]:
    """Generate after ``input_ids`` ([1, L]): a batch of one. Returns the new tokens ([1, n]) and statistics.

    ``on_tokens`` sees each step's new tokens ([1, m], on the host) and may return True to stop (for stop
    strings). ``vocab_size`` is the shared vocabulary width: logit columns past it are dropped.
    """
    engine = Engine(target, vocab_size)
    row = engine.add(input_ids, config, None if config.method == "ar" else drafter, on_tokens)
    while engine.rows:
        engine.step()
    return row.sequence[:, row.prompt_len:], row.stats


def decode_batch(target: torch.nn.Module | TargetStep, prompts: list[Tensor], configs: list[DecodeConfig],
                 drafters: list[Drafter | None], vocab_size: int) -> list[tuple[list[int], Stats]]:
    """Decode every prompt ([1, L] each) under its config and drafter, all in one batch."""
    engine = Engine(target, vocab_size)
    rows = engine.add_many([Job(*job) for job in zip(prompts, configs, drafters, strict=True)])
    while engine.rows:
        engine.step()
    return [(row.tokens, row.stats) for row in rows]
