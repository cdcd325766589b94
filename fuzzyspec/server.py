"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every request may choose its own decoding in the body (``method``, ``fsd_threshold``,
``fsd_divergence``, or ``target_acceptance`` instead of a threshold, and ``gamma``); what it
leaves out comes from the command line. Requests are batched onto one engine at step
granularity. Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with 400 for bad input, 404 for an unknown model, 429 when the queue is full, 503 when the
engine is down and 504 when a request runs out of time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model

from .api import ModelPair, eos_ids, make_config
from .calibrate import cached_calibration
from .options import BY_NAME, OPTIONS
from .scheduler import QueueFull, Scheduler, Unavailable
from .scheduler import Request as EngineRequest
from .core.rules import FUZZY


# Decoding options a request may set, by request field (``options.OPTIONS`` declares them).
REQUEST_OPTIONS = {option.request: option for option in OPTIONS if option.request}
# OpenAI request fields this server does not implement: refused (HTTP 400 naming them) unless they hold the
# value that means "off", so nothing is ever accepted and silently ignored.
UNSUPPORTED = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None,),
               "response_format": (None, {"type": "text"}), "tools": (None,), "tool_choice": (None, "none"),
               "functions": (None,), "function_call": (None, "none"), "suffix": (None, ""), "best_of": (None, 1),
               "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}
MAX_CHOICES = 16  # n at most
# Fields that only label a request (OpenAI clients send them): accepted, and nothing depends on them.
LABELS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort"}
SERVER_DEFAULTS = {"temperature": 1.0, "max_new_tokens": 256}  # OpenAI's temperature; a length when none is asked
log = logging.getLogger("fuzzyspec.server")


@dataclass(frozen=True)
class ServeConfig:
    """Server-wide settings; ``defaults`` are the decoding options a request does not set itself."""

    model_name: str
    defaults: dict = field(default_factory=lambda: dict(SERVER_DEFAULTS))
    max_batch: int = 16
    max_queue: int = 64
    request_timeout: float = 300.0  # seconds from arrival, queueing included
    max_body_bytes: int = 1_000_000
    names: tuple[tuple[str, str], ...] = ()  # what identifies the models in the calibration cache

    def default(self, name: str) -> Any:
        return self.defaults.get(name, SERVER_DEFAULTS.get(name, BY_NAME[name].default))


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _strict(default: Any) -> Any:
    """The strict pydantic type of an option's values: "yes" is no bool, 1.5 no int."""
    if isinstance(default, bool):
        return StrictBool
    if isinstance(default, int) or default is None:
        return StrictInt
    if isinstance(default, float):
        return float
    return StrictStr


class _Base(BaseModel):
    """Fields shared by both endpoints. Other fields are kept aside and checked (``UNSUPPORTED``, ``LABELS``)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    target_acceptance: float | None = None
    n: StrictInt = 1


_Options = create_model("_Options", __base__=_Base, **{
    name: (_strict(option.default) | None, None) for name, option in REQUEST_OPTIONS.items()})


class CompletionBody(_Options):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # how many top alternatives to report per token (0-5)
    echo: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None  # 0-20, with logprobs


def _param_of(message: str) -> str | None:
    """The request field a DecodeConfig error is about (its message names the option)."""
    for field_name, option in sorted(REQUEST_OPTIONS.items(), key=lambda item: -len(item[1].name)):
        if re.search(rf"\b{option.name}\b", message):
            return field_name
    return "fsd_divergence" if "divergence" in message else None


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", "unsupported_content", "messages")
        parts.append(part["text"])
    return "".join(parts)


class Server:
    """The models, the engine and the request handling behind the routes."""

    def __init__(self, pair: ModelPair, config: ServeConfig) -> None:
        self.pair, self.config = pair, config
        self.registry = CollectorRegistry()
        histograms = _histograms(self.registry)
        self.engine = Scheduler(pair.target, pair.drafter, pair.tokenizer, pair.vocab_size, config.max_batch,
                                config.max_queue, lambda name, value: histograms[name].observe(value))
        self.registry.register(_Collector(self.engine))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.context = getattr(pair.target.config, "max_position_embeddings", None) or math.inf
        self.eos = eos_ids(pair.target, pair.tokenizer)
        self.created = int(time.time())

    # -- turning a body into a decoding request ------------------------------------------------------
    def _decode_config(self, body: _Options, max_tokens: int | None) -> Any:
        c = self.config
        if body.model != c.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {c.model_name!r}",
                           "model_not_found", "model")
        for name, value in (body.model_extra or {}).items():
            if name in LABELS or (name in UNSUPPORTED and value in UNSUPPORTED[name]):
                continue
            what = "is not supported by this server" if name in UNSUPPORTED else "is not a field of this API"
            raise APIError(400, f"{name} {what}", "unsupported_parameter", name)
        options = {name: c.default(name) for name in BY_NAME}
        for field_name, option in REQUEST_OPTIONS.items():
            value = getattr(body, field_name)
            if value is not None:
                options[option.name] = value
        if max_tokens is not None:
            options["max_new_tokens"] = max_tokens
        if options["method"] != "ar" and self.pair.draft is None:
            raise APIError(400, f"method {options['method']!r} needs a drafter, and this server has none",
                           "invalid_value", "method")
        if body.fsd_threshold is not None and body.target_acceptance is not None:
            raise APIError(400, "give fsd_threshold or target_acceptance, not both", "invalid_value",
                           "target_acceptance")
        if not 0 <= options["temperature"] <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {options['temperature']}", "invalid_value",
                           "temperature")
        if options["seed"] is not None and not 0 <= options["seed"] < 2**63:
            raise APIError(400, f"seed must be in [0, 2**63), got {options['seed']}", "invalid_value", "seed")
        try:
            config = make_config(**options, eos_token_ids=self.eos)
        except ValueError as error:
            param = _param_of(str(error))
            message = str(error)
            if param is not None and REQUEST_OPTIONS[param].name != param:  # say it as the request does
                message = re.sub(rf"^{REQUEST_OPTIONS[param].name}\b", param, message)
            raise APIError(400, message, "invalid_value", param) from None
        if config.tree and (self.pair.draft is None or not self.pair.draft.drafts_trees):
            raise APIError(400, "tree drafting needs an EAGLE head as the server's drafter", "invalid_value", "tree")
        return config

    async def _threshold(self, body: _Options, config: Any) -> Any:
        """Resolve ``target_acceptance`` into a threshold (calibrated once per setting, off the event loop)."""
        if body.target_acceptance is None:
            return config
        if config.method not in FUZZY:
            raise APIError(400, "target_acceptance needs a fuzzy method (fsd or fsd-hybrid)", "invalid_value",
                           "target_acceptance")
        if not 0 < body.target_acceptance < 1:
            raise APIError(400, f"target_acceptance must be in (0, 1), got {body.target_acceptance}",
                           "invalid_value", "target_acceptance")
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                None, cached_calibration, self.pair, config, body.target_acceptance, dict(self.config.names))
        except Exception as error:
            raise APIError(500, f"calibrating the threshold failed: {error}", "calibration_failed",
                           "target_acceptance", "server_error") from None
        return dataclasses.replace(config, threshold=found["threshold"])

    def _ids(self, prompt: str | list[dict] | list[int], chat: bool, max_tokens: int) -> Any:
        where = "messages" if chat else "prompt"
        if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):  # token ids
            if not prompt:
                raise APIError(400, "a token-id prompt is empty", "invalid_value", where)
            if not all(0 <= token < self.pair.vocab_size for token in prompt):
                raise APIError(400, f"token ids must be in [0, {self.pair.vocab_size})", "invalid_value", where)
            ids = torch.tensor([prompt], device=self.pair.target.get_input_embeddings().weight.device)
        else:
            try:
                ids = self.pair.encode(prompt, chat=chat)
            except Exception as error:  # an empty prompt, or messages the chat template rejects
                raise APIError(400, f"{error}", "invalid_value", where) from None
        if ids.shape[1] + max_tokens > self.context:
            raise APIError(400, f"the prompt ({ids.shape[1]} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"model's context of {self.context} tokens", "context_length_exceeded", where)
        return ids

    @staticmethod
    def _prompts(body: _Options, chat: bool) -> list:
        """Each prompt of the request: chat messages, text, or token ids (a completion may send several)."""
        if chat:
            return [[{"role": m.role if m.role != "developer" else "system", "content": _text_of(m.content)}
                     for m in body.messages]]
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(token, int) for token in prompt)):
            return [prompt]
        if not prompt:
            raise APIError(400, "the prompt list is empty", "invalid_value", "prompt")
        return list(prompt)

    @staticmethod
    def _logprobs(body: _Options, chat: bool) -> int | None:
        """How many alternatives to report per token, or None when log-probabilities are not asked for."""
        if chat:
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
            if body.logprobs and not 0 <= (body.top_logprobs or 0) <= 20:
                raise APIError(400, "top_logprobs must be in [0, 20]", "invalid_value", "top_logprobs")
            return (body.top_logprobs or 0) if body.logprobs else None
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise APIError(400, "logprobs must be in [0, 5]", "invalid_value", "logprobs")
        return body.logprobs

    # -- running it ----------------------------------------------------------------------------------
    async def handle(self, http: Request, body: _Options, chat: bool) -> Response:
        deadline = time.monotonic() + self.config.request_timeout  # from arrival: calibration counts too
        max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None \
            else body.max_tokens
        config = self._decode_config(body, max_tokens)
        if not 1 <= body.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}]", "invalid_value", "n")
        logprobs = self._logprobs(body, chat)
        if logprobs is not None and config.draft_only:
            raise APIError(400, "fsd with an infinite threshold runs the drafter alone: it has no target "
                                "log-probabilities", "invalid_value", "logprobs")
        echo = not chat and body.echo
        loop = asyncio.get_running_loop()
        # Tokenizing a long prompt takes a while: off the event loop, so no stream stalls meanwhile.
        prompts = [await loop.run_in_executor(None, self._ids, prompt, chat, config.max_new_tokens)
                   for prompt in self._prompts(body, chat)]
        config = await self._threshold(body, config)
        stop = tuple([body.stop] if isinstance(body.stop, str) else list(body.stop or []))
        events: asyncio.Queue = asyncio.Queue()
        requests = []
        for index in range(len(prompts) * body.n):
            ids, sample = prompts[index // body.n], index % body.n
            # The n choices of one prompt are n draws: with a seed, seed, seed + 1, ...
            choice_config = config if sample == 0 or config.seed is None else \
                dataclasses.replace(config, seed=config.seed + sample)
            requests.append(EngineRequest(ids, choice_config, stop, logprobs=logprobs,
                                          prompt_logprobs=echo and logprobs is not None, deadline=deadline,
                                          events=_ThreadSafe(loop, events, index)))
        if await http.is_disconnected():  # gone while the request was being prepared: nothing to run
            raise APIError(400, "the client disconnected", "client_disconnected")
        try:
            for request in requests:
                self.engine.submit(request)
        except QueueFull as error:
            for request in requests:
                request.cancel()
            raise APIError(429, f"the server is busy ({error}); retry later", "queue_full", kind="rate_limit_error") \
                from None
        except Unavailable as error:
            raise APIError(503, str(error), "unavailable", kind="server_error") from None
        reply = _Reply(chat, self.config.model_name, [ids.shape[1] for ids in prompts], body.n, config,
                       self.pair.tokenizer, echo)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._stream(http, requests, events, reply, usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for _, kind, payload in self._events(http, requests, events):
            if kind == "error":
                raise APIError(500, payload, "engine_error", kind="server_error")
        if any(request.finish_reason == "timeout" for request in requests):
            raise APIError(504, f"the request ran out of time ({self.config.request_timeout:g} s)", "timeout",
                           kind="server_error")
        return JSONResponse(reply.full(requests))

    async def _events(self, http: Request, requests: list[EngineRequest], events: asyncio.Queue
                      ) -> AsyncIterator[tuple[int, str, Any]]:
        """The engine's events (choice index, kind, payload) until every request is done. Twice a second
        (whether or not events come) it checks that the client is still there and that no queued request is
        overdue, and cancels them if not."""
        checked = time.monotonic()
        open_ = set(range(len(requests)))
        try:
            while open_:
                try:
                    index, kind, payload = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        for request in requests:
                            request.cancel()
                        return
                    if checked > requests[0].deadline + 1.0:  # the engine did not get to them in time
                        for request in requests:
                            if request.finish_reason is None:
                                request.timed_out = True
                                request.cancel()
                                request.finish_reason = "timeout"
                        return
                if kind is None:
                    continue
                yield index, kind, payload
                if kind in ("done", "error"):
                    open_.discard(index)
                    if kind == "error":
                        return
        finally:
            for request in requests:
                if request.finish_reason is None:
                    request.cancel()  # the handler was cancelled (the client went away): free the rows

    async def _stream(self, http: Request, requests: list[EngineRequest], events: asyncio.Queue, reply: "_Reply",
                      usage: bool) -> AsyncIterator[bytes]:
        try:
            for index in range(len(requests)):
                yield _sse(reply.chunk(index, role=True, text=reply.echoed(index) or None))
            async for index, kind, payload in self._events(http, requests, events):
                if kind == "text":
                    text, entries = payload
                    yield _sse(reply.chunk(index, text=text, entries=entries))
                elif kind == "error":
                    yield _sse({"error": {"message": payload, "type": "server_error", "code": "engine_error"}})
                elif kind == "done" and requests[index].finish_reason in ("stop", "length"):
                    yield _sse(reply.chunk(index, finish_reason=requests[index].finish_reason))
            if any(request.finish_reason == "timeout" for request in requests):
                yield _sse({"error": {"message": f"the request ran out of time ({self.config.request_timeout:g} s)",
                                      "type": "server_error", "code": "timeout"}})
            elif usage and all(request.finish_reason in ("stop", "length") for request in requests):
                yield _sse(reply.chunk(usage=reply.usage(requests)))
            yield b"data: [DONE]\n\n"
        finally:  # also when the stream is closed before its first chunk went out
            for request in requests:
                if request.finish_reason is None:
                    request.cancel()

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    """Reads the scheduler's counters at scrape time, as Prometheus counters and gauges."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self):
        e, c = self.scheduler, self.scheduler.counters
        requests = CounterMetricFamily("fuzzyspec_requests", "Requests by outcome (rejected: turned away, queue full).",
                                       labels=["outcome"])
        for outcome, count in dict(c.requests).items():
            requests.add_metric([outcome], count)
        yield requests
        for name, help_text, value in (
                ("prompt_tokens", "Prompt tokens of admitted requests.", c.prompt_tokens),
                ("generated_tokens", "Tokens generated by finished requests.", c.generated_tokens),
                ("draft_tokens_proposed", "Drafted tokens checked by the target.", c.proposed),
                ("draft_tokens_accepted", "Drafted tokens accepted.", c.accepted),
                ("target_forwards", "Target passes of finished requests (per request).", c.target_forwards),
                ("batch_steps", "Batched decoding steps.", c.steps)):
            yield CounterMetricFamily(f"fuzzyspec_{name}", help_text, value=value)
        for name, help_text, value in (
                ("acceptance_rate", "Accepted / proposed drafts since start.",
                 c.accepted / c.proposed if c.proposed else 0.0),
                ("tokens_per_second", "Tokens generated per second over the last 10 s.", round(e.tokens_per_s(), 3)),
                ("queue_depth", "Requests waiting for a batch slot.", e.queue_depth),
                ("active_requests", "Requests in the running batch.", e.active)):
            yield GaugeMetricFamily(f"fuzzyspec_{name}", help_text, value=value)


def _histograms(registry: CollectorRegistry) -> dict[str, Histogram]:
    """The distributions the scheduler observes (``Scheduler.observe``)."""
    return {
        "latency_seconds": Histogram("fuzzyspec_request_latency_seconds", "Arrival to the last token, per request.",
                                     buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=registry),
        "time_to_first_token_seconds": Histogram(
            "fuzzyspec_time_to_first_token_seconds", "Arrival to the first token, per request.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry),
        "tokens_per_target_pass": Histogram(
            "fuzzyspec_tokens_per_target_pass", "Tokens per target pass, per request (1 for AR).",
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8), registry=registry),
        "batch_size": Histogram("fuzzyspec_batch_size", "Rows in the batch, per decoding step.",
                                buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry),
    }


class _ThreadSafe:
    """Lets the engine thread put one request's events, tagged with its choice index, on an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int = 0) -> None:
        self.loop, self.events, self.index = loop, events, index

    def put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *item))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


class _Reply:
    """Builds the OpenAI-shaped bodies of one request: its choices (prompts x n), log-probabilities, usage."""

    def __init__(self, chat: bool, model: str, prompt_tokens: list[int], n: int, config: Any, tokenizer: Any,
                 echo: bool = False) -> None:
        self.chat, self.model, self.prompt_tokens, self.n, self.config = chat, model, prompt_tokens, n, config
        self.tokenizer, self.echo = tokenizer, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prompt_texts: dict[int, str] = {}

    def echoed(self, index: int, request: EngineRequest | None = None) -> str:
        """The prompt text a completion echoes (empty without echo)."""
        return self.prompt_texts.get(index, "") if self.echo else ""

    def usage(self, requests: list[EngineRequest]) -> dict:
        completion = sum(len(request.tokens) for request in requests)
        prompt = sum(self.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _decoding(self, requests: list[EngineRequest]) -> dict:
        stats = [r.stats for r in requests if r.stats is not None]
        proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
        tokens, forwards = sum(s.new_tokens for s in stats), sum(s.target_forwards for s in stats)
        threshold = self.config.threshold  # JSON has no infinity: an infinite T is reported as "inf"
        return {"method": self.config.method, "divergence": self.config.divergence,
                "threshold": threshold if math.isfinite(threshold) else "inf", "gamma": self.config.gamma,
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted": tokens / forwards if forwards else None, "target_forwards": forwards}

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def logprobs(self, entries: list, prompt_entries: list | None = None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for (token, logprob, top) entries; for a completion ``prompt_entries``
        come first (echo), the prompt's first token with no log-probability."""
        if self.chat:
            return {"content": [{"token": self._token(t), "logprob": lp, "bytes": list(self._token(t).encode()),
                                 "top_logprobs": [{"token": self._token(a), "logprob": alp,
                                                   "bytes": list(self._token(a).encode())} for a, alp in top]}
                                for t, lp, top in entries]}
        tokens, values, tops, offsets = [], [], [], []
        for token, value, top in (prompt_entries or []) + entries:
            text = self._token(token)
            tokens.append(text)
            values.append(value)
            tops.append({self._token(a): alp for a, alp in top} if top or value is not None else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_entries(self, request: EngineRequest) -> list:
        first = int(request.input_ids[0, 0])
        return [(first, None, [])] + list(request.prompt_token_logprobs)

    def full(self, requests: list[EngineRequest]) -> dict:
        choices = []
        for index, request in enumerate(requests):
            logprobs = None
            if request.logprobs is not None:
                logprobs = self.logprobs(request.token_logprobs, self._prompt_entries(request) if self.echo else None)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": request.text},
                                "finish_reason": request.finish_reason, "logprobs": logprobs})
            else:
                prompt = self.tokenizer.decode(request.input_ids[0].tolist()) if self.echo else ""
                choices.append({"index": index, "text": prompt + request.text, "finish_reason": request.finish_reason,
                                "logprobs": logprobs})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(requests),
                "fuzzyspec": self._decoding(requests)}

    def chunk(self, index: int = 0, text: str | None = None, role: bool = False, finish_reason: str | None = None,
              usage: dict | None = None, entries: list | None = None) -> dict:
        logprobs = self.logprobs(entries) if entries else None
        if usage is not None:
            choices: list = []
        elif self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["content"] = text
            choices = [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
        else:
            choices = [{"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}]
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, by their Content-Length or as they stream in.
    (A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide client disconnects from the routes.)"""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than {self.limit} bytes", "request_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large
            return message

        await self.app(scope, counted, send)


def _sse(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def create_app(server: Server) -> FastAPI:
    """The FastAPI application; the engine runs while the app does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        server.engine.stop()

    app = FastAPI(title="fuzzyspec", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.error("500 on %s %s", request.method, request.url.path, exc_info=error)
        return APIError(500, f"internal error: {type(error).__name__}: {error}", "internal_error",
                        kind="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return APIError(error.status_code, str(error.detail), codes.get(error.status_code, "http_error")).response()

    app.add_middleware(BodyLimit, limit=server.config.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":  # its location is a byte offset, not a field
            return APIError(400, "the body is not valid JSON", "invalid_json").response()
        message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, "invalid_request", where or None).response()

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionBody) -> Response:
        return await server.handle(http, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatBody) -> Response:
        return await server.handle(http, body, chat=True)

    def model_card() -> dict:
        return {"id": server.config.model_name, "object": "model", "created": server.created, "owned_by": "fuzzyspec"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != server.config.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{server.config.model_name!r}", "model_not_found", "model")
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = server.engine.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "active": server.engine.active,
                             "queued": server.engine.queue_depth}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
