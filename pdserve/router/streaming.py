"""From the workers' Output stream to the client: SSE chunks as they come (`stream`) or one
accumulated response (`collect`), timing each request on the way (TTFT, TPOT, ITL, E2E) and
recording it in the metrics and the goodput controller's samples once it ends.

    dispatcher.run ──Output──▶ stream  ──▶ data: {chunk}\\n\\n ... data: [DONE]\\n\\n
                           └─▶ collect ──▶ Accumulated ──▶ Reply.body
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pdserve.protocol.worker import Output, TokenLogprob
from pdserve.router import responses as R
from pdserve.router.choices import (
    ChoicesAccumulated,
    choices_body,
    indexed_chunk,
    longest_choice,
)
from pdserve.router.controller import GoodputController
from pdserve.router.dispatch import RequestFailed
from pdserve.router.errors import ApiError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import now_s
from pdserve.router.phases import ROUTER_PHASES, RequestPhases
from pdserve.router.policies import NoWorkerAvailable
from pdserve.router.prompt_outputs import PromptEcho, with_prompt_outputs
from pdserve.router.tools import ToolCallOutput
from pdserve.router.tracing import RequestTrace

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks whether its client hung up."""


@dataclass(frozen=True)
class Reply:
    """How one request's outputs are rendered: as a completion or a chat completion, under
    which id and model name, with logprobs or without."""

    request_id: str
    model_name: str
    token_text: R.TokenText
    is_chat: bool
    num_logprobs: int | None
    tool_calls: ToolCallOutput | None = None
    """A chat request's tool calling: its text becomes content and tool calls
    (pdserve/router/tools.py); None: the text is the content."""
    echo: PromptEcho | None = None
    """A completion's echo: the prompt goes first (pdserve/router/prompt_outputs.py)."""
    num_choices: int = 1
    """n: the choices returned (of best_of generated, pdserve/router/choices.py)."""

    def logprobs(self, entries: Sequence[TokenLogprob], text_offset: int = 0
                 ) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        if self.is_chat:
            return R.chat_logprobs(entries, self.token_text)
        return R.completion_logprobs(entries, self.token_text, text_offset)

    def role_chunk(self, created: int) -> dict[str, Any] | None:
        """A chat stream opens by naming the speaker; a completion stream has no such chunk."""
        if not self.is_chat:
            return None
        return R.chat_chunk(self.request_id, created, self.model_name,
                            {"role": "assistant", "content": ""}, None, None)

    def chunk(self, created: int, output: Output, text_offset: int) -> dict[str, Any]:
        if self.echo is not None and output.index not in self.echo.echoed:
            text, logprobs = self.echo.first_delta(output.index, output.text,
                                                   output.token_ids, output.prompt_logprobs,
                                                   output.logprobs)
            return R.completion_chunk(self.request_id, created, self.model_name, text,
                                      output.finish_reason, logprobs)
        if self.echo is not None and self.echo.is_prompt_only:  # the prompt alone
            return R.completion_chunk(self.request_id, created, self.model_name, "",
                                      output.finish_reason, None)
        if self.echo is not None:
            text_offset += len(self.echo.text)
        # A delta without tokens (a bare finish) carries no logprobs, not an empty list.
        logprobs = self.logprobs(output.logprobs, text_offset) if output.logprobs else None
        if self.is_chat:
            return R.chat_chunk(self.request_id, created, self.model_name,
                                {"content": output.text}, output.finish_reason, logprobs)
        return R.completion_chunk(self.request_id, created, self.model_name, output.text,
                                  output.finish_reason, logprobs)

    def chunks(self, created: int, output: Output, text_offset: int) -> list[dict[str, Any]]:
        """The chunks to send for one output (several, or none, with tool calling)."""
        chunk = self.chunk(created, output, text_offset)
        if self.tool_calls is None:
            return [chunk]
        return self.tool_calls.rewrite_chunk(chunk, output.index)

    def usage_chunk(self, created: int, acc: R.Accumulated) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return R.usage_chunk(self.request_id, created, self.model_name, obj, acc)

    def body(self, created: int, acc: R.Accumulated) -> dict[str, Any]:
        make = R.chat_body if self.is_chat else R.completion_body

        def render(choice: R.Accumulated) -> dict[str, Any]:  # one choice's body
            body = make(self.request_id, created, self.model_name, choice,
                        self.logprobs(choice.logprobs))
            body = with_prompt_outputs(body, choice, self.echo, self.token_text,
                                       acc.prompt_logprobs)
            return body if self.tool_calls is None else self.tool_calls.rewrite_body(body)

        if isinstance(acc, ChoicesAccumulated):  # n > 1, best_of: one entry per choice
            return choices_body(render, acc, self.num_choices)
        return render(acc)


@dataclass
class RequestTiming:
    """When one request's outputs reached the router (time.monotonic seconds)."""

    arrival_s: float
    trace: RequestTrace | None = None
    """The request's trace (pdserve/router/tracing.py); None when tracing is off."""
    max_tokens: int = 0
    """The request's max_tokens (0: unknown): the controller scales arrivals' by it."""
    last_s: float = field(init=False)
    first_s: float | None = field(default=None, init=False)
    gaps_s: list[float] = field(default_factory=list, init=False)
    """Inter-token latencies: the time between two consecutive output deltas."""
    phases: RequestPhases = field(init=False)
    """Where the time to the first token went (the dispatcher fills it in)."""

    def __post_init__(self) -> None:
        self.last_s = self.arrival_s
        self.phases = RequestPhases(self.arrival_s)

    def on_output(self, _: Output) -> None:
        now = time.monotonic()
        if self.first_s is None:
            self.first_s = now
        else:
            self.gaps_s.append(now - self.last_s)
        self.last_s = now


@dataclass(frozen=True)
class RequestObserver:
    """Where a finished request's timing and token counts go."""

    metrics: RouterMetrics
    controller: GoodputController

    def observe(self, timing: RequestTiming, acc: R.Accumulated) -> None:
        metrics, num_tokens = self.metrics, len(acc.token_ids)
        ttft_s = None if timing.first_s is None else timing.first_s - timing.arrival_s
        # (under overload even the least-queued requests wait: the controller's TTFT overhead
        # would grow with the queue and make every split look as if it missed the SLO)
        queued_s = timing.phases.first.worker_phases.get("queue", 0.0)
        self.controller.record_request(acc.num_prompt_tokens, acc.num_cached_tokens,
                                       num_tokens,
                                       None if ttft_s is None else max(0.0, ttft_s - queued_s),
                                       timing.max_tokens)
        metrics.labels(metrics.generation_tokens).inc(num_tokens)
        metrics.labels(metrics.cached_tokens).inc(acc.num_cached_tokens)
        metrics.labels(metrics.success, acc.finish_reason or "unknown").inc()
        if timing.first_s is not None:
            metrics.labels(metrics.ttft).observe(ttft_s)
            phases = timing.phases.ttft_phases(timing.first_s)
            for phase, seconds in phases.items():
                metrics.labels(metrics.request_phase, phase).observe(seconds)
            if phases:
                metrics.labels(metrics.router_added).observe(
                    sum(phases[name] for name in ROUTER_PHASES))
            for phase, seconds in timing.phases.handover_phases().items():
                metrics.labels(metrics.handover_phase, phase).observe(seconds)
            metrics.labels(metrics.e2e).observe(timing.last_s - timing.arrival_s)
            num_sequence_tokens = longest_choice(acc)  # n > 1: its choices decode together
            if num_sequence_tokens > 1:
                metrics.labels(metrics.tpot).observe(
                    (timing.last_s - timing.first_s) / (num_sequence_tokens - 1))
        for gap_s in timing.gaps_s:
            metrics.labels(metrics.itl).observe(gap_s)
        if timing.trace is not None:
            timing.trace.finish(timing, acc)

    def observe_failure(self, timing: RequestTiming, acc: R.Accumulated, error: str,
                        status: int) -> None:
        """A request that failed after admission (`status`: the HTTP status it got, 499 for
        a client that went away)."""
        if timing.trace is not None:
            timing.trace.fail(timing, acc, error, status)


async def stream(outputs: AsyncIterator[Output], reply: Reply, timing: RequestTiming,
                 observer: RequestObserver, include_usage: bool) -> AsyncIterator[bytes]:
    """The request's outputs as SSE events, ending with `[DONE]`. The status line has gone out
    already, so a failure midway is an error event, not an HTTP error."""
    created, acc = now_s(), ChoicesAccumulated()
    role_chunk = reply.role_chunk(created)
    if role_chunk is not None:
        yield R.sse(role_chunk)
    try:
        async with aclosing(outputs) as deltas:
            async for output in deltas:
                timing.on_output(output)
                text_offset = len(acc.choice(output.index).text)
                acc.add(output)
                for chunk in reply.chunks(created, output, text_offset):
                    yield R.sse(indexed_chunk(chunk, output.index))
    except (RequestFailed, NoWorkerAvailable) as exc:
        observer.observe_failure(timing, acc, f"request failed: {exc}", 503)
        yield R.sse(R.error_body(f"request failed: {exc}", 503))
        yield R.sse("[DONE]")
        return
    except Exception:  # a bug: the client still gets an error event, not a cut connection
        logger.exception("a stream failed midway")
        observer.observe_failure(timing, acc, "internal error while streaming", 500)
        yield R.sse(R.error_body("internal error while streaming (see the router log)", 500))
        yield R.sse("[DONE]")
        return
    except (asyncio.CancelledError, GeneratorExit):  # the client went away midway
        observer.observe_failure(timing, acc, "client disconnected", 499)
        raise
    observer.observe(timing, acc)
    if include_usage:
        yield R.sse(reply.usage_chunk(created, acc))
    yield R.sse("[DONE]")


async def collect(request: Request, outputs: AsyncIterator[Output], timing: RequestTiming,
                  observer: RequestObserver) -> R.Accumulated:
    """All of the request's outputs, or an ApiError: 503 when the workers failed it, 499 when
    its client hung up (then the outputs are closed, which aborts it on the workers)."""
    acc = ChoicesAccumulated()  # each choice apart too (n > 1, best_of)

    async def consume() -> None:
        async with aclosing(outputs) as deltas:
            async for output in deltas:
                timing.on_output(output)
                acc.add(output)

    task = asyncio.create_task(consume())
    try:
        while not task.done():  # watch for a client that hung up
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        await task
    except RequestFailed as exc:
        observer.observe_failure(timing, acc, f"request failed: {exc}", 503)
        raise ApiError(503, f"request failed: {exc}") from None
    except NoWorkerAvailable as exc:
        observer.observe_failure(timing, acc, str(exc), 503)
        raise ApiError(503, str(exc)) from None
    except asyncio.CancelledError:
        observer.observe_failure(timing, acc, "client disconnected", 499)
        raise ApiError(499, "client disconnected") from None
    finally:
        if not task.done():
            task.cancel()
    observer.observe(timing, acc)
    return acc
