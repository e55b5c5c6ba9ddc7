"""The OpenAI-compatible front door: FastAPI app, SSE streaming, errors, auth, metrics.

The router tokenizes (chat template included), checks the request against the model's
context, admits or rejects it (429/503), and streams the workers' outputs back. It never
imports model code: workers do the math, the router does the talking.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router import responses as R
from pdserve.router.config import RouterConfig
from pdserve.router.controller import GoodputController
from pdserve.router.dispatch import Dispatcher, RequestFailed
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    new_id,
    now_s,
)
from pdserve.router.policies import NoWorkerAvailable, Overloaded
from pdserve.serve.protocol import Output, WireSampling

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(R.error_body(message, status, param=param), status_code=status)


class ModelFacts:
    """What the router knows of the served model: name, tokenizer, context length."""

    def __init__(self, config: RouterConfig) -> None:
        from transformers import AutoTokenizer  # tokenizers only; no model code

        model_dir = Path(config.model)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a checkpoint directory")
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.name = config.served_model_name or model_dir.name
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = int(hf_config.get("vocab_size", len(self.tokenizer)))
        self.max_model_len = int(config.max_model_len or
                                 hf_config.get("max_position_embeddings", 2048))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def build_app(config: RouterConfig, dispatcher: Dispatcher | None = None) -> FastAPI:
    model = ModelFacts(config)
    dispatcher = dispatcher or Dispatcher(config)
    controller = GoodputController(config.controller, dispatcher)
    metrics = RouterMetrics(model.name, controller)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        dispatcher.start()
        controller.start()
        yield
        await controller.close()
        await dispatcher.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.dispatcher, app.state.model, app.state.metrics = dispatcher, model, metrics
    app.state.controller = controller

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON")
        return _error(400, f"{where + ': ' if where else ''}{message}", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return _error(500, f"internal error: {type(exc).__name__}")

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return _error(413, f"request body of {length} bytes exceeds the limit of "
                               f"{config.max_request_bytes} bytes")
        return await call_next(request)

    async def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    @app.get("/health")
    async def health() -> Response:
        if dispatcher.is_ready():
            return JSONResponse({"status": "ok"})
        return _error(503, "not ready: waiting for workers")

    @app.get("/status")
    async def status() -> dict[str, Any]:
        """Every worker as the router sees it (the launcher prints this while starting)."""
        workers = []
        for w in dispatcher.workers:
            entry: dict[str, Any] = {"address": w.address, "role": w.role,
                                     "worker_id": w.worker_id, "is_alive": w.is_alive,
                                     "is_ready": w.is_ready, "num_inflight": w.num_inflight}
            if w.status is not None:
                entry.update(num_running=w.status.num_running, num_waiting=w.status.num_waiting,
                             num_free_blocks=w.status.num_free_blocks,
                             num_total_blocks=w.status.num_total_blocks,
                             kv_transfer=dict(w.status.kv_transfer))
            workers.append(entry)
        return {"ready": dispatcher.is_ready(), "workers": workers,
                "controller": controller.snapshot()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(dispatcher.workers), media_type="text/plain")

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": now_s(), "owned_by": "pdserve",
            "root": config.model, "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = model.tokenizer(body.prompt).input_ids
        else:
            prompt_ids = list(body.prompt)
        max_tokens = body.max_tokens or config.default_max_tokens
        return await _serve(request, body, prompt_ids, max_tokens, body.logprobs, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = model.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message)
        except Exception as exc:  # a template may raise on roles it does not know
            raise ApiError(400, f"chat template failed: {exc}", "messages") from None
        prompt_ids = model.tokenizer(text, add_special_tokens=False).input_ids
        max_tokens = body.requested_max_tokens or max(model.max_model_len - len(prompt_ids), 1)
        return await _serve(request, body, prompt_ids, max_tokens, body.num_logprobs, chat=True)

    async def _serve(request: Request, body: SamplingFields, prompt_ids: list[int],
                     max_tokens: int, num_logprobs: int | None, chat: bool) -> Response:
        arrival_s = time.monotonic()
        request_id = new_id("chatcmpl" if chat else "cmpl")
        _check_model(body.model)
        _check_lengths(prompt_ids, max_tokens)
        try:
            sampling = WireSampling(**body.sampling_dict(max_tokens), logprobs=num_logprobs)
            if sampling.min_tokens > sampling.max_tokens:
                raise ValueError("min_tokens must not exceed max_tokens")
            ctx, keys = await dispatcher.route_context(prompt_ids, body.cache_salt)
            if dispatcher.store_lookup is not None:
                metrics.labels(metrics.external_queries).inc(len(prompt_ids))
                metrics.labels(metrics.external_hits).inc(ctx.num_store_cached_tokens)
            first_worker = dispatcher.admit(request_id, ctx, keys)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except Overloaded as exc:
            metrics.labels(metrics.rejected, "overloaded").inc()
            raise ApiError(429, str(exc)) from None
        except NoWorkerAvailable as exc:
            metrics.labels(metrics.rejected, "no_worker").inc()
            raise ApiError(503, str(exc)) from None
        outputs = dispatcher.run(request_id, prompt_ids, sampling, body.cache_salt, first_worker)
        timing = _Timing(arrival_s)
        metrics.labels(metrics.prompt_tokens).inc(len(prompt_ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(outputs, request_id, chat, num_logprobs, include_usage, timing),
                media_type="text/event-stream")
        acc = await _collect(request, outputs, timing)
        logprobs = None
        if num_logprobs is not None:
            logprobs = (R.chat_logprobs(acc.logprobs, model.token_text) if chat else
                        R.completion_logprobs(acc.logprobs, model.token_text))
        make = R.chat_body if chat else R.completion_body
        return JSONResponse(make(request_id, now_s(), model.name, acc, logprobs))

    def _check_model(name: str | None) -> None:
        if name is not None and name != model.name:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")

    def _check_lengths(prompt_ids: list[int], max_tokens: int) -> None:
        if any(not 0 <= t < model.vocab_size for t in prompt_ids):
            raise ApiError(400, f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
        if len(prompt_ids) + max_tokens > model.max_model_len:
            raise ApiError(
                400, f"This model's maximum context length is {model.max_model_len} tokens. "
                f"However, you requested {len(prompt_ids) + max_tokens} tokens "
                f"({len(prompt_ids)} in the prompt, {max_tokens} in the completion).",
                "max_tokens")

    async def _collect(request: Request, outputs: AsyncIterator[Output], timing: _Timing
                       ) -> R.Accumulated:
        acc = R.Accumulated()

        async def consume() -> None:
            async with aclosing(outputs) as stream:
                async for output in stream:
                    timing.on_output(output)
                    acc.add(output)

        task = asyncio.create_task(consume())
        try:
            while not task.done():  # watch for a client that hung up
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
            await task
        except RequestFailed as exc:
            raise ApiError(503, f"request failed: {exc}") from None
        except NoWorkerAvailable as exc:
            raise ApiError(503, str(exc)) from None
        except asyncio.CancelledError:
            raise ApiError(499, "client disconnected") from None
        finally:
            if not task.done():
                task.cancel()
        _observe(timing, acc)
        return acc

    async def _stream(outputs: AsyncIterator[Output], request_id: str, chat: bool,
                      num_logprobs: int | None, include_usage: bool, timing: _Timing
                      ) -> AsyncIterator[bytes]:
        created, acc = now_s(), R.Accumulated()
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield R.sse(R.chat_chunk(request_id, created, model.name,
                                     {"role": "assistant", "content": ""}, None, None))
        try:
            async with aclosing(outputs) as stream:
                async for output in stream:
                    timing.on_output(output)
                    offset = len(acc.text)
                    acc.add(output)
                    logprobs = None
                    if num_logprobs is not None and output.logprobs:
                        logprobs = (R.chat_logprobs(output.logprobs, model.token_text) if chat
                                    else R.completion_logprobs(output.logprobs,
                                                               model.token_text, offset))
                    if chat:
                        chunk = R.chat_chunk(request_id, created, model.name,
                                             {"content": output.text}, output.finish_reason,
                                             logprobs)
                    else:
                        chunk = R.completion_chunk(request_id, created, model.name,
                                                   output.text, output.finish_reason, logprobs)
                    yield R.sse(chunk)
        except (RequestFailed, NoWorkerAvailable) as exc:
            yield R.sse(R.error_body(f"request failed: {exc}", 503))
            yield R.sse("[DONE]")
            return
        _observe(timing, acc)
        if include_usage:
            yield R.sse(R.usage_chunk(request_id, created, model.name, obj, acc))
        yield R.sse("[DONE]")

    def _observe(timing: _Timing, acc: R.Accumulated) -> None:
        num_tokens = len(acc.token_ids)
        controller.record_request(
            acc.num_prompt_tokens, acc.num_cached_tokens, num_tokens,
            None if timing.first_s is None else timing.first_s - timing.arrival_s)
        metrics.labels(metrics.generation_tokens).inc(num_tokens)
        metrics.labels(metrics.cached_tokens).inc(acc.num_cached_tokens)
        metrics.labels(metrics.success, acc.finish_reason or "unknown").inc()
        if timing.first_s is not None:
            metrics.labels(metrics.ttft).observe(timing.first_s - timing.arrival_s)
            e2e_s = timing.last_s - timing.arrival_s
            metrics.labels(metrics.e2e).observe(e2e_s)
            if num_tokens > 1:
                metrics.labels(metrics.tpot).observe(
                    (timing.last_s - timing.first_s) / (num_tokens - 1))
        for gap in timing.gaps_s:
            metrics.labels(metrics.itl).observe(gap)

    return app


class _Timing:
    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_s: float | None = None
        self.last_s = arrival_s
        self.gaps_s: list[float] = []

    def on_output(self, _: Output) -> None:
        now = time.monotonic()
        if self.first_s is None:
            self.first_s = now
        else:
            self.gaps_s.append(now - self.last_s)
        self.last_s = now
