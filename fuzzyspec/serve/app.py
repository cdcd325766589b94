"""An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Requests (``schema``) are batched onto one engine at step granularity (``scheduler``); replies take
OpenAI's shapes (``replies``). Errors use OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, with 400 for bad input, 404 for an unknown model, 429 when the queue is full, 503 when the
engine is down and 504 when a request runs out of time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import ModelPair
from ..core.config import DecodeConfig
from ..eval.calibrate import cached_calibration
from ..options import SERVE_DEFAULTS
from .metrics import Collector, histograms
from .replies import Reply, sse
from .scheduler import QueueFull, Scheduler, Unavailable
from .scheduler import Request as EngineRequest
from .schema import (MAX_CHOICES, APIError, ChatBody, CompletionBody, Options, decode_config, logprobs_of,
                     prompts_of)

log = logging.getLogger("fuzzyspec.server")


@dataclass(frozen=True)
class ServeConfig:
    """Server-wide settings. ``defaults``: the decoding options a request does not set itself (the command
    line's, over ``options.SERVE_DEFAULTS``); the rest is decided as for any request."""

    model_name: str
    defaults: dict = field(default_factory=lambda: dict(SERVE_DEFAULTS))
    max_batch: int = 16
    max_queue: int = 64
    request_timeout: float = 300.0  # seconds from arrival, queueing included
    max_body_bytes: int = 1_000_000
    names: tuple[tuple[str, str], ...] = ()  # what identifies the models in the calibration cache


class Server:
    """The models, the engine and the request handling behind the routes."""

    def __init__(self, pair: ModelPair, config: ServeConfig) -> None:
        self.pair, self.config = pair, config
        self.registry = CollectorRegistry()
        observed = histograms(self.registry)
        self.scheduler = Scheduler(pair.step, pair.drafter, pair.tokenizer, pair.vocab_size, config.max_batch,
                                   config.max_queue, lambda name, value: observed[name].observe(value))
        self.registry.register(Collector(self.scheduler))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.context = getattr(pair.target.config, "max_position_embeddings", None) or math.inf
        self.created = int(time.time())

    def warm_up(self) -> None:
        """Compile the target's steps for one request of the server's defaults before the first client waits
        for it: every one-row shape its drafts may take (a compilation takes seconds to a minute on a small
        CPU, once: on the CPU the graphs are kept, ``core.kept``, and serve every cache capacity). A larger batch
        loads its graphs where an earlier process kept them; on the CPU, one whose graphs are not kept yet runs
        eagerly, and they compile while the server is idle (``TargetStep.defer``), rather than its requests
        waiting for them."""
        from ..tuning import prepare

        config = self.pair.config(**{**self.config.defaults, "max_new_tokens": 8})
        prepare(self.pair, config)
        self.pair.generate("Hello", config=config)
        self.pair.step.defer = True

    async def _threshold(self, body: Options, config: DecodeConfig) -> DecodeConfig:
        """Resolve ``target_acceptance`` into a threshold (calibrated once per setting, off the event loop)."""
        if body.target_acceptance is None:
            return config
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

    # -- running it ----------------------------------------------------------------------------------
    async def handle(self, http: Request, body: Options, chat: bool) -> Response:
        deadline = time.monotonic() + self.config.request_timeout  # from arrival: calibration counts too
        config = decode_config(body, chat, model_name=self.config.model_name, defaults=self.config.defaults,
                               drafter=self.pair.draft, eos_token_ids=self.pair.eos_token_ids)
        if not 1 <= body.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}]", "invalid_value", "n")
        logprobs = logprobs_of(body, chat)
        if logprobs is not None and config.draft_only:
            raise APIError(400, "fsd with an infinite threshold runs the drafter alone: it has no target "
                                "log-probabilities", "invalid_value", "logprobs")
        echo = not chat and body.echo
        loop = asyncio.get_running_loop()
        # Tokenizing a long prompt takes a while: off the event loop, so no stream stalls meanwhile.
        prompts = [await loop.run_in_executor(None, self._ids, prompt, chat, config.max_new_tokens)
                   for prompt in prompts_of(body, chat)]
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
                self.scheduler.submit(request)
        except QueueFull as error:
            for request in requests:
                request.cancel()
            raise APIError(429, f"the server is busy ({error}); retry later", "queue_full", kind="rate_limit_error") \
                from None
        except Unavailable as error:
            raise APIError(503, str(error), "unavailable", kind="server_error") from None
        reply = Reply(chat, self.config.model_name, [ids.shape[1] for ids in prompts], body.n, config,
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

    async def _stream(self, http: Request, requests: list[EngineRequest], events: asyncio.Queue, reply: Reply,
                      usage: bool) -> AsyncIterator[bytes]:
        try:
            for index in range(len(requests)):
                yield sse(reply.chunk(index, role=True, text=reply.echoed(index) or None))
            async for index, kind, payload in self._events(http, requests, events):
                if kind == "text":
                    text, entries = payload
                    yield sse(reply.chunk(index, text=text, entries=entries))
                elif kind == "error":
                    yield sse({"error": {"message": payload, "type": "server_error", "code": "engine_error"}})
                elif kind == "done" and requests[index].finish_reason in ("stop", "length"):
                    yield sse(reply.chunk(index, finish_reason=requests[index].finish_reason))
            if any(request.finish_reason == "timeout" for request in requests):
                yield sse({"error": {"message": f"the request ran out of time ({self.config.request_timeout:g} s)",
                                      "type": "server_error", "code": "timeout"}})
            elif usage and all(request.finish_reason in ("stop", "length") for request in requests):
                yield sse(reply.chunk(usage=reply.usage(requests)))
            yield b"data: [DONE]\n\n"
        finally:  # also when the stream is closed before its first chunk went out
            for request in requests:
                if request.finish_reason is None:
                    request.cancel()

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self) -> bytes:
        return generate_latest(self.registry)




class _ThreadSafe:
    """Lets the engine thread put one request's events, tagged with its choice index, on an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int = 0) -> None:
        self.loop, self.events, self.index = loop, events, index

    def put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *item))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


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


def create_app(server: Server) -> FastAPI:
    """The FastAPI application; the engine runs while the app does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        yield
        server.scheduler.stop()

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
        ok = server.scheduler.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "active": server.scheduler.active,
                             "queued": server.scheduler.queue_depth}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
