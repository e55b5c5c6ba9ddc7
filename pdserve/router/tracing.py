"""OpenTelemetry request tracing, as vLLM spells it: `--otlp-traces-endpoint URL` (or the
standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) exports one trace per request over OTLP
(HTTP/protobuf, batched off the event loop). Without an endpoint nothing here runs:
no provider, no exporter, no spans (the OpenTelemetry SDK is not even imported).

The router is the only process that traces. Its workers already report how long each of
their phases took (Output.phase_seconds, pdserve/router/phases.py), so once a request ends the
router builds the whole tree after the fact, each span with exact start and end times:

    llm_request                (SERVER; vLLM's span and gen_ai.* attributes)
    ├── admission              arrival -> request sent: tokenize (event), route, admit
    ├── queue                  first worker: waiting to be scheduled      (worker id)
    ├── prefill                first worker: the prompt's forward steps   (worker id)
    ├── kv_transfer            disaggregated: KV save on prefill -> the router's hand-off ->
    │                          KV load on decode          (source, destination, blocks, bytes)
    └── decode                 first token -> last output                 (worker id)

A worker's phases are durations on its own clock, laid back to back inside the interval the
router saw (request sent -> its first Output received), with the wire time left over split
evenly between the two directions; no clock is compared across processes. A colocated request
has no kv_transfer span. A request that fails or whose client goes away ends with an ERROR
status (and `error.type`); one refused at admission (429, 503) is traced too; requests the
router rejects as malformed (400) are not, as in vLLM. A migration (pdserve/router/dispatch.py) is
an event on the root span. An incoming W3C `traceparent` (and `tracestate`) header makes the
request's spans part of the caller's trace.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pdserve import envs
from pdserve.kvstore.block_key import KVLayout
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.phases import RequestPhases, WorkerLeg
from pdserve.router.responses import Accumulated

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from pdserve.router.streaming import RequestTiming
    from pdserve.router.worker_client import WorkerClient

logger = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "pdserve.router"
DEFAULT_SERVICE_NAME = "pdserve"
"""service.name unless OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES) names another."""
TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace-context headers a caller may send."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "float64": 8}

SPAN_REQUEST = "llm_request"
SPAN_ADMISSION = "admission"
SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"
SPAN_KV_TRANSFER = "kv_transfer"
SPAN_DECODE = "decode"


class SpanAttributes:
    """Attribute names: vLLM's (vllm/tracing/utils.py, after OpenTelemetry's gen_ai
    conventions) where the meaning is the same, then pdserve's own."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    ERROR_TYPE = "error.type"
    MODE = "pdserve.mode"
    """colocated | disaggregated"""
    NUM_CACHED_TOKENS = "pdserve.usage.cached_tokens"
    WORKER_ID = "pdserve.worker.id"
    WORKER_ROLE = "pdserve.worker.role"
    KV_SOURCE_WORKER_ID = "pdserve.kv_transfer.source_worker_id"
    KV_DESTINATION_WORKER_ID = "pdserve.kv_transfer.destination_worker_id"
    KV_NUM_BLOCKS = "pdserve.kv_transfer.num_blocks"
    KV_BYTES = "pdserve.kv_transfer.bytes"
    KV_SAVE_SECONDS = "pdserve.kv_transfer.save_seconds"
    KV_LOAD_SECONDS = "pdserve.kv_transfer.load_seconds"
    LAYER_SAVE_SECONDS = "pdserve.prefill.layer_save_seconds"
    HTTP_STATUS_CODE = "http.response.status_code"
    MIGRATION_RESUMED = "pdserve.migration.resumed"
    MIGRATION_REASON = "pdserve.migration.reason"


class RequestTracer:
    """The router's tracer: one TracerProvider of its own (the process-wide provider is left
    alone), and where per-request traces start."""

    def __init__(self, provider: TracerProvider,
                 workers: Callable[[], Sequence[WorkerClient]] = tuple) -> None:
        """`workers`: the router's workers, asked for a worker's KV layout (transfer bytes)."""
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        self.workers = workers

    @classmethod
    def create(cls, endpoint: str | None, workers: Callable[[], Sequence[WorkerClient]] = tuple
               ) -> RequestTracer | None:
        """An OTLP/HTTP exporter to `endpoint` behind a BatchSpanProcessor; None (tracing off,
        the SDK not imported) without an endpoint. ValueError when OTEL_EXPORTER_OTLP_TRACES_
        PROTOCOL asks for another protocol than http/protobuf."""
        if endpoint is None:
            return None
        envs.otlp_traces_protocol()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = new_provider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        logger.info("tracing requests to %s (OTLP over HTTP/protobuf)", endpoint)
        return cls(provider, workers)

    def start(self, request_id: str, model_name: str, sampling: SamplingParams,
              num_prompt_tokens: int, headers: Mapping[str, str], arrival_s: float
              ) -> RequestTrace:
        """A request's trace, once it is tokenized and checked (now: the end of tokenizing).
        """
        parent = None
        if any(name in headers for name in TRACE_HEADERS):
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
            parent = TraceContextTextMapPropagator().extract(
                {name: headers[name] for name in TRACE_HEADERS if name in headers})
        return RequestTrace(self, request_id, model_name, sampling, num_prompt_tokens,
                            parent, arrival_s, time.monotonic())

    def kv_block_bytes(self, worker_id: str) -> int | None:
        """One KV block's bytes on `worker_id`, from the layout it reports (None: unknown)."""
        status = next((w.status for w in self.workers()
                       if w.status is not None and w.status.worker_id == worker_id), None)
        if status is None or not status.kv_layout:
            return None
        try:
            layout = KVLayout(**status.kv_layout)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        dtype_bytes = DTYPE_BYTES.get(str(layout.dtype))
        return None if dtype_bytes is None else math.prod(layout.block_shape()) * dtype_bytes

    def flush(self, timeout_s: float = 3.0) -> None:
        """Export what is queued (the router's shutdown, within `pdserve up`'s 5-s grace;
        the provider shuts down at exit)."""
        self.provider.force_flush(int(timeout_s * 1000))


def new_provider() -> TracerProvider:
    """A TracerProvider whose resource names the service `pdserve` unless the environment
    (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) names it."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"pdserve.component": "router"})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return TracerProvider(resource=resource)


def start_trace(tracer: RequestTracer | None, headers: Mapping[str, str], request_id: str,
                model_name: str, sampling: SamplingParams, num_prompt_tokens: int,
                arrival_s: float) -> RequestTrace | None:
    """The request's trace, or None when tracing is off (then a caller's trace headers are
    ignored, with one warning, as vLLM does)."""
    if tracer is None:
        if "traceparent" in headers:
            _warn_tracing_disabled()
        return None
    return tracer.start(request_id, model_name, sampling, num_prompt_tokens, headers,
                        arrival_s)


@functools.cache
def _warn_tracing_disabled() -> None:
    logger.warning("a request came with a traceparent header but tracing is off "
                   "(--otlp-traces-endpoint)")


class RequestTrace:
    """One request's trace: what is known at its start, and its spans once it ends. Every
    time is time.monotonic() seconds; they become the wall-clock nanoseconds OpenTelemetry
    wants through one offset taken when the trace starts."""

    def __init__(self, tracer: RequestTracer, request_id: str, model_name: str,
                 sampling: SamplingParams, num_prompt_tokens: int, parent: Context | None,
                 arrival_s: float, tokenized_s: float) -> None:
        self.tracer = tracer
        self.request_id, self.model_name = request_id, model_name
        self.sampling, self.num_prompt_tokens = sampling, num_prompt_tokens
        self.parent = parent
        self.arrival_s, self.tokenized_s = arrival_s, tokenized_s
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self.is_ended = False

    def finish(self, timing: RequestTiming, acc: Accumulated) -> None:
        """The request ended normally (its last output is in)."""
        self._end(timing.phases, timing.first_s, timing.last_s, acc, error=None)

    def fail(self, timing: RequestTiming, acc: Accumulated, error: str, status: int) -> None:
        """The request failed (`status`: the HTTP status it got, 499 for a client that went
        away) after it was admitted."""
        self._end(timing.phases, timing.first_s, time.monotonic(), acc, (error, status))

    def refuse(self, error: str, status: int) -> None:
        """Admission refused the request (429 overloaded, 503 no worker)."""
        self._end(RequestPhases(self.arrival_s), None, time.monotonic(), Accumulated(),
                  (error, status))

    # ---- building the spans -----------------------------------------------------------------
    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.wall_offset_ns

    def _end(self, phases: RequestPhases, first_s: float | None, end_s: float,
             acc: Accumulated, error: tuple[str, int] | None) -> None:
        if self.is_ended:  # a request ends once; a late second report changes nothing
            return
        self.is_ended = True
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end_s = max(end_s, self.arrival_s)
        root = self.tracer.tracer.start_span(
            SPAN_REQUEST, context=self.parent, kind=SpanKind.SERVER,
            start_time=self._ns(self.arrival_s),
            attributes=self._root_attributes(phases, first_s, end_s, acc))
        if first_s is not None:
            root.add_event("first_token", timestamp=self._ns(first_s))
        for leg in (phases.first, phases.decode):
            for migration in leg.migrations:
                root.add_event("migration", timestamp=self._ns(migration.at_s), attributes={
                    SpanAttributes.WORKER_ROLE: migration.role,
                    SpanAttributes.WORKER_ID: migration.from_worker_id,
                    SpanAttributes.MIGRATION_RESUMED: migration.is_resumed,
                    SpanAttributes.MIGRATION_REASON: migration.reason})
        children = _ChildSpans(self, trace.set_span_in_context(root), end_s, error is not None)
        children.add_all(phases, num_completion_tokens=len(acc.token_ids))
        if error is not None:
            message, status = error
            root.set_attribute(SpanAttributes.HTTP_STATUS_CODE, status)
            root.set_attribute(SpanAttributes.ERROR_TYPE,
                               "aborted" if status == 499 else str(status))
            root.set_status(Status(StatusCode.ERROR, message))
        root.end(end_time=self._ns(end_s))

    def _root_attributes(self, phases: RequestPhases, first_s: float | None, end_s: float,
                         acc: Accumulated) -> dict[str, Any]:
        A, sampling = SpanAttributes, self.sampling
        attributes: dict[str, Any] = {
            A.GEN_AI_REQUEST_ID: self.request_id,
            A.GEN_AI_RESPONSE_MODEL: self.model_name,
            A.GEN_AI_USAGE_PROMPT_TOKENS: self.num_prompt_tokens,
            A.GEN_AI_USAGE_COMPLETION_TOKENS: len(acc.token_ids),
            A.NUM_CACHED_TOKENS: acc.num_cached_tokens,
            A.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            A.GEN_AI_REQUEST_TOP_P: sampling.top_p,
            A.GEN_AI_REQUEST_N: sampling.n,
            A.GEN_AI_LATENCY_E2E: end_s - self.arrival_s,
            A.MODE: "disaggregated" if phases.decode.sent_s is not None
            or phases.first.handoff is not None else "colocated",
        }
        if sampling.max_tokens is not None:
            attributes[A.GEN_AI_REQUEST_MAX_TOKENS] = sampling.max_tokens
        if acc.finish_reason is not None:
            attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] = [acc.finish_reason]
        worker_phases = phases.first.worker_phases
        if "queue" in worker_phases:
            attributes[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = worker_phases["queue"]
        prefill_s = worker_phases.get("prefill", 0.0) + worker_phases.get("layer_save", 0.0)
        if "prefill" in worker_phases:
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = prefill_s
        if first_s is not None:
            # vLLM's: first token -> last token (for pdserve: as the router received them)
            decode_s = max(0.0, end_s - first_s)
            attributes[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_s - self.arrival_s
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = decode_s
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = prefill_s + decode_s
        return attributes


class _ChildSpans:
    """The root's children, from the legs the dispatcher recorded (see the module docstring).
    Every interval is clamped into [arrival, end], so children nest inside their root."""

    def __init__(self, trace: RequestTrace, context: Context, end_s: float,
                 is_failed: bool) -> None:
        self.trace, self.context, self.end_s = trace, context, end_s
        self.is_failed = is_failed

    def add_all(self, phases: RequestPhases, num_completion_tokens: int) -> None:
        A, trace, first = SpanAttributes, self.trace, phases.first
        admitted_s = first.sent_s if first.sent_s is not None else self.end_s
        admission = self.span(SPAN_ADMISSION, trace.arrival_s, {},
                              is_unfinished=first.sent_s is None)
        admission.add_event("tokenized", timestamp=trace._ns(self.clamp(trace.tokenized_s)))
        admission.end(end_time=trace._ns(self.clamp(admitted_s)))
        if first.sent_s is None:  # refused, or failed before a worker got it
            return
        first_worker = {A.WORKER_ID: first.worker_id}
        if not first.is_complete:  # the first worker never answered
            self.add(SPAN_PREFILL, first.sent_s, self.end_s, first_worker, is_unfinished=True)
            return
        if "prefill" in first.worker_phases:
            t = _worker_start(first)
            queue_s = first.worker_phases.get("queue", 0.0)
            self.add(SPAN_QUEUE, t, t + queue_s, first_worker)
            t += queue_s
            layer_save_s = first.worker_phases.get("layer_save", 0.0)
            prefill_s = first.worker_phases["prefill"] + layer_save_s
            prefill_attributes = dict(first_worker)
            if layer_save_s:
                prefill_attributes[A.LAYER_SAVE_SECONDS] = layer_save_s
            self.add(SPAN_PREFILL, t, t + prefill_s, prefill_attributes)
            first_token_sampled_s = t + prefill_s
        else:  # a worker that reports no phases (an older peer): all it took, wire included
            assert first.received_s is not None
            self.add(SPAN_PREFILL, first.sent_s, first.received_s, first_worker)
            first_token_sampled_s = first.received_s
        if first.handoff is None:  # colocated, or prefill finished the request by itself
            if num_completion_tokens > 1:
                self.add(SPAN_DECODE, first_token_sampled_s, self.end_s, first_worker,
                         is_unfinished=self.is_failed)
            return
        self.add_handoff(phases, first_token_sampled_s)

    def add_handoff(self, phases: RequestPhases, kv_save_start_s: float) -> None:
        A, first, decode = SpanAttributes, phases.first, phases.decode
        assert first.handoff is not None
        source = first.handoff.prefill_worker_id or first.worker_id
        transfer = {A.KV_SOURCE_WORKER_ID: source,
                    A.KV_NUM_BLOCKS: len(first.handoff.block_keys),
                    A.KV_SAVE_SECONDS: first.worker_phases.get("kv_save", 0.0)}
        if decode.sent_s is None:  # the hand-off went nowhere: failed before a decode worker
            self.add(SPAN_KV_TRANSFER, kv_save_start_s, self.end_s, transfer,
                     is_unfinished=True)
            return
        transfer[A.KV_DESTINATION_WORKER_ID] = decode.worker_id
        block_bytes = self.trace.tracer.kv_block_bytes(decode.worker_id)
        if block_bytes is not None:
            transfer[A.KV_BYTES] = block_bytes * len(first.handoff.block_keys)
        decode_worker = {A.WORKER_ID: decode.worker_id}
        if not decode.is_complete:  # the decode worker never answered
            self.add(SPAN_KV_TRANSFER, kv_save_start_s, self.end_s, transfer,
                     is_unfinished=True)
            return
        kv_load_s = decode.worker_phases.get("kv_load", 0.0)
        transfer[A.KV_LOAD_SECONDS] = kv_load_s
        kv_loaded_s = _worker_start(decode) + kv_load_s
        self.add(SPAN_KV_TRANSFER, kv_save_start_s, kv_loaded_s, transfer)
        self.add(SPAN_DECODE, kv_loaded_s, self.end_s, decode_worker,
                 is_unfinished=self.is_failed)

    def clamp(self, at_s: float) -> float:
        return min(max(at_s, self.trace.arrival_s), self.end_s)

    def span(self, name: str, start_s: float, attributes: dict[str, Any],
             is_unfinished: bool = False) -> Span:
        """A started child span (the caller ends it); ERROR if the request failed while in
        it."""
        from opentelemetry.trace import Status, StatusCode

        span = self.trace.tracer.tracer.start_span(
            name, context=self.context, start_time=self.trace._ns(self.clamp(start_s)),
            attributes=attributes)
        if is_unfinished and self.is_failed:
            span.set_status(Status(StatusCode.ERROR, "the request failed during this phase"))
        return span

    def add(self, name: str, start_s: float, end_s: float, attributes: dict[str, Any],
            is_unfinished: bool = False) -> None:
        span = self.span(name, start_s, attributes, is_unfinished)
        span.end(end_time=self.trace._ns(max(self.clamp(end_s), self.clamp(start_s))))


def _worker_start(leg: WorkerLeg) -> float:
    """When the worker's first phase began, on the router's clock: its phases end where the
    wire time back begins, and the wire time is split evenly between the two ways."""
    assert leg.sent_s is not None
    return leg.sent_s + leg.transport_s() / 2
