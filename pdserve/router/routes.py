"""The router's endpoints. /health is always open; /status and /metrics are open unless the
operator asks for the API key there too; the OpenAI API (/v1/...) sits behind the API key when
one is set (`app.py` adds those dependencies).

A completion request goes: tokenize (chat template included, on a thread pool so a long prompt
never stalls the event loop) → check the model name and the context length → admit it on a
first worker (or refuse: 429 overloaded, 503 no worker) → stream or collect the workers'
outputs (`streaming.py`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.router.choices import check_num_seqs, sampling_for_ranking
from pdserve.router.config import RouterConfig
from pdserve.router.controller import GoodputController
from pdserve.router.dispatch import Dispatcher
from pdserve.router.errors import ApiError, error_response
from pdserve.router.logit_controls import check_controls
from pdserve.router.metrics import RouterMetrics, SupervisorCollector
from pdserve.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    new_id,
    now_s,
)
from pdserve.router.policies import NoWorkerAvailable, Overloaded
from pdserve.router.prompt_outputs import prompt_echo
from pdserve.router.streaming import Reply, RequestObserver, RequestTiming, collect, stream
from pdserve.router.structured_request import check_structured_outputs
from pdserve.router.tools import ToolPlan, check_history, template_message
from pdserve.router.tracing import RequestTracer, start_trace
from pdserve.router.worker_client import WorkerClient
from pdserve.tokenizer import load_tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) max_tokens of a /v1/completions request that sets none."""
NUM_TOKENIZER_THREADS = 2
"""Threads that tokenize and render chat templates. Hugging Face's fast tokenizers release
the GIL while encoding; every call uses the same settings (no truncation or padding), so the
tokenizer is never mutated while another thread encodes."""

T = TypeVar("T")


class ModelFacts:
    """What the router knows of the served model: name, tokenizer, context length."""

    def __init__(self, config: RouterConfig) -> None:
        model_dir = Path(config.model)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a checkpoint directory")
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.name = config.served_model_name or model_dir.name
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = int(hf_config.get("vocab_size", len(self.tokenizer)))
        self.max_model_len = int(config.max_model_len or
                                 hf_config.get("max_position_embeddings", 2048))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


@dataclass(frozen=True)
class ServingContext:
    """What the endpoints work with, built once per app by `build_app`."""

    config: RouterConfig
    model: ModelFacts
    dispatcher: Dispatcher
    controller: GoodputController
    metrics: RouterMetrics
    observer: RequestObserver
    cpu_pool: CpuPool
    tracer: RequestTracer | None = None
    """Request tracing (pdserve/router/tracing.py); None when no OTLP endpoint is set."""

    @classmethod
    def create(cls, config: RouterConfig, dispatcher: Dispatcher | None = None
               ) -> ServingContext:
        """Loads the tokenizer: raises FileNotFoundError/OSError for a bad checkpoint dir."""
        model = ModelFacts(config)
        dispatcher = dispatcher or Dispatcher(config)
        controller = GoodputController(config.controller, dispatcher)
        metrics = RouterMetrics(model.name, controller)
        dispatcher.on_migration = lambda role, resumed: metrics.labels(
            metrics.migrations, role, str(resumed).lower()).inc()
        if config.supervisor_state_file is not None:
            metrics.registry.register(SupervisorCollector(config.supervisor_state_file))
        return cls(config, model, dispatcher, controller, metrics,
                   RequestObserver(metrics, controller), CpuPool(NUM_TOKENIZER_THREADS),
                   RequestTracer.create(config.otlp_traces_endpoint, lambda: dispatcher.workers))

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the CPU pool, so the event loop keeps serving meanwhile."""
        return await self.cpu_pool.run(functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.cpu_pool.close()
        if self.tracer is not None:
            self.tracer.flush()


class CpuPool:
    """The threads that do a request's CPU work (tokenizing, chat templates). Started on
    first use and closed with the app's lifespan, so an app whose lifespan runs more than
    once (test clients) gets a fresh pool each time."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, call: Callable[[], T]) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.num_threads,
                                                thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def serving_context(request: Request) -> ServingContext:
    return request.app.state.serving


Serving = Annotated[ServingContext, Depends(serving_context)]

health_routes = APIRouter()
ops_routes = APIRouter()
openai_routes = APIRouter()


# ---- operations -------------------------------------------------------------------------
@health_routes.get("/health")
async def health(serving: Serving) -> Response:
    if serving.dispatcher.is_ready():
        return JSONResponse({"status": "ok"})
    return error_response(503, "not ready: waiting for workers")


@ops_routes.get("/status")
async def status(serving: Serving) -> dict[str, Any]:
    """Every worker as the router sees it (the launcher prints this while starting)."""
    workers = []
    for w in serving.dispatcher.workers:
        entry: dict[str, Any] = {"address": w.address, "role": w.role,
                                 "worker_id": w.worker_id, "is_alive": w.is_alive,
                                 "is_ready": w.is_ready, "num_inflight": w.num_inflight}
        if w.status is not None:
            entry.update(num_running=w.status.num_running, num_waiting=w.status.num_waiting,
                         num_free_blocks=w.status.num_free_blocks,
                         num_total_blocks=w.status.num_total_blocks,
                         num_cached_blocks=w.status.num_cached_blocks,
                         max_num_used_blocks=w.status.max_num_used_blocks,
                         kv_transfer=dict(w.status.kv_transfer), is_idle=w.status.is_idle,
                         cpu_path=dict(w.status.cpu_path), kv_tiers=dict(w.status.kv_tiers),
                         **({"sim": dict(w.status.sim)} if w.status.sim else {}),
                         status_age_s=time.monotonic() - w.status_received_s)
        workers.append(entry)
    dispatcher = serving.dispatcher
    out = {"ready": dispatcher.is_ready(), "workers": workers,
           "controller": serving.controller.snapshot(),
           "placement": {"local_prefill_max_tokens": dispatcher.placement.max_local_tokens,
                         **dispatcher.num_placed}}
    if serving.dispatcher.fleet_watch is not None:
        out["discovery"] = serving.dispatcher.fleet_watch.snapshot()
    return out


@ops_routes.get("/metrics")
async def prometheus(serving: Serving) -> Response:
    return Response(serving.metrics.render(serving.dispatcher.workers), media_type="text/plain")


# ---- OpenAI API -------------------------------------------------------------------------
@openai_routes.get("/v1/models")
async def models(serving: Serving) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": serving.model.name, "object": "model", "created": now_s(), "owned_by": "pdserve",
        "root": serving.config.model, "max_model_len": _max_model_len(serving)}]}


@openai_routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, serving: Serving) -> Response:
    arrival_s = time.monotonic()
    tokenizer = serving.model.tokenizer
    prompt_ids = (await serving.off_loop(lambda: tokenizer(body.prompt).input_ids)
                  if isinstance(body.prompt, str) else list(body.prompt))
    # echo with max_tokens=0: one token is generated and not shown (vLLM)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    return await _serve(serving, request, body, prompt_ids, max_tokens, body.logprobs,
                        is_chat=False, arrival_s=arrival_s)


@openai_routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: Serving
                           ) -> Response:
    arrival_s = time.monotonic()
    tools = ToolPlan.for_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                                 serving.config)
    check_history(body.messages)
    prompt_ids = await serving.off_loop(_chat_prompt_ids, serving.model.tokenizer, body, tools)
    return await _serve(serving, request, body, prompt_ids, body.requested_max_tokens,
                        body.num_logprobs, is_chat=True, arrival_s=arrival_s, tools=tools)


def _chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest, tools: ToolPlan | None,
                     add_special_tokens: bool = False) -> list[int]:
    """The chat template rendered and tokenized (CPU work: runs on the pool).
    `add_special_tokens`: /tokenize may ask for them on top of the template's."""
    messages = [template_message(m.role, m.text(), m.name, m.tool_calls, m.tool_call_id)
                for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools.template_tools() if tools else None, tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message)
    except Exception as exc:  # a template may raise on roles or message orders it rejects
        raise ApiError(400, f"chat template failed: {exc}", "messages") from None
    # The template already wrote the special tokens it wants (BOS and role markers).
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


async def _serve(serving: ServingContext, request: Request, body: SamplingFields,
                 prompt_ids: list[int], requested_max_tokens: int | None,
                 num_logprobs: int | None, is_chat: bool, arrival_s: float,
                 tools: ToolPlan | None = None) -> Response:
    """`arrival_s`: time.monotonic() when the endpoint got the parsed body (before
    tokenizing): TTFT and the request's phases start there. `tools`: a chat request's tool
    calling (pdserve/router/tools.py)."""
    request_id = new_id("chatcmpl" if is_chat else "cmpl")
    _check_model(serving.model, body.model)
    check_controls(body, serving.model.tokenizer, serving.model.vocab_size)
    echo = (await serving.off_loop(prompt_echo, body, prompt_ids, serving.model.tokenizer,
                                   serving.model.token_text, num_logprobs)
            if getattr(body, "echo", False) else None)
    # vLLM's rule: no max_tokens gets the room left in the context (a completion: OpenAI's
    # default of 16 when that fits); one that does not fit is the client's error. The
    # operator's default replaces both, and the operator's ceiling caps every request.
    config = serving.config
    default = config.default_max_tokens
    if default is None and not is_chat:
        default = COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = _check_lengths(serving.model, prompt_ids, requested_max_tokens, default,
                                config.max_tokens_ceiling, _max_model_len(serving))
    try:
        sampling = body.sampling_params(max_tokens, num_logprobs)
        if tools is not None:  # required and named choices constrain the output
            sampling = tools.sampling(sampling)
        if sampling.structured_outputs is not None:  # parses the schema/regex/grammar
            await serving.off_loop(check_structured_outputs, sampling.structured_outputs)
        check_num_seqs(sampling, serving.dispatcher.workers)  # n, best_of
        # (pdserve/router/choices.py)
        sampling = sampling_for_ranking(sampling)
    except ValueError as exc:
        raise ApiError(400, str(exc), getattr(exc, "param", None)) from None
    trace = start_trace(serving.tracer, request.headers, request_id, serving.model.name,
                        sampling, len(prompt_ids), arrival_s)
    # Counted before admission: the requests an overloaded pool refuses (429, 503) are
    # demand too, and the controller must plan for it (it would see a lighter load).
    serving.controller.record_arrival(len(prompt_ids), sampling.max_tokens, arrival_s)
    try:
        first_worker = await _admit(serving, request_id, prompt_ids, body.cache_salt)
    except ApiError as exc:
        if trace is not None:
            trace.refuse(exc.message, exc.status)
        raise
    timing = RequestTiming(arrival_s, trace, sampling.max_tokens)
    outputs = serving.dispatcher.run(request_id, prompt_ids, sampling, first_worker,
                                     phases=timing.phases)
    metrics = serving.metrics
    metrics.labels(metrics.prompt_tokens).inc(len(prompt_ids))
    reply = Reply(request_id, serving.model.name, serving.model.token_text, is_chat,
                  num_logprobs, tool_calls=tools.output() if tools else None, echo=echo,
                  num_choices=sampling.n)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(outputs, reply, timing, serving.observer, include_usage),
                                 media_type="text/event-stream")
    acc = await collect(request, outputs, timing, serving.observer)
    return JSONResponse(reply.body(now_s(), acc))


async def _admit(serving: ServingContext, request_id: str, prompt_ids: list[int],
                 cache_salt: str | None) -> WorkerClient:
    """The request's first worker, its slot reserved; or an ApiError that refuses it."""
    dispatcher, metrics = serving.dispatcher, serving.metrics
    try:
        ctx, keys = await dispatcher.route_context(prompt_ids, cache_salt)
        if dispatcher.store_lookup is not None:
            metrics.labels(metrics.external_queries).inc(len(prompt_ids))
            metrics.labels(metrics.external_hits).inc(ctx.num_store_cached_tokens)
        try:
            worker = dispatcher.admit(request_id, ctx, keys)
        except NoWorkerAvailable:  # a pool is empty for now (restarting): wait for a worker
            pools = [dispatcher.first_pool] + ([dispatcher.decode]
                                               if dispatcher.is_disaggregated else [])
            if not await dispatcher.wait_for_ready(pools):
                raise
            worker = dispatcher.admit(request_id, ctx, keys)
        if dispatcher.is_disaggregated:
            metrics.labels(metrics.placements,
                           "local" if worker.role == "decode" else "remote").inc()
        return worker
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    except Overloaded as exc:
        metrics.labels(metrics.rejected, "overloaded").inc()
        raise ApiError(429, str(exc)) from None
    except NoWorkerAvailable as exc:
        metrics.labels(metrics.rejected, "no_worker").inc()
        raise ApiError(503, str(exc)) from None


def _check_model(model: ModelFacts, name: str | None) -> None:
    if name is not None and name != model.name:
        raise ApiError(404, f"The model `{name}` does not exist.", "model")


def _max_model_len(serving: ServingContext) -> int:
    """The context served: the router's limit, or a worker's if smaller (see Dispatcher)."""
    reported = serving.dispatcher.max_model_len()
    limit = serving.model.max_model_len
    return limit if reported is None else min(limit, reported)


def _check_lengths(model: ModelFacts, prompt_ids: list[int], requested_max_tokens: int | None,
                   default_max_tokens: int | None, max_tokens_ceiling: int | None,
                   max_model_len: int) -> int:
    """The request's max_tokens: the one asked for if it fits in the context and under the
    ceiling (else a 400); without one, the room left, capped by the default and the
    ceiling."""
    if not prompt_ids:  # e.g. "" with a tokenizer that adds no BOS
        raise ApiError(400, "the prompt must not be empty: it has no tokens", "prompt")
    if any(not 0 <= t < model.vocab_size for t in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
    num_prompt = len(prompt_ids)
    room = max_model_len - num_prompt
    if requested_max_tokens is None and room <= 0:
        raise ApiError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your request has {num_prompt} input tokens, which leaves no room to generate. "
            "Please reduce the length of the input.", "prompt")
    if requested_max_tokens is None:
        caps = [c for c in (default_max_tokens, max_tokens_ceiling) if c is not None]
        return min([room, *caps])
    if max_tokens_ceiling is not None and requested_max_tokens > max_tokens_ceiling:
        raise ApiError(
            400, f"max_tokens is {requested_max_tokens}, but this server generates at most "
            f"{max_tokens_ceiling} tokens per request.", "max_tokens")
    if num_prompt + requested_max_tokens > max_model_len:
        raise ApiError(
            400, f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {num_prompt + requested_max_tokens} tokens "
            f"({num_prompt} in the prompt, {requested_max_tokens} in the completion).",
            "max_tokens")
    return requested_max_tokens
