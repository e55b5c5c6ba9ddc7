"""A scripted in-process OpenAI-style SSE server and the bench CLI, shared by the harness's
tests (tests/test_bench_*.py): each request gets a script (delay before the first token, gaps
between tokens), and the server records, on the client's perf_counter clock, when it received
the request and wrote each chunk."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdserve.benchmarks import bench_serve


@dataclass(frozen=True)
class TokenScript:
    """How one request is answered: wait ttft_delay_s, then one chunk per gap."""

    ttft_delay_s: float
    # Gaps between successive token chunks; len + 1 tokens in all.
    itl_delays_s: tuple[float, ...]
    send_usage: bool = True
    status: int = 200
    # OpenAI error type in the body of a non-200 answer ("rate_limit_error", ...).
    error_type: str = "server_error"
    # Close the connection after this many token chunks, mid-stream (no [DONE], no end chunk).
    cut_after_tokens: int | None = None


@dataclass
class ServedRequest:
    path: str
    body: dict
    received_s: float
    chunk_sent_s: list[float] = field(default_factory=list)


class ScriptedSSEServer:
    def __init__(self, script_for: Callable[[dict], TokenScript], model: str = "scripted"):
        self.script_for = script_for
        self.model = model
        self.served: list[ServedRequest] = []
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> ScriptedSSEServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.lower(): v.strip()
                   for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body_bytes = await reader.readexactly(int(headers.get("content-length", "0")))
        received_s = time.perf_counter()
        if method == "GET" and path == "/v1/models":
            payload = json.dumps({"object": "list", "data": [{"id": self.model}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            return True
        if not path.endswith("completions"):  # e.g. vLLM's /tokenize probe: not served here
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return True
        body = json.loads(body_bytes)
        served = ServedRequest(path, body, received_s)
        self.served.append(served)
        script = self.script_for(body)
        if script.status != 200:
            payload = json.dumps({"error": {"message": "scripted failure",
                                            "type": script.error_type}}).encode()
            writer.write(b"HTTP/1.1 %d Error\r\nContent-Length: %d\r\n\r\n"
                         % (script.status, len(payload)) + payload)
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        is_chat = "chat" in path
        if is_chat:  # OpenAI's first chat chunk carries only the role: not a token.
            await self._event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        delays_s = (script.ttft_delay_s, *script.itl_delays_s)
        for i, delay_s in enumerate(delays_s):
            if i == script.cut_after_tokens:
                writer.transport.abort()  # the connection drops mid-stream
                return False
            await asyncio.sleep(delay_s)
            text = f" t{i}"
            choice = {"index": 0, "delta": {"content": text}} if is_chat else \
                {"index": 0, "text": text}
            await self._event(writer, {"choices": [choice]})
            served.chunk_sent_s.append(time.perf_counter())
        if script.send_usage:
            await self._event(writer, {"choices": [], "usage": {
                "prompt_tokens": 7, "completion_tokens": len(delays_s),
                "total_tokens": 7 + len(delays_s),
                "prompt_tokens_details": {"cached_tokens": 3}}})
        await self._write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def _event(self, writer: asyncio.StreamWriter, data: dict) -> None:
        await self._write_chunk(writer, b"data: " + json.dumps(data).encode() + b"\n\n")

    @staticmethod
    async def _write_chunk(writer: asyncio.StreamWriter, payload: bytes) -> None:
        writer.write(b"%x\r\n" % len(payload) + payload + b"\r\n")
        await writer.drain()


@contextlib.contextmanager
def served_in_thread(server: ScriptedSSEServer) -> Iterator[ScriptedSSEServer]:
    """Runs `server` on an event loop of its own thread (the CLI runs its own loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(timeout=10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.__aexit__(None, None, None),
                                         loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return bench_serve.run(parser.parse_args(list(argv)))
