"""OpenAI response bodies: one place that turns worker outputs into completions, chat
completions, their streaming chunks, logprobs and usage."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.worker import Output, TokenLogprob


@dataclass
class Accumulated:
    """Everything a request produced so far, for the final body and usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """From the worker that computed the prompt (pdserve/router/prompt_outputs.py)."""

    def add(self, output: Output) -> None:
        self.text += output.text
        if self.prompt_logprobs is None:
            self.prompt_logprobs = output.prompt_logprobs
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs or []
        if not self.num_prompt_tokens:
            # The first worker's count: a decode worker counts the handed-off KV as cached,
            # but for usage "cached" means the prefix prefill did not have to compute.
            self.num_prompt_tokens = output.num_prompt_tokens
            self.num_cached_tokens = output.num_cached_tokens
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "total_tokens": self.num_prompt_tokens + len(self.token_ids),
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


TokenText = Callable[[int], str]
MIN_LOGPROB = -9999.0
"""What a -inf logprob (a token a grammar masked) is written as: JSON has no infinity, and
vLLM's server writes the same."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText,
                        text_offset_start: int = 0) -> dict[str, Any]:
    tokens = [token_text(e.token_id) for e in entries]
    offsets, offset = [], text_offset_start
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [{token_text(t): _finite(lp) for t, lp in e.top.items()}
                         for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {"content": [
        {**item(e.token_id, e.logprob),
         "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
        for e in entries
    ]}


def completion_body(request_id: str, created: int, model: str, acc: Accumulated,
                    logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": acc.text, "logprobs": logprobs,
                     "finish_reason": acc.finish_reason}],
        "usage": acc.usage(),
    }


def chat_body(request_id: str, created: int, model: str, acc: Accumulated,
              logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": acc.text},
                     "logprobs": logprobs, "finish_reason": acc.finish_reason}],
        "usage": acc.usage(),
    }


def completion_chunk(request_id: str, created: int, model: str, text: str,
                     finish_reason: str | None, logprobs: dict[str, Any] | None
                     ) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }


def chat_chunk(request_id: str, created: int, model: str, delta: dict[str, Any],
               finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, created: int, model: str, obj: str, acc: Accumulated
                ) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": acc.usage()}


def sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def error_body(message: str, code: int, err_type: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    err_type = err_type or {400: "BadRequestError", 401: "AuthenticationError",
                            404: "NotFoundError", 413: "RequestTooLargeError",
                            422: "UnprocessableEntityError", 429: "RateLimitError",
                            503: "ServiceUnavailableError"}.get(code, "InternalServerError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
