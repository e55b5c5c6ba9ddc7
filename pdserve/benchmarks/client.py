"""Streaming OpenAI client: sends one request and times every token chunk as it arrives.

Timing follows vLLM's `bench serve` so numbers from the two agree on the same server:
- TTFT = first chunk carrying a choice minus the send time;
- ITL = gaps between successive token chunks (a chunk holding several tokens is one gap);
- latency (E2EL) = last token chunk minus the send time (the trailing usage chunk and
  `[DONE]` carry no token, so they do not stretch it).
One difference: on /v1/chat/completions a chunk whose delta holds only the role (no content)
is not a token, so it does not start the TTFT clock early.

Output token counts come from the stream's `usage` (requested with `include_usage`), else from
counting the generated text with the harness's tokenizer (done by the caller).

A failed request keeps its message (`error`, vLLM's per-request field) and a short cause
(`error_cause`) that failures are counted by: "HTTP 429 rate_limit_error" (status and the
OpenAI error type of the body, when it has one), "stream cut" (the connection closed before
the stream ended), "timeout", "connect", "stream error <type>" (an error event inside a
200 stream), "malformed stream", "empty stream" (ended without a token).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.benchmarks.datasets import BenchRequest


class ServerUnreachableError(RuntimeError):
    """The server did not answer at all (connection refused, DNS, timeout)."""


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how requests are sent."""

    base_url: str
    model: str
    # /v1/completions or /v1/chat/completions (any path containing "chat" is the chat API).
    endpoint: str = "/v1/completions"
    ignore_eos: bool = False
    # Seconds a request may wait for its connection or its next bytes (httpx's per-operation
    # timeout: a long stream that keeps producing tokens never times out).
    request_timeout_s: float = 3600.0
    # Sampling fields and any other JSON merged into every request body.
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got "
                             f"{self.base_url!r}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"--endpoint must start with '/', got {self.endpoint!r}")
        if not self.model:
            raise ValueError("a model name is required")
        if not self.request_timeout_s > 0:
            raise ValueError("request timeout must be > 0")

    @property
    def is_chat(self) -> bool:
        return "chat" in self.endpoint

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass
class RequestOutcome:
    """What one request measured (times in seconds, perf_counter clock)."""

    prompt_len: int
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_time_s: float = 0.0
    generated_text: str = ""
    # From the server's usage; None when it reported none.
    output_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens the server served from a prefix cache (usage.prompt_tokens_details)."""
    num_token_chunks: int = 0
    # Short failure class failures are counted by ("" on success); see the module docstring.
    error_cause: str = ""

    def fail(self, cause: str, message: str) -> RequestOutcome:
        self.success, self.error_cause, self.error = False, cause, message
        return self


def request_body(endpoint: EndpointConfig, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for `request` on `endpoint` (streaming, usage included)."""
    body: dict[str, Any] = {
        "model": endpoint.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.expected_output_len,
    }
    if endpoint.is_chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
        # The current OpenAI name; servers that only know max_tokens read that one.
        body["max_completion_tokens"] = request.expected_output_len
    else:
        body["prompt"] = request.prompt
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    body.update(endpoint.extra_body)
    return body


def _token_text(choice: dict[str, Any], is_chat: bool) -> str | None:
    """The text a choice carries, or None when the chunk holds no token (chat role-only)."""
    if not is_chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if text:
        return text
    # A finish chunk without content still closes a token (some servers send it last).
    return None


def _error_type(body: str) -> str | None:
    """The OpenAI error type ("rate_limit_error", ...) of an error body, or None."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error", document)  # vLLM's older bodies put type at the top
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code")
        return str(kind) if kind else None
    return None


def _transport_cause(error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    if isinstance(error, httpx.ConnectError):
        return "connect"
    if isinstance(error, httpx.RemoteProtocolError | httpx.ReadError):
        return "stream cut"  # peer closed mid-body (incomplete chunked read, reset)
    return type(error).__name__


async def _sse_lines(response: httpx.Response) -> AsyncIterator[tuple[str, float]]:
    """The stream's lines, each with the time its bytes arrived (perf_counter), as vLLM's
    client times a chunk on arrival, before parsing it. Reads the body's bytes and splits
    them itself: httpx's text line iterator costs a few hundred microseconds per token on a
    busy core, which showed as a TPOT excess against vLLM's client on the same server."""
    pending = b""
    async for data in response.aiter_bytes():
        arrived_s = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode(), arrived_s
    if pending:
        yield pending.rstrip(b"\r").decode(), time.perf_counter()


async def send_request(http: httpx.AsyncClient, endpoint: EndpointConfig,
                       request: BenchRequest) -> RequestOutcome:
    """Send `request`, stream the answer, and time it. Never raises for server-side errors."""
    outcome = RequestOutcome(prompt_len=request.prompt_len)
    body = request_body(endpoint, request)
    text_parts: list[str] = []
    start_s = time.perf_counter()
    outcome.start_time_s = start_s
    last_token_s = start_s
    try:
        async with http.stream("POST", endpoint.url, json=body,
                               timeout=endpoint.request_timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                kind = _error_type(detail)
                cause = f"HTTP {response.status_code}" + (f" {kind}" if kind else "")
                return outcome.fail(cause, f"HTTP {response.status_code}: {detail[:300]}")
            async for line, arrived_s in _sse_lines(response):
                # SSE: "data: <json>" lines; blank separators and ":" comments carry nothing.
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk and not chunk.get("choices"):
                    kind = _error_type(json.dumps(chunk))
                    return outcome.fail("stream error" + (f" {kind}" if kind else ""),
                                        f"server error in stream: {str(chunk['error'])[:300]}")
                now_s = arrived_s
                choices = chunk.get("choices")
                if choices:
                    token_text = _token_text(choices[0], endpoint.is_chat)
                    if token_text is not None:
                        if outcome.num_token_chunks == 0:
                            outcome.ttft_s = now_s - start_s
                        else:
                            outcome.itl_s.append(now_s - last_token_s)
                        last_token_s = now_s
                        outcome.num_token_chunks += 1
                        text_parts.append(token_text)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    outcome.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        outcome.prompt_len = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        outcome.cached_tokens = int(details["cached_tokens"])
    except httpx.HTTPError as e:
        return outcome.fail(_transport_cause(e), f"{type(e).__name__}: {e}")
    except (json.JSONDecodeError, TypeError, AttributeError, KeyError, ValueError) as e:
        return outcome.fail("malformed stream", f"malformed stream chunk: {e}")
    outcome.generated_text = "".join(text_parts)
    if outcome.num_token_chunks == 0:
        return outcome.fail("empty stream", "the stream carried no token")
    outcome.latency_s = last_token_s - start_s
    outcome.success = True
    return outcome


async def list_models(http: httpx.AsyncClient, base_url: str, timeout_s: float = 10.0
                      ) -> list[str]:
    """Model ids the server serves (GET /v1/models); raises ServerUnreachableError."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = await http.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ServerUnreachableError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        raise ServerUnreachableError(f"{url} answered HTTP {response.status_code}")
    try:
        return [str(m["id"]) for m in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ServerUnreachableError(f"{url} did not return an OpenAI model list: {e}") from e
