"""The OpenAI request bodies this server takes, checked, and what each asks of the engine.

Every request may choose its own decoding in the body (``method``, ``fsd_threshold``, ``fsd_divergence``,
or ``target_acceptance`` instead of a threshold, ``gamma``, ``tree``, ...; ``options.OPTIONS`` names the
fields); what it leaves out comes from the server's own settings. ``decode_config`` decides the request
through ``DecodeConfig.from_options``, as every interface does, and names the field at fault in an error.
Fields of OpenAI's API that this server does not implement are refused by name, never ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model

from ..core.config import DecodeConfig, DrafterInfo
from ..options import OPTIONS, OptionError

# Decoding options a request may set, by request field (``options.OPTIONS`` declares them), and back.
REQUEST_OPTIONS = {option.request: option for option in OPTIONS if option.request}
FIELD_OF = {option.name: field for field, option in REQUEST_OPTIONS.items()}
# OpenAI request fields this server does not implement: refused (HTTP 400 naming them) unless they hold the
# value that means "off", so nothing is ever accepted and silently ignored.
UNSUPPORTED = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None,),
               "response_format": (None, {"type": "text"}), "tools": (None,), "tool_choice": (None, "none"),
               "functions": (None,), "function_call": (None, "none"), "suffix": (None, ""), "best_of": (None, 1),
               "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}
MAX_CHOICES = 16  # n at most
# Fields that only label a request (OpenAI clients send them): accepted, and nothing depends on them.
LABELS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort"}
MAX_TEMPERATURE = 2.0  # OpenAI's range


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


Options = create_model("Options", __base__=_Base, **{
    name: (_strict(option.default) | None, None) for name, option in REQUEST_OPTIONS.items()})


class CompletionBody(Options):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # how many top alternatives to report per token (0-5)
    echo: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None  # 0-20, with logprobs



def text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", "unsupported_content", "messages")
        parts.append(part["text"])
    return "".join(parts)


def decode_config(body: Options, chat: bool, *, model_name: str, defaults: dict[str, Any],
                  drafter: DrafterInfo | None, eos_token_ids: tuple[int, ...]) -> DecodeConfig:
    """The decoding a request asks for: its own fields over the server's ``defaults``, decided as every
    interface decides it. Raises APIError (404 for another model, 400 naming the field at fault)."""
    if body.model != model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                       "model_not_found", "model")
    for name, value in (body.model_extra or {}).items():
        if name in LABELS or (name in UNSUPPORTED and value in UNSUPPORTED[name]):
            continue
        what = "is not supported by this server" if name in UNSUPPORTED else "is not a field of this API"
        raise APIError(400, f"{name} {what}", "unsupported_parameter", name)
    options = dict(defaults)
    if body.target_acceptance is not None:  # the request's own calibrated T replaces the server's
        options.pop("threshold", None)
    options |= {option.name: getattr(body, field) for field, option in REQUEST_OPTIONS.items()
                if getattr(body, field) is not None}
    max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None:
        options["max_new_tokens"] = max_tokens
    temperature = options.get("temperature")
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(400, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "invalid_value",
                       "temperature")
    try:
        return DecodeConfig.from_options(options, drafter=drafter, eos_token_ids=eos_token_ids,
                                         target_acceptance=body.target_acceptance)
    except OptionError as error:
        field = FIELD_OF.get(error.option, error.option if error.option == "target_acceptance" else None)
        message = error.spelled(field or error.option)
        if error.option == "method" and drafter is None:
            message += ", and this server has none"
        raise APIError(400, message, "invalid_value", field) from None


def prompts_of(body: Options, chat: bool) -> list:
    """Each prompt of the request: chat messages, text, or token ids (a completion may send several)."""
    if chat:
        return [[{"role": m.role if m.role != "developer" else "system", "content": text_of(m.content)}
                 for m in body.messages]]
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(token, int) for token in prompt)):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt list is empty", "invalid_value", "prompt")
    return list(prompt)

def logprobs_of(body: Options, chat: bool) -> int | None:
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
