"""The OpenAI response bodies of one request: its choices, log-probabilities, usage, and stream chunks."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..core.config import DecodeConfig
from .scheduler import Request as EngineRequest


class Reply:
    """Builds the OpenAI-shaped bodies of one request: its choices (prompts x n), log-probabilities, usage."""

    def __init__(self, chat: bool, model: str, prompt_tokens: list[int], n: int, config: DecodeConfig, tokenizer: Any,
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
        # (OpenAI's field for a prompt's first tokens served from an earlier request's cache: ``Engine.add_many``)
        cached = sum(request.stats.cached_tokens for request in requests if request.stats is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _decoding(self, requests: list[EngineRequest]) -> dict:
        stats = [r.stats for r in requests if r.stats is not None]
        proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
        tokens, forwards = sum(s.new_tokens for s in stats), sum(s.target_forwards for s in stats)
        return {**self.config.describe(), "acceptance_rate": accepted / proposed if proposed else None,
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


def sse(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()

