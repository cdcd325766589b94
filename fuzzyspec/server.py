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
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .api import ModelPair, eos_ids, make_config
from .calibrate import cached_calibration
from .decoding import METHODS
from .divergences import canonical_name
from .scheduler import QueueFull, Scheduler, Unavailable
from .scheduler import Request as EngineRequest
from .rules import FUZZY


@dataclass(frozen=True)
class ServeConfig:
    """Server-wide settings and the defaults of every per-request option."""

    model_name: str
    method: str = "fsd"
    divergence: str = "js"
    threshold: float = 0.3
    gamma: int = 5
    tree: bool = False              # EAGLE-2 draft trees (an EAGLE head as the drafter)
    tree_total_tokens: int = 16
    tree_depth: int = 5
    tree_top_k: int = 4
    temperature: float = 1.0        # OpenAI's default when a request gives none
    max_tokens: int = 256           # when a request gives none
    max_batch: int = 16
    max_queue: int = 64
    request_timeout: float = 300.0  # seconds from arrival, queueing included
    names: tuple[tuple[str, str], ...] = ()  # what identifies the models in the calibration cache


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class _Options(BaseModel):
    """Fields shared by both endpoints; unknown fields are ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    n: int = 1
    method: str | None = None
    fsd_threshold: float | None = None
    fsd_divergence: str | None = None
    target_acceptance: float | None = None
    gamma: int | None = None
    tree: bool | None = None


class CompletionBody(_Options):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


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
        self.engine = Scheduler(pair.target, pair.drafter, pair.tokenizer, pair.vocab_size, config.max_batch,
                                config.max_queue)
        self.context = getattr(pair.target.config, "max_position_embeddings", None) or math.inf
        self.eos = eos_ids(pair.target, pair.tokenizer)
        self.created = int(time.time())

    # -- turning a body into a decoding request ------------------------------------------------------
    def _decode_config(self, body: _Options, max_tokens: int | None) -> Any:
        c = self.config
        if body.model != c.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {c.model_name!r}",
                           "model_not_found", "model")
        if body.n != 1:
            raise APIError(400, "only n = 1 is supported", "unsupported_value", "n")
        max_tokens = c.max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "invalid_value", "max_tokens")
        method = body.method or c.method
        if method not in METHODS:
            raise APIError(400, f"unknown method {method!r}; valid: {', '.join(METHODS)}", "invalid_value", "method")
        if method != "ar" and self.pair.draft is None:
            raise APIError(400, f"method {method!r} needs a draft model, and this server has none", "invalid_value",
                           "method")
        divergence = body.fsd_divergence or c.divergence
        try:
            canonical_name(divergence)
        except ValueError as error:
            raise APIError(400, str(error), "invalid_value", "fsd_divergence") from None
        if body.fsd_threshold is not None and body.target_acceptance is not None:
            raise APIError(400, "give fsd_threshold or target_acceptance, not both", "invalid_value",
                           "target_acceptance")
        temperature = c.temperature if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {temperature}", "invalid_value", "temperature")
        options = dict(method=method, divergence=divergence, gamma=c.gamma if body.gamma is None else body.gamma,
                       threshold=c.threshold if body.fsd_threshold is None else body.fsd_threshold,
                       temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                       top_k=body.top_k or 0, seed=body.seed, max_new_tokens=max_tokens, eos_token_ids=self.eos,
                       tree=c.tree if body.tree is None else body.tree, tree_total_tokens=c.tree_total_tokens,
                       tree_depth=c.tree_depth, tree_top_k=c.tree_top_k)
        if body.seed is not None and not 0 <= body.seed < 2**63:
            raise APIError(400, f"seed must be in [0, 2**63), got {body.seed}", "invalid_value", "seed")
        try:
            config = make_config(**options)
        except ValueError as error:
            raise APIError(400, str(error), "invalid_value") from None
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

    def _ids(self, prompt: str | list[dict], chat: bool, max_tokens: int) -> Any:
        try:
            ids = self.pair.encode(prompt, chat=chat)
        except Exception as error:  # an empty prompt, or messages the chat template rejects
            raise APIError(400, f"{error}", "invalid_value", "messages" if chat else "prompt") from None
        if ids.shape[1] + max_tokens > self.context:
            raise APIError(400, f"the prompt ({ids.shape[1]} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"model's context of {self.context} tokens", "context_length_exceeded",
                           "messages" if chat else "prompt")
        return ids

    # -- running it ----------------------------------------------------------------------------------
    async def handle(self, http: Request, body: _Options, chat: bool) -> Response:
        deadline = time.monotonic() + self.config.request_timeout  # from arrival: calibration counts too
        max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None \
            else body.max_tokens
        config = self._decode_config(body, max_tokens)
        if chat:
            prompt: Any = [{"role": m.role if m.role != "developer" else "system", "content": _text_of(m.content)}
                           for m in body.messages]
        else:
            if isinstance(body.prompt, list):
                if len(body.prompt) != 1:
                    raise APIError(400, "send one prompt per request", "unsupported_value", "prompt")
                body.prompt = body.prompt[0]
            prompt = body.prompt
        ids = self._ids(prompt, chat, config.max_new_tokens)
        config = await self._threshold(body, config)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = EngineRequest(ids, config, tuple(stop), deadline=deadline, events=_ThreadSafe(loop, events))
        if await http.is_disconnected():  # gone while the request was being prepared: nothing to run
            raise APIError(400, "the client disconnected", "client_disconnected")
        try:
            self.engine.submit(request)
        except QueueFull as error:
            raise APIError(429, f"the server is busy ({error}); retry later", "queue_full", kind="rate_limit_error") \
                from None
        except Unavailable as error:
            raise APIError(503, str(error), "unavailable", kind="server_error") from None
        reply = _Reply(chat, self.config.model_name, ids.shape[1], config)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._stream(http, request, events, reply, usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for kind, payload in self._events(http, request, events):
            if kind == "error":
                raise APIError(500, payload, "engine_error", kind="server_error")
        if request.finish_reason == "timeout":
            raise APIError(504, f"the request ran out of time ({self.config.request_timeout:g} s)", "timeout",
                           kind="server_error")
        return JSONResponse(reply.full(request))

    async def _events(self, http: Request, request: EngineRequest, events: asyncio.Queue
                      ) -> AsyncIterator[tuple[str, Any]]:
        """The engine's events for one request until it is done. Twice a second (whether or not events
        come) it checks that the client is still there and that a queued request is not overdue, and
        cancels the request if not."""
        checked = time.monotonic()
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        request.cancel()
                        return
                    if checked > request.deadline + 1.0:  # the engine did not get to it in time
                        request.timed_out = True
                        request.cancel()
                        request.finish_reason = "timeout"
                        return
                if kind is None:
                    continue
                yield kind, payload
                if kind in ("done", "error"):
                    return
        finally:
            if request.finish_reason is None:
                request.cancel()  # the handler was cancelled (the client went away): free the row

    async def _stream(self, http: Request, request: EngineRequest, events: asyncio.Queue, reply: "_Reply",
                      usage: bool) -> AsyncIterator[bytes]:
        try:
            yield _sse(reply.chunk(role=True))
            async for kind, payload in self._events(http, request, events):
                if kind == "text":
                    yield _sse(reply.chunk(text=payload))
                elif kind == "error":
                    yield _sse({"error": {"message": payload, "type": "server_error", "code": "engine_error"}})
            if request.finish_reason == "timeout":
                yield _sse({"error": {"message": f"the request ran out of time ({self.config.request_timeout:g} s)",
                                      "type": "server_error", "code": "timeout"}})
            elif request.finish_reason in ("stop", "length"):
                yield _sse(reply.chunk(finish_reason=request.finish_reason))
                if usage:
                    yield _sse(reply.chunk(usage=reply.usage(request)))
            yield b"data: [DONE]\n\n"
        finally:  # also when the stream is closed before its first chunk went out
            if request.finish_reason is None:
                request.cancel()

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self) -> str:
        e, c = self.engine, self.engine.counters
        lines = []

        def metric(name: str, kind: str, help_text: str, values: dict[str, float] | float) -> None:
            lines.append(f"# HELP fuzzyspec_{name} {help_text}")
            lines.append(f"# TYPE fuzzyspec_{name} {kind}")
            if isinstance(values, dict):
                lines.extend(f'fuzzyspec_{name}{{outcome="{k}"}} {v}' for k, v in values.items())
            else:
                lines.append(f"fuzzyspec_{name} {values}")

        metric("requests_total", "counter", "Requests by outcome (rejected: turned away, queue full).",
               dict(c.requests))
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", c.prompt_tokens)
        metric("generated_tokens_total", "counter", "Tokens generated by finished requests.", c.generated_tokens)
        metric("draft_tokens_proposed_total", "counter", "Drafted tokens checked by the target.", c.proposed)
        metric("draft_tokens_accepted_total", "counter", "Drafted tokens accepted.", c.accepted)
        metric("acceptance_rate", "gauge", "Accepted / proposed drafts since start.",
               c.accepted / c.proposed if c.proposed else 0.0)
        metric("target_forwards_total", "counter", "Target passes of finished requests (per request).",
               c.target_forwards)
        metric("batch_steps_total", "counter", "Batched decoding steps.", c.steps)
        metric("tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
               round(e.tokens_per_s(), 3))
        metric("queue_depth", "gauge", "Requests waiting for a batch slot.", e.queue_depth)
        metric("active_requests", "gauge", "Requests in the running batch.", e.active)
        return "\n".join(lines) + "\n"


class _ThreadSafe:
    """Lets the engine thread put events on an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        self.loop, self.events = loop, events

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


class _Reply:
    """Builds the OpenAI-shaped bodies for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, config: Any) -> None:
        self.chat, self.model, self.prompt_tokens, self.config = chat, model, prompt_tokens, config
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, request: EngineRequest) -> dict:
        n = len(request.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def _decoding(self, request: EngineRequest) -> dict:
        stats = request.stats
        threshold = self.config.threshold  # JSON has no infinity: an infinite T is reported as "inf"
        return {"method": self.config.method, "divergence": self.config.divergence,
                "threshold": threshold if math.isfinite(threshold) else "inf", "gamma": self.config.gamma,
                "acceptance_rate": stats.acceptance_rate if stats else None,
                "mean_accepted": stats.mean_accepted if stats else None,
                "target_forwards": stats.target_forwards if stats else 0}

    def full(self, request: EngineRequest) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": request.text},
                      "finish_reason": request.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": request.text, "finish_reason": request.finish_reason, "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(request),
                "fuzzyspec": self._decoding(request)}

    def chunk(self, text: str | None = None, role: bool = False, finish_reason: str | None = None,
              usage: dict | None = None) -> dict:
        if usage is not None:
            choices: list = []
        elif self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        else:
            choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


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
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(error).__name__}: {error}", "internal_error",
                        kind="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = "the body is not valid JSON"
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, "invalid_request", where or None).response()

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionBody) -> Response:
        return await server.handle(http, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatBody) -> Response:
        return await server.handle(http, body, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.config.model_name, "object": "model",
                                            "created": server.created, "owned_by": "fuzzyspec"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = server.engine.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "active": server.engine.active,
                             "queued": server.engine.queue_depth}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    return app
