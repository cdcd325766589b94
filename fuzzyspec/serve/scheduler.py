"""Serving: a bounded queue of requests, batched onto one decoding ``Engine`` step by step.

One background thread owns the models. Between two decoding steps it retires finished or cancelled
rows and admits waiting requests (up to ``max_batch`` rows), so a request joins the running batch at
the next step instead of waiting for the batch to drain. Every request may use its own rule,
threshold, sampling, length, tree shape and drafter. Requests talk to the thread through thread-safe
events: text deltas as tokens are accepted, then one final result (or an error).

With a tensor-parallel target, rank 0 serves and the other ranks follow (``Scheduler.follow``): before each
thing the loop does to the engine (rows join, a step, a prompt scored, the batch reset) it tells them, and
they do the same to theirs, so every rank runs the same steps (``core.parallel``).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core import parallel
from ..core.config import DecodeConfig
from ..core.draft import Drafter
from ..core.engine import Engine, Job, Row, admit
from ..core.scoring import log_probs, target_logits, token_logprobs
from ..core.stats import Stats
from ..core.step import TargetStep
from ..text import TextStream


log = logging.getLogger("fuzzyspec.scheduler")
IDLE_TELL_S = 2.0  # how often an idle leader tells its followers it is alive (well inside parallel.TIMEOUT_S)


class QueueFull(Exception):
    """The waiting queue is at capacity (HTTP 429)."""


class Unavailable(Exception):
    """The engine is not running (HTTP 503)."""


@dataclass
class Request:
    """One generation request and what it has produced so far."""

    input_ids: torch.Tensor          # [1, L]
    config: DecodeConfig
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # record the tokens' log-probabilities and this many top alternatives
    prompt_logprobs: bool = False    # and the prompt's (for echo)
    deadline: float = float("inf")   # time.monotonic() after which it is abandoned
    id: int = field(default_factory=itertools.count().__next__)
    events: queue.Queue = field(default_factory=queue.Queue)  # ("text", (str, logprobs)) ... then ("done", self)
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)   # as Row.token_logprobs
    prompt_token_logprobs: list = field(default_factory=list)  # the same for prompt tokens 1 .. L - 1
    stats: Stats | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "timeout"
    timed_out: bool = False
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (a client went away); the row leaves the batch at the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class Counters:
    """Totals since start, for /metrics."""

    requests: dict[str, int] = field(default_factory=lambda: {
        "stop": 0, "length": 0, "cancelled": 0, "timeout": 0, "error": 0, "rejected": 0})
    prompt_tokens: int = 0
    generated_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    target_forwards: int = 0
    steps: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=1024))  # (start, end, tokens) per step


class Scheduler:
    """Runs requests in a batch on a background thread; ``make_drafter`` gives each request its drafter."""

    def __init__(self, target: torch.nn.Module | TargetStep, make_drafter: Callable[[DecodeConfig], Drafter | None],
                 tokenizer: Any, vocab_size: int, max_batch: int = 16, max_queue: int = 64,
                 observe: Callable[[str, float], None] | None = None) -> None:
        self.engine = Engine(target, vocab_size)
        self.make_drafter = make_drafter
        # observe(name, value): batch_size per step; latency_seconds, time_to_first_token_seconds and
        # tokens_per_target_pass per finished request (the server turns them into histograms).
        self.observe = observe or (lambda name, value: None)
        self.tokenizer = tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: deque[Request] = deque()
        self.running: dict[int, tuple[Request, Row, TextStream]] = {}
        self.counters = Counters()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._told = time.monotonic()  # when the followers last heard from this leader
        self.failure: parallel.ParallelError | None = None  # why a sharded server stopped by itself
        self.on_failure: Callable[[], None] | None = None  # told then (the command shuts its HTTP server down)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="fuzzyspec-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self._tell("stop")
        except parallel.ParallelError:  # the followers are gone already
            pass

    # -- tensor-parallel followers ---------------------------------------------------------------------
    def _tell(self, command: str, payload: Any = None) -> None:
        """Tell the other ranks of a sharded target what this rank (0) is about to do to its engine."""
        if self.engine.shards > 1:
            parallel.agree((command, payload))
            self._told = time.monotonic()

    def follow(self) -> None:
        """On a rank other than 0: do to this rank's engine what rank 0 does to its own, until it stops."""
        while True:
            command, payload = parallel.agree((None, None))
            if command == "stop":
                return
            try:
                if command == "add":
                    self.engine.add_many([Job(torch.tensor([ids]), config, self.make_drafter(config), None, logprobs)
                                          for ids, config, logprobs in payload])
                elif command == "step":
                    self.engine.step()
                elif command == "score":
                    target_logits(self.engine.target, torch.tensor([payload], device=self.engine.device), 1,
                                  self.engine.vocab_size)
                elif command == "reset":
                    self.engine = Engine(self.engine.step_fn, self.engine.vocab_size)
            except parallel.ParallelError:
                raise
            except Exception as error:  # rank 0 met the same error: it fails those requests and tells us to reset
                log.debug("a followed %s failed as on rank 0: %s", command, error)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request; raises QueueFull when ``max_queue`` requests already wait."""
        if not self.alive:
            raise Unavailable("the engine is not running")
        with self._lock:
            if len(self.waiting) >= self.max_queue:  # first let go of requests nobody waits for any more
                now = time.monotonic()
                dead = [r for r in self.waiting if r.cancelled or now > r.deadline]
                for r in dead:
                    self.waiting.remove(r)
                    self._close(r, "timeout" if now > r.deadline else "cancelled")
            if len(self.waiting) >= self.max_queue:
                self.counters.requests["rejected"] += 1
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(request)
        self._wake.set()
        return request

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def active(self) -> int:
        return len(self.running)

    def tokens_per_s(self, window: float = 10.0) -> float:
        """Tokens generated per second of wall time over the last ``window`` seconds (idle time included)."""
        now = time.monotonic()
        recent = [(start, n) for start, end, n in list(self.counters.recent) if now - end <= window]
        if not recent:
            return 0.0
        elapsed = now - max(now - window, min(start for start, _ in recent))
        return sum(n for _, n in recent) / max(elapsed, 1e-3)

    # -- the loop ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._admit()
            if not self.running:
                if self.engine.step_fn.deferred and not self.waiting:
                    self._compile_deferred()
                    continue
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                if time.monotonic() - self._told > IDLE_TELL_S:
                    try:
                        self._tell("idle")
                    except parallel.ParallelError as error:
                        self._fail_all(error)
                continue
            try:
                start = time.monotonic()
                rows = [row for _, row, _ in self.running.values()]
                before = sum(row.generated for row in rows)
                self._tell("step")
                finished = self.engine.step()
                after = sum(row.generated for row in rows)
            except Exception as error:  # a failing step fails its requests, not the server
                if self.engine.shards > 1 and isinstance(error, torch.distributed.DistError):
                    error = parallel.ParallelError(parallel.describe(error))  # a peer's collective failed
                self._fail_all(error, during="a decoding step")
                continue
            self.counters.steps += 1
            self.counters.recent.append((start, time.monotonic(), after - before))
            self.observe("batch_size", len(rows))
            for row in finished:
                self._finish(row)
        self._fail_all(Unavailable("the server is shutting down"))

    def _compile_deferred(self) -> None:
        """While idle, compile one graph that a batch ran eagerly without (``TargetStep.defer``). A request that
        arrives meanwhile waits for that one graph. One that cannot be compiled ends deferring: later shapes then
        compile as they occur, as without it."""
        step = self.engine.step_fn
        try:
            step.compile_deferred()
        except Exception:
            log.warning("compiling a deferred step failed; later shapes compile as they occur", exc_info=True)
            step.stop_deferring()

    def _admit(self) -> None:
        """Let waiting requests join the batch (together: one prefill for all who join at once)."""
        taken: list[tuple[Request, TextStream, list[Row]]] = []

        def take(count: int) -> list[Job]:
            jobs = []
            while len(jobs) < count:
                with self._lock:
                    if not self.waiting:
                        break
                    request = self.waiting.popleft()
                now = time.monotonic()  # read per request: preparing the ones before took time
                if now > request.deadline or request.cancelled:
                    self._close(request, "timeout" if now > request.deadline else "cancelled")
                    continue
                try:
                    if request.prompt_logprobs:
                        request.prompt_token_logprobs = self._prompt_logprobs(request)
                    drafter = self.make_drafter(request.config)
                except Exception as error:
                    self._error(request, error)
                    continue
                stream, owner = TextStream(self.tokenizer, request.stop), []  # owner: the row, once made
                jobs.append(Job(request.input_ids, request.config, drafter,
                                self._callback(request, stream, owner), request.logprobs))
                taken.append((request, stream, owner))
            if jobs:
                self._tell("add", [(job.input_ids[0].tolist(), job.config, job.logprobs) for job in jobs])
            return jobs

        try:
            joined = admit(self.engine, take, self.max_batch)
        except Exception as error:  # a join that fails fails its requests, not the batch
            for request, _, _ in taken:
                self._error(request, error)
            if isinstance(error, parallel.ParallelError):
                self._fail_all(error)
            return
        for (_, row), (request, stream, owner) in zip(joined, taken):
            owner.append(row)
            self.counters.prompt_tokens += request.input_ids.shape[1]
            self.running[id(row)] = (request, row, stream)

    def _prompt_logprobs(self, request: Request) -> list:
        """The target's log-probabilities of the prompt's tokens after the first, with top alternatives."""
        ids = request.input_ids.to(self.engine.device)
        self._tell("score", request.input_ids[0].tolist())
        log_p = log_probs(target_logits(self.engine.target, ids, 1, self.engine.vocab_size), request.config.sampling)
        return token_logprobs(log_p, ids[0, 1:].tolist(), request.logprobs or 0)

    def _callback(self, request: Request, stream: TextStream, owner: list[Row]) -> Callable[[torch.Tensor], bool]:
        def on_tokens(new: torch.Tensor) -> bool:
            if request.first_token_at is None:
                request.first_token_at = time.monotonic()
            delta = stream.push(new[0].tolist())
            row = owner[0] if owner else None
            entries = row.token_logprobs[row.generated - new.shape[1]:] if row is not None and row.logprobs \
                is not None else []
            if delta or entries:
                request.events.put(("text", (delta, entries)))
            if time.monotonic() > request.deadline:
                request.timed_out = True
            return stream.stopped or request.cancelled or request.timed_out
        return on_tokens

    def _finish(self, row: Row) -> None:
        request, _, stream = self.running.pop(id(row))
        tail = stream.finish()
        if tail:
            request.events.put(("text", (tail, [])))
        request.text, request.tokens, request.stats = stream.text, row.tokens, row.stats
        request.token_logprobs = row.token_logprobs
        # A row that ended on its own (EOS, stop string, length) keeps that reason even if its
        # deadline passed or its client left in the same step.
        ended = row.finish_reason == "length" or stream.stopped or (
            bool(row.tokens) and row.tokens[-1] in row.config.eos_token_ids)
        reason = row.finish_reason if ended else "timeout" if request.timed_out else "cancelled" \
            if request.cancelled else row.finish_reason
        c = self.counters
        now = time.monotonic()
        self.observe("latency_seconds", now - request.arrived)
        if request.first_token_at is not None:
            self.observe("time_to_first_token_seconds", request.first_token_at - request.arrived)
        if row.stats.mean_accepted is not None:
            self.observe("tokens_per_target_pass", row.stats.mean_accepted)
        c.generated_tokens += len(row.tokens)
        c.proposed += row.stats.proposed
        c.accepted += row.stats.accepted
        c.target_forwards += row.stats.target_forwards
        self._close(request, reason)

    def _close(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.counters.requests[reason] = self.counters.requests.get(reason, 0) + 1
        request.events.put(("done", request))

    def _error(self, request: Request, error: BaseException) -> None:
        self.counters.requests["error"] += 1
        request.finish_reason = "error"
        request.events.put(("error", f"{type(error).__name__}: {error}"))

    def _fail_all(self, error: BaseException, during: str | None = None) -> None:
        """Fail every running and waiting request and start over with an empty batch (``during``: what failed,
        for the log, where it was not a lost rank)."""
        if not isinstance(error, (parallel.ParallelError, Unavailable)):  # (shutting down: told to stop instead)
            try:
                self._tell("reset")
            except parallel.ParallelError as lost:  # it failed because a rank is gone (gloo's error for a peer
                error = lost  # lost inside the forward is a plain RuntimeError)
        if during is not None and not isinstance(error, parallel.ParallelError):
            log.error("%s failed; failing the %d requests in the batch", during, len(self.running), exc_info=error)
        for request, _, _ in list(self.running.values()):
            self._error(request, error)
        self.running.clear()
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        if isinstance(error, Unavailable):
            for request in waiting:
                self._error(request, error)
        else:
            with self._lock:
                self.waiting.extendleft(reversed(waiting))
        if isinstance(error, parallel.ParallelError):  # a lost rank: this server cannot go on
            self.failure = error  # the command says so once the server is down
            self._stopping.set()
            if self.on_failure is not None:
                self.on_failure()
            return
        self.engine = Engine(self.engine.step_fn, self.engine.vocab_size)
