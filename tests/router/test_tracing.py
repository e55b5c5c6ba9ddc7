"""Request tracing (pdserve/router/tracing.py): the span tree the router builds from what its
workers report, the caller's trace continued, errors marked, and the spans reaching a real OTLP/HTTP
receiver from a `pdserve up` cluster started with --otlp-traces-endpoint.

The in-process tests run the real router app and dispatcher over scripted workers: each
answers a request, after a short wait, with the Outputs (and phase_seconds) a real worker of
its role sends, so every hook (dispatch, streaming, routes) runs as in a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.cluster_util import start_cluster, wait_until
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdserve.app import launcher
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import KVHandoff, Output, WorkerStatus
from pdserve.router import server, tracing
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.streaming import Reply, RequestObserver, RequestTiming, stream
from pdserve.router.tracing import RequestTracer, SpanAttributes
from pdserve.router.worker_client import Received, WorkerClient, WorkerDied

A = SpanAttributes
KV_LAYOUT = {"dtype": "float32", "block_size": 16, "num_layers": 2, "num_kv_heads": 2,
             "head_dim": 16, "kind": "mha"}
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x K,V x tokens x heads x head_dim x fp32
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
WAIT_S = 0.02
"""How long a scripted worker takes to answer; the phases it reports add up to half."""


class ScriptedWorker(WorkerClient):
    """A worker client whose worker is a script: no socket traffic, always alive, its id
    `<role>-<port>`. Each request gets the next script of its role (the last one repeats);
    an Output that counts prompt tokens counts the request's."""

    scripts: dict[str, list[list[Output | BaseException]]] = {}

    def start(self) -> None:
        worker_id = f"{self.role}-{self.address.rsplit(':', 1)[1]}"
        self.status = WorkerStatus(worker_id, self.role, "m", 256, True, 0, 0, 64, 64, 16,
                                   kv_layout=dict(KV_LAYOUT))
        self.last_seen_s = time.monotonic() + 3600

    async def generate(self, request):
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._reservations.pop(request.request_id, None)
        scripts = ScriptedWorker.scripts[self.role]
        script = scripts.pop(0) if len(scripts) > 1 else scripts[0]

        async def answer() -> None:
            for item in script:
                await asyncio.sleep(WAIT_S)
                if isinstance(item, BaseException):
                    queue.put_nowait(item)
                    return
                num_prompt_tokens = len(request.prompt_token_ids) if item.num_prompt_tokens else 0
                queue.put_nowait(Received(dataclasses.replace(
                    item, request_id=request.request_id, num_prompt_tokens=num_prompt_tokens),
                    time.monotonic()))

        self._tasks.append(asyncio.create_task(answer()))
        return queue

    async def abort(self, request_id: str) -> None:
        self.finish(request_id)


def _colocated_script() -> list[Output]:
    return [Output("", [5], "a", num_prompt_tokens=4,
                   phase_seconds={"queue": WAIT_S / 4, "prefill": WAIT_S / 4}),
            Output("", [6], "b"), Output("", [7], "c", "length")]


def _prefill_script() -> list[Output]:
    handoff = KVHandoff([bytes(32)] * 3, first_token_id=5, prefill_worker_id="prefill-1")
    return [Output("", [5], "a", "handoff", num_prompt_tokens=4, handoff=handoff,
                   phase_seconds={"queue": WAIT_S / 8, "prefill": WAIT_S / 4,
                                  "kv_save": WAIT_S / 8})]


def _decode_script() -> list[Output]:
    return [Output("", [6], "b", phase_seconds={"kv_load": WAIT_S / 4,
                                                "first_decode": WAIT_S / 4}),
            Output("", [7], "c", "length")]


@pytest.fixture
def traced(llama_dir, monkeypatch):
    """make(**config) -> (TestClient, exporter): the router app over scripted workers, its
    spans going to an in-memory exporter."""
    monkeypatch.setattr("pdserve.router.dispatch.WorkerClient", ScriptedWorker)
    monkeypatch.setattr(ScriptedWorker, "scripts", {})
    clients = []

    def make(**config_fields) -> tuple[TestClient, InMemorySpanExporter]:
        app = build_app(RouterConfig(model=str(llama_dir), **config_fields))
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        serving = app.state.serving
        assert serving.tracer is None  # no endpoint in the config
        app.state.serving = dataclasses.replace(
            serving, tracer=RequestTracer(provider, lambda: serving.dispatcher.workers))
        client = TestClient(app)
        clients.append(client.__enter__())
        return client, exporter

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _tree(exporter: InMemorySpanExporter):
    """(root, {name: child}) of the one trace exported; every child's parent is the root."""
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "llm_request"]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    children = {s.name: s for s in spans if s is not root}
    assert len(children) == len(spans) - 1  # one span of each name
    for child in children.values():
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    return root, children


def _in_order(*spans) -> None:
    """Each span ends no later than the next one starts (phases back to back)."""
    for before, after in zip(spans, spans[1:], strict=False):
        assert before.end_time <= after.start_time, (before.name, after.name)


def _complete(client: TestClient, headers: dict | None = None, **body) -> httpx.Response:
    return client.post("/v1/completions", headers=headers or {},
                       json={"prompt": "hello world", "max_tokens": 3, "temperature": 0,
                             **body})


def test_colocated_request_span_tree(traced):
    client, exporter = traced(colocated_addrs=("tcp://127.0.0.1:1",))
    ScriptedWorker.scripts["colocated"] = [_colocated_script()]
    r = _complete(client, top_p=0.5)
    assert r.status_code == 200, r.text
    root, children = _tree(exporter)
    assert set(children) == {"admission", "queue", "prefill", "decode"}  # no hand-off
    _in_order(children["admission"], children["queue"], children["prefill"],
              children["decode"])
    attrs = root.attributes
    assert root.kind == SpanKind.SERVER and root.status.status_code == StatusCode.UNSET
    assert attrs[A.GEN_AI_REQUEST_ID] == r.json()["id"]
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == r.json()["model"]
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == r.json()["usage"]["prompt_tokens"]
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 3
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 3
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == 0.5 and attrs[A.GEN_AI_REQUEST_TEMPERATURE] == 0
    assert attrs[A.GEN_AI_REQUEST_N] == 1
    assert tuple(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == ("length",)
    assert attrs[A.MODE] == "colocated"
    assert attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] == pytest.approx(WAIT_S / 4)
    assert attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] == pytest.approx(WAIT_S / 4)
    # TTFT: the first-token event, after the prefill span, and e2e the root's length
    ttft_ns = attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] * 1e9
    first_token = next(e for e in root.events if e.name == "first_token")
    assert first_token.timestamp - root.start_time == pytest.approx(ttft_ns, abs=1e3)
    assert children["prefill"].end_time <= first_token.timestamp
    assert attrs[A.GEN_AI_LATENCY_E2E] * 1e9 == pytest.approx(
        root.end_time - root.start_time, abs=1e3)
    assert ttft_ns < attrs[A.GEN_AI_LATENCY_E2E] * 1e9
    for name in ("queue", "prefill", "decode"):
        assert children[name].attributes[A.WORKER_ID] == "colocated-1"
    assert children["queue"].end_time - children["queue"].start_time == pytest.approx(
        WAIT_S / 4 * 1e9, abs=1e3)
    tokenized = children["admission"].events[0]
    assert tokenized.name == "tokenized"
    assert children["admission"].start_time <= tokenized.timestamp <= children[
        "admission"].end_time


def test_disaggregated_request_span_tree(traced):
    client, exporter = traced(prefill_addrs=("tcp://127.0.0.1:1",),
                              decode_addrs=("tcp://127.0.0.1:2",))
    ScriptedWorker.scripts.update(prefill=[_prefill_script()], decode=[_decode_script()])
    with client.stream("POST", "/v1/completions", json={
            "prompt": "hello world", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        body = "".join(r.iter_text())
    assert body.endswith("data: [DONE]\n\n") and "error" not in body
    root, children = _tree(exporter)
    assert set(children) == {"admission", "queue", "prefill", "kv_transfer", "decode"}
    _in_order(children["admission"], children["queue"], children["prefill"],
              children["kv_transfer"], children["decode"])
    assert root.attributes[A.MODE] == "disaggregated"
    assert root.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 3
    assert children["prefill"].attributes[A.WORKER_ID] == "prefill-1"
    assert children["decode"].attributes[A.WORKER_ID] == "decode-2"
    transfer = children["kv_transfer"].attributes
    assert transfer[A.KV_SOURCE_WORKER_ID] == "prefill-1"
    assert transfer[A.KV_DESTINATION_WORKER_ID] == "decode-2"
    assert transfer[A.KV_NUM_BLOCKS] == 3 and transfer[A.KV_BYTES] == 3 * BLOCK_BYTES
    assert transfer[A.KV_SAVE_SECONDS] == pytest.approx(WAIT_S / 8)
    assert transfer[A.KV_LOAD_SECONDS] == pytest.approx(WAIT_S / 4)
    # the first token went out once prefill handed off: TTFT covers prefill, not decode
    ttft_ns = root.attributes[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] * 1e9
    assert children["prefill"].end_time <= root.start_time + ttft_ns + 1e3
    assert root.start_time + ttft_ns <= children["decode"].end_time


def test_worker_without_phases_gets_one_prefill_span(traced):
    """A worker that predates phase_seconds: its first-output interval is one prefill span."""
    client, exporter = traced(colocated_addrs=("tcp://127.0.0.1:1",))
    ScriptedWorker.scripts["colocated"] = [[
        dataclasses.replace(output, phase_seconds={}) for output in _colocated_script()]]
    assert _complete(client).status_code == 200
    root, children = _tree(exporter)
    assert set(children) == {"admission", "prefill", "decode"}
    _in_order(children["admission"], children["prefill"], children["decode"])
    assert A.GEN_AI_LATENCY_TIME_IN_QUEUE not in root.attributes


def test_traceparent_is_continued(traced):
    client, exporter = traced(colocated_addrs=("tcp://127.0.0.1:1",))
    ScriptedWorker.scripts["colocated"] = [_colocated_script()]
    r = _complete(client, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"})
    assert r.status_code == 200, r.text
    root, children = _tree(exporter)
    assert root.context.trace_id == int(TRACE_ID, 16)
    assert root.parent is not None and root.parent.span_id == int(PARENT_SPAN_ID, 16)
    assert root.parent.is_remote
    exporter.clear()  # without the header: a trace of its own
    assert _complete(client).status_code == 200
    root, _ = _tree(exporter)
    assert root.parent is None and root.context.trace_id != int(TRACE_ID, 16)


def test_failed_request_has_an_error_status(traced):
    client, exporter = traced(colocated_addrs=("tcp://127.0.0.1:1",))
    ScriptedWorker.scripts["colocated"] = [[Output("", [], "", "error", error="boom")]]
    r = _complete(client)
    assert r.status_code == 503, r.text
    root, children = _tree(exporter)
    assert root.status.status_code == StatusCode.ERROR and "boom" in root.status.description
    assert root.attributes[A.HTTP_STATUS_CODE] == 503
    assert root.attributes[A.ERROR_TYPE] == "503"
    assert children["admission"].status.status_code == StatusCode.UNSET


def test_refused_request_is_traced_with_an_error(traced):
    client, exporter = traced(colocated_addrs=("tcp://127.0.0.1:1",),
                              max_inflight_per_worker=1)
    worker = client.app.state.serving.dispatcher.colocated[0]
    worker.reserve("someone-else")  # the worker is full: the next request gets a 429
    r = _complete(client)
    assert r.status_code == 429, r.text
    root, children = _tree(exporter)
    assert set(children) == {"admission"}
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes[A.HTTP_STATUS_CODE] == 429
    # the controller counts it as arriving load all the same (refused requests are demand)
    assert len(client.app.state.serving.controller.arrivals) == 1


def test_migration_is_an_event(traced):
    client, exporter = traced(prefill_addrs=("tcp://127.0.0.1:1",),
                              decode_addrs=("tcp://127.0.0.1:2", "tcp://127.0.0.1:3"))
    ScriptedWorker.scripts.update(prefill=[_prefill_script()], decode=[
        [WorkerDied("the first decode worker died")], _decode_script()])
    r = _complete(client)
    assert r.status_code == 200, r.text
    root, children = _tree(exporter)
    migrations = [e for e in root.events if e.name == "migration"]
    assert len(migrations) == 1
    event = migrations[0].attributes
    assert event[A.WORKER_ROLE] == "decode" and event[A.WORKER_ID] in ("decode-2", "decode-3")
    assert event[A.MIGRATION_RESUMED] is False and "died" in event[A.MIGRATION_REASON]
    # the request finished on the other decode worker, which the spans name
    other = ({"decode-2", "decode-3"} - {event[A.WORKER_ID]}).pop()
    assert children["decode"].attributes[A.WORKER_ID] == other
    assert children["kv_transfer"].attributes[A.KV_DESTINATION_WORKER_ID] == other
    assert root.status.status_code == StatusCode.UNSET


def test_client_gone_mid_stream_is_an_aborted_span():
    """A client that hangs up mid-stream closes the SSE generator: the request is traced as
    aborted, with the tokens it got."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider)
    trace = tracer.start("cmpl-1", "m", SamplingParams(max_tokens=8), 4, {}, time.monotonic())
    timing = RequestTiming(trace.arrival_s, trace)

    async def outputs():
        for token_id in range(8):
            yield Output("cmpl-1", [token_id], "x")

    async def hang_up() -> None:
        events = stream(outputs(), Reply("cmpl-1", "m", str, False, None), timing,
                        RequestObserver(None, None), include_usage=False)
        assert b"cmpl-1" in await events.__anext__()
        await events.aclose()

    asyncio.run(hang_up())
    root, children = _tree(exporter)
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes[A.ERROR_TYPE] == "aborted"
    assert root.attributes[A.HTTP_STATUS_CODE] == 499
    assert root.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 1


def test_no_endpoint_no_exporter(llama_dir, monkeypatch):
    def no_exporter(*args, **kwargs):
        raise AssertionError("an exporter was created without an endpoint")

    monkeypatch.setattr("opentelemetry.exporter.otlp.proto.http.trace_exporter."
                        "OTLPSpanExporter.__init__", no_exporter)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--colocated", "tcp://127.0.0.1:1"])
    config = server.config_from_args(args)
    assert config.otlp_traces_endpoint is None and server.tracing_argv(args) == []
    app = build_app(config)
    assert app.state.serving.tracer is None
    asyncio.run(app.state.serving.dispatcher.close())
    # the standard variable stands in for the flag, as in vLLM
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--colocated", "tcp://127.0.0.1:1"])
    assert server.config_from_args(args).otlp_traces_endpoint == "http://127.0.0.1:9/v1/traces"
    with pytest.raises(ValueError, match="http"):
        RouterConfig(model=str(llama_dir), colocated_addrs=("x",),
                     otlp_traces_endpoint="127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match="http/protobuf"):
        RequestTracer.create("http://127.0.0.1:9/v1/traces")


def test_trace_headers_without_tracing_are_ignored_with_one_warning(caplog):
    tracing._warn_tracing_disabled.cache_clear()
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    with caplog.at_level("WARNING", logger="pdserve.router.tracing"):
        for _ in range(3):
            assert tracing.start_trace(None, headers, "cmpl-1", "m", SamplingParams(), 4,
                                       time.monotonic()) is None
    assert [r.message for r in caplog.records].count(
        "a request came with a traceparent header but tracing is off "
        "(--otlp-traces-endpoint)") == 1


def test_pdserve_up_passes_the_flag_and_checks_it_first(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)

    def router_argv(*argv: str) -> list[str]:
        parser = argparse.ArgumentParser()
        launcher.add_arguments(parser)
        cluster = launcher.plan(parser.parse_args(["--device", "cpu", *argv]), "/m", gpus=[])
        return next(c.argv for c in cluster.children if c.role == "router")

    assert "--otlp-traces-endpoint" not in router_argv()
    argv = router_argv("--otlp-traces-endpoint", "http://collector:4318/v1/traces")
    flag = argv.index("--otlp-traces-endpoint")
    assert argv[flag + 1] == "http://collector:4318/v1/traces"
    with pytest.raises(ValueError, match="http"):  # before any child starts
        router_argv("--otlp-traces-endpoint", "collector:4317")


# ---- a real OTLP/HTTP receiver ----------------------------------------------------------------
class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback: decodes each posted ExportTraceServiceRequest
    and keeps its spans."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.paths.append(self.path)
                receiver.spans += [span for resource_spans in request.resource_spans
                                   for scope_spans in resource_spans.scope_spans
                                   for span in scope_spans.spans]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_spans_reach_an_otlp_receiver_from_pdserve_up(llama_dir, tmp_path, monkeypatch):
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export batches every 0.2 s
    cluster = start_cluster(llama_dir, tmp_path, "--num-kv-blocks", "256",
                            "--otlp-traces-endpoint", receiver.endpoint)
    try:
        r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60, headers={
            "traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}, json={
            "prompt": "# tracing\n" * 4, "max_tokens": 3, "ignore_eos": True,
            "temperature": 0})
        assert r.status_code == 200, r.text
        names = {"llm_request", "admission", "queue", "prefill", "kv_transfer", "decode"}
        assert wait_until(lambda: names <= {s.name for s in receiver.spans}, 30), \
            [s.name for s in receiver.spans]
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()
        receiver.close()
    assert set(receiver.paths) == {"/v1/traces"}
    spans = {s.name: s for s in receiver.spans}
    root = spans["llm_request"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_SPAN_ID
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes[A.GEN_AI_REQUEST_ID].string_value == r.json()["id"]
    assert attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS].int_value == 3
    for name in names - {"llm_request"}:
        span = spans[name]
        assert span.parent_span_id == root.span_id and span.trace_id == root.trace_id
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.start_time_unix_nano <= span.end_time_unix_nano <= root.end_time_unix_nano
    worker_ids = {name: {a.key: a.value.string_value for a in spans[name].attributes}
                  for name in ("prefill", "decode", "kv_transfer")}
    assert worker_ids["prefill"][A.WORKER_ID].startswith("prefill")
    assert worker_ids["decode"][A.WORKER_ID].startswith("decode")
    assert worker_ids["kv_transfer"][A.KV_SOURCE_WORKER_ID] == worker_ids["prefill"][A.WORKER_ID]
    assert (worker_ids["kv_transfer"][A.KV_DESTINATION_WORKER_ID]
            == worker_ids["decode"][A.WORKER_ID])
