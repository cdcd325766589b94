"""Batched speculative decoding: many sequences at once, each accepting its own number of drafts.

Each model (target, and draft if any) keeps one KV cache for all rows at a common length L, with a
mask ``valid`` [B, L] saying which positions hold a real token of that row. A step feeds every row
the same number of tokens; whatever a row does not keep (rejected drafts, left padding) is only
marked invalid, so no row's cache is shifted or recomputed mid-step. A query attends to the valid
positions of its own row and to itself, at a position id equal to the number of valid positions
before it, which is what the row would see decoded alone. When holes make up most of a cache,
``compact`` packs each row's valid entries together.

Rows join and leave between steps (continuous batching): ``add`` prefills a prompt on its own and
merges its caches in; ``step`` runs one draft-verify round for every row and retires finished rows.
Every row carries its own ``DecodeConfig`` (rule, divergence, threshold, sampling, length, seed)
and random generator, and draws its random numbers in the same order as ``decoding.decode``, so a
row decodes as it would alone (exactly so in greedy mode, up to floating-point rounding).
Chains only: draft LMs sharing the target's vocabulary, or none (AR).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from .decoding import DecodeConfig, _divergences
from .rules import FUZZY, RULES
from .sampling import sample
from .stats import Stats
from .trees import model_mask

Callback = Callable[[Tensor], bool]


class PaddedCache:
    """A KV cache for B rows of different lengths: the tensors of a DynamicCache and a validity mask."""

    def __init__(self, cache: DynamicCache | None = None, valid: Tensor | None = None) -> None:
        self.cache = cache if cache is not None else DynamicCache()
        self.valid = valid if valid is not None else torch.zeros(0, 0, dtype=torch.bool)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    def _kv(self) -> list[tuple[Tensor, Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers
                if getattr(layer, "is_initialized", False) and layer.keys.numel()]

    def _rebuild(self, kv: list[tuple[Tensor, Tensor]], valid: Tensor) -> None:
        self.cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
        self.valid = valid

    def forward(self, model: torch.nn.Module, tokens: Tensor, new_valid: Tensor, logits_to_keep: int) -> Tensor:
        """Feed ``tokens`` [B, n] (``new_valid`` [B, n] marks the real ones); return the last
        ``logits_to_keep`` logits [B, logits_to_keep, V]. The new positions join the cache."""
        rows, n = tokens.shape
        cached = self.valid.shape[1]
        device = tokens.device
        valid = self.valid.to(device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        new_part = (new_valid[:, None, :] & causal[None]) | torch.eye(n, dtype=torch.bool, device=device)[None]
        mask = torch.cat([valid[:, None, :].expand(rows, n, cached), new_part], 2)[:, None]
        before = valid.sum(1, keepdim=True)
        positions = (before + new_valid.long().cumsum(1) - 1).clamp_min(0)
        out = model(input_ids=tokens, attention_mask=model_mask(model, mask), position_ids=positions,
                    past_key_values=self.cache,
                    use_cache=True, logits_to_keep=logits_to_keep)
        self.valid = torch.cat([valid, new_valid], 1)
        return out.logits

    def drop(self, row: int, start: int) -> None:
        """Mark row ``row``'s positions from ``start`` on invalid (what a step fed but the row does not keep)."""
        self.valid[row, start:] = False

    def select(self, rows: Tensor) -> None:
        """Keep only these rows (a [b] long index)."""
        if rows.numel() == 0:  # start over: an empty batch has no length either
            self._rebuild([], self.valid.new_zeros(0, 0))
            return
        kv = [(k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device))) for k, v in self._kv()]
        self._rebuild(kv, self.valid.index_select(0, rows.to(self.valid.device)))

    def extend(self, other: "PaddedCache") -> None:
        """Append ``other``'s rows below these, left-padding the shorter side with invalid positions."""
        mine, theirs = self._kv(), other._kv()
        length = max(self.valid.shape[1], other.valid.shape[1])

        def pad(kv: list[tuple[Tensor, Tensor]], like: list[tuple[Tensor, Tensor]], rows: int, have: int
                ) -> list[tuple[Tensor, Tensor]]:
            if not kv:  # no positions at all: zeros shaped like the other side's layers
                kv = [(k.new_zeros(rows, *k.shape[1:-2], 0, k.shape[-1]),
                       v.new_zeros(rows, *v.shape[1:-2], 0, v.shape[-1])) for k, v in like]
            extra = length - have
            return [(torch.cat([k.new_zeros(*k.shape[:-2], extra, k.shape[-1]), k], -2),
                     torch.cat([v.new_zeros(*v.shape[:-2], extra, v.shape[-1]), v], -2)) for k, v in kv]

        valid = torch.cat([_left_pad(self.valid, length), _left_pad(other.valid, length)], 0)
        if not mine and not theirs:
            self._rebuild([], valid)
            return
        a = pad(mine, theirs, self.rows, self.valid.shape[1])
        b = pad(theirs, mine, other.rows, other.valid.shape[1])
        self._rebuild([(torch.cat([ka, kb], 0), torch.cat([va, vb], 0)) for (ka, va), (kb, vb) in zip(a, b)], valid)

    def compact(self) -> None:
        """Pack each row's valid positions to the right end (left padding), dropping the holes."""
        counts = self.valid.sum(1)
        length = int(counts.max()) if self.rows else 0
        if length == self.valid.shape[1]:
            return
        # Sorting by (valid, position) puts each row's valid positions last, in order.
        order = torch.arange(self.valid.shape[1], device=self.valid.device)
        keys = self.valid.long() * self.valid.shape[1] + order
        index = keys.argsort(1)[:, -length:] if length else keys[:, :0]
        valid = self.valid.gather(1, index)
        kv = []
        for k, v in self._kv():
            gather = index.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            kv.append((k.gather(2, gather), v.gather(2, gather)))
        self._rebuild(kv, valid)

    @property
    def holes(self) -> int:
        return int(self.valid.shape[1] - self.valid.sum(1).max()) if self.rows else 0


def _left_pad(mask: Tensor, length: int) -> Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], length - mask.shape[1]), mask], 1)


def _prefill(model: torch.nn.Module, tokens: Tensor, real: Tensor) -> PaddedCache:
    """A cache of ``tokens`` [b, n] (n may be 0), of which ``real`` [b, n] are valid (left padding is not)."""
    cache = PaddedCache(valid=torch.zeros(tokens.shape[0], 0, dtype=torch.bool, device=tokens.device))
    if tokens.shape[1]:
        cache.forward(model, tokens, real, 1)
    return cache


@dataclass
class Row:
    """One sequence of the batch and everything that decides and records its decoding."""

    config: DecodeConfig
    on_tokens: Callback | None
    generator: torch.Generator
    stats: Stats
    started: float
    tokens: list[int] = field(default_factory=list)
    target_pending: list[int] = field(default_factory=list)  # fed to the target at the next step
    draft_pending: list[int] = field(default_factory=list)   # fed to the draft at the next step
    finish_reason: str | None = None  # "stop" (EOS or the callback) or "length" once finished

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class BatchDecoder:
    """Continuous batched decoding of AR, SD, FSD and FSD-hybrid rows with an optional draft LM.

    ``slots`` are the cache rows in order; a finished row leaves its slot empty (None) until enough
    slots are empty to be worth the copy of dropping them from the caches (``retire_fraction``).
    ``rows`` are the rows still decoding.
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None, vocab_size: int,
                 compact_after: int = 64, retire_fraction: float = 0.25) -> None:
        self.target, self.draft, self.vocab_size = target, draft, vocab_size
        self.compact_after = compact_after  # holes per row tolerated before compacting
        self.retire_fraction = retire_fraction
        self.slots: list[Row | None] = []
        device = target.get_input_embeddings().weight.device
        self.device = device
        self.draft_vocab = getattr(draft, "draft_vocab", None)
        self.target_cache = PaddedCache(valid=torch.zeros(0, 0, dtype=torch.bool, device=device))
        self.draft_cache = PaddedCache(valid=torch.zeros(0, 0, dtype=torch.bool, device=device))

    @property
    def rows(self) -> list[Row]:
        return [row for row in self.slots if row is not None]

    def _check(self, input_ids: Tensor, config: DecodeConfig) -> None:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError("add takes one prompt of at least one token, shaped [1, L]")
        if config.method != "ar" and self.draft is None:
            raise ValueError(f"method {config.method!r} needs a draft model")
        if config.tree or config.gamma_schedule != "constant" or config.draft_confidence:
            raise ValueError("batched decoding drafts fixed-length chains: no trees, gamma schedule or draft "
                             "confidence")
        if config.draft_only:
            raise ValueError("fsd with T = inf is the draft model decoding alone; batched decoding needs a "
                             "finite threshold")

    @torch.inference_mode()
    def add(self, input_ids: Tensor, config: DecodeConfig, on_tokens: Callback | None = None) -> Row:
        """Start decoding ``input_ids`` ([1, L]) under ``config``; it runs with the next ``step``."""
        return self.add_many([input_ids], [config], [on_tokens])[0]

    @torch.inference_mode()
    def add_many(self, prompts: list[Tensor], configs: list[DecodeConfig],
                 callbacks: list[Callback | None] | None = None) -> list[Row]:
        """Start decoding several prompts ([1, L] each), prefilled together in one left-padded pass."""
        for input_ids, config in zip(prompts, configs, strict=True):
            self._check(input_ids, config)
        callbacks = callbacks or [None] * len(prompts)
        prompts = [input_ids.to(self.device) for input_ids in prompts]
        # Everything but the last prompt token goes into the caches now; the last is fed at the first step.
        width = max(input_ids.shape[1] for input_ids in prompts) - 1
        heads = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        real = torch.zeros(len(prompts), width, dtype=torch.bool, device=self.device)
        for b, input_ids in enumerate(prompts):
            n = input_ids.shape[1] - 1
            if n:
                heads[b, width - n:] = input_ids[0, :-1]
                real[b, width - n:] = True
        target_rows = _prefill(self.target, heads, real)  # both before either joins: a failure leaves the batch as it was
        draft_rows = _prefill(self.draft, heads, real) if self.draft is not None else None
        self._retire(everything=True)
        self.target_cache.extend(target_rows)
        if draft_rows is not None:
            self.draft_cache.extend(draft_rows)
        added = []
        for input_ids, config, on_tokens in zip(prompts, configs, callbacks):
            generator = torch.Generator(device=self.device)
            if config.seed is None:
                generator.seed()
            else:
                generator.manual_seed(config.seed)
            last = int(input_ids[0, -1])
            row = Row(config, on_tokens, generator, Stats(method=config.method), time.perf_counter(),
                      target_pending=[last], draft_pending=[last])
            self.slots.append(row)
            added.append(row)
        return added

    def _retire(self, everything: bool = False) -> None:
        """Drop empty slots from the caches: all of them, or once they are ``retire_fraction`` of the batch."""
        empty = sum(row is None for row in self.slots)
        if not empty or (not everything and empty < max(1, self.retire_fraction * len(self.slots))
                         and empty < len(self.slots)):
            return
        keep = torch.tensor([i for i, row in enumerate(self.slots) if row is not None], dtype=torch.long)
        self.slots = [row for row in self.slots if row is not None]
        self.target_cache.select(keep)
        if self.draft is not None:
            self.draft_cache.select(keep)

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One draft-and-verify round for every row; returns the rows that finished (they leave the batch)."""
        if not self.rows:
            return []
        live = torch.tensor([row is not None for row in self.slots], device=self.device)
        # Drafts per row, as decode would choose them: none for AR, at most remaining - 1 (the step
        # adds one target token). The batch drafts the largest count; rows ignore drafts past theirs.
        counts = [0 if row is None or row.config.method == "ar" or self.draft is None
                  else min(row.config.gamma, row.remaining - 1) for row in self.slots]
        k = max(counts)
        draft_length = self.draft_cache.valid.shape[1]  # before this step's drafting
        if k:
            width = max(len(row.draft_pending) for row in self.rows)
            drafts, draft_logits = self._draft(counts, k, width)
        target_length = self.target_cache.valid.shape[1]
        feed = torch.tensor([row.target_pending if row is not None else [0] for row in self.slots],
                            device=self.device)
        if k:
            feed = torch.cat([feed, drafts], 1)
        feed_valid = live[:, None].expand(-1, feed.shape[1]).contiguous()
        logits = self.target_cache.forward(self.target, feed, feed_valid, k + 1)
        logits = logits[..., : self.vocab_size]
        verdicts = self._verify_ar(logits, counts)
        for b, (row, count) in enumerate(zip(self.slots, counts)):
            if row is None:
                continue
            if b in verdicts:
                accepted, next_token = 0, verdicts[b]
            else:
                start = time.perf_counter()
                row_drafts = drafts[b: b + 1, :count] if k else feed[b: b + 1, :0]
                row_draft_logits = draft_logits[b: b + 1, :count] if k else logits[b: b + 1, :0]
                accepted, next_token = self._verify(row, logits[b: b + 1, : count + 1], row_drafts,
                                                    row_draft_logits)
                row.stats.accept_s += time.perf_counter() - start
            row.stats.draft_forwards += k if count else 0
            # Keep the fed newest token and the accepted drafts; the step's other positions go.
            self.target_cache.drop(b, target_length + 1 + accepted)
            new = (drafts[b, :accepted].tolist() if accepted else []) + [next_token]
            if k:  # the draft was fed its pending tokens (right-aligned in ``width``) and drafts 1..k-1
                self.draft_cache.drop(b, draft_length + width + min(accepted, k - 1))
                row.draft_pending = ([int(drafts[b, k - 1])] if accepted == k else []) + [next_token]
            else:
                row.draft_pending = row.draft_pending + [next_token]
            row.target_pending = [next_token]
            self._emit(row, new)
        finished = [row for row in self.slots if row is not None and row.done]
        self.slots = [None if row is None or row.done else row for row in self.slots]
        self._retire()
        for cache in (self.target_cache, self.draft_cache):
            if cache.rows and cache.holes > self.compact_after:
                cache.compact()
        return finished

    def _verify_ar(self, logits: Tensor, counts: list[int]) -> dict[int, int]:
        """Next tokens of the AR rows (no drafts), all at once: {slot: token}. Greedy rows take the argmax;
        sampling rows draw from their own processed distribution with their own generator."""
        ar = [b for b, (row, count) in enumerate(zip(self.slots, counts)) if row is not None and count == 0]
        if not ar:
            return {}
        last = logits[ar, 0]
        tokens = last.argmax(-1)
        by_sampling: dict = {}
        for i, b in enumerate(ar):
            if not self.slots[b].config.sampling.greedy:
                by_sampling.setdefault(self.slots[b].config.sampling, []).append(i)
        for sampling, members in by_sampling.items():
            probs = sampling.probs(last[members])
            for j, i in enumerate(members):
                tokens[i] = sample(probs[j], self.slots[ar[i]].generator)
        for b in ar:
            self.slots[b].stats.target_forwards += 1
            self.slots[b].stats.record_step(0, 0, None)
        return dict(zip(ar, tokens.tolist()))

    def _draft(self, counts: list[int], k: int, width: int) -> tuple[Tensor, Tensor]:
        """k draft tokens per row ([B, k], target ids) and the draft's raw logits behind them ([B, k, N]).
        Row b picks its first counts[b] tokens under its own sampling and generator (as ``decode`` would);
        later ones, which it will ignore, are the draft's argmax and use no random numbers."""
        pending = torch.zeros(len(self.slots), width, dtype=torch.long, device=self.device)
        real = torch.zeros(len(self.slots), width, dtype=torch.bool, device=self.device)
        for b, row in enumerate(self.slots):
            if row is None:
                continue
            n = len(row.draft_pending)
            pending[b, width - n:] = torch.tensor(row.draft_pending, device=self.device)
            real[b, width - n:] = True
        columns = None if self.draft_vocab is not None else self.vocab_size
        logits = self.draft_cache.forward(self.draft, pending, real, 1)[:, -1, :columns]
        tokens, all_logits = [], []
        for i in range(k):
            token = logits.argmax(-1)
            for b, (row, count) in enumerate(zip(self.slots, counts)):
                if row is not None and i < count and not row.config.sampling.greedy:
                    sampling = row.config.sampling
                    token[b] = sampling.pick(logits[b: b + 1], sampling.probs(logits[b: b + 1]), row.generator)[0]
            if self.draft_vocab is not None:
                token = self.draft_vocab.to_target(token)
            tokens.append(token)
            all_logits.append(logits)
            if i + 1 < k:
                feed = token[:, None]
                logits = self.draft_cache.forward(self.draft, feed, real[:, -1:].clone(), 1)[:, -1, :columns]
        return torch.stack(tokens, 1), torch.stack(all_logits, 1)

    def _verify(self, row: Row, logits: Tensor, drafts: Tensor, draft_logits: Tensor) -> tuple[int, int]:
        """The row's rule on its own drafts: (accepted, next token), recorded in its statistics."""
        config, sampling = row.config, row.config.sampling
        p = sampling.probs(logits)
        q = sampling.probs(draft_logits)
        if self.draft_vocab is not None and drafts.shape[1]:
            draft_logits, q = self.draft_vocab.expand(draft_logits, float("-inf")), self.draft_vocab.expand(q)
        k = drafts.shape[1]
        d = _divergences(config, logits[:, :k], p[:, :k], draft_logits, q) if config.method in FUZZY else None
        rule = RULES["sd" if config.method == "ar" else config.method]
        accepted, next_token = rule(drafts, p, q, d, config.threshold, sampling.greedy, row.generator)
        n = int(accepted[0])
        row.stats.target_forwards += 1
        row.stats.record_step(k, n, d)
        return n, int(next_token[0])

    def _emit(self, row: Row, new: list[int]) -> None:
        """Append a step's tokens to the row, stopping at EOS, the length limit or the callback."""
        new = new[: row.remaining]
        eos = set(row.config.eos_token_ids)
        cut = next((i + 1 for i, token in enumerate(new) if token in eos), None)
        if cut is not None:
            new = new[:cut]
        if not row.tokens:
            row.stats.first_token_s = time.perf_counter() - row.started
        row.tokens += new
        stop = row.on_tokens is not None and bool(row.on_tokens(torch.tensor([new])))
        if cut is not None or stop:
            row.finish_reason = "stop"
        elif row.remaining <= 0:
            row.finish_reason = "length"
        if row.done:
            row.stats.new_tokens = len(row.tokens)
            row.stats.wall_s = time.perf_counter() - row.started


def decode_batch(target: torch.nn.Module, draft: torch.nn.Module | None, prompts: list[Tensor],
                 configs: list[DecodeConfig], vocab_size: int) -> list[tuple[list[int], Stats]]:
    """Decode every prompt ([1, L] each) under its config, all in one batch; (tokens, stats) per prompt."""
    decoder = BatchDecoder(target, draft, vocab_size)
    rows = [decoder.add(ids, config) for ids, config in zip(prompts, configs)]
    while decoder.rows:
        decoder.step()
    return [(row.tokens, row.stats) for row in rows]
