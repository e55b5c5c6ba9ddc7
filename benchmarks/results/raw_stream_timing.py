"""When do a server's SSE token events really arrive? A raw-socket reader, no HTTP library.

Used to decide which client to believe when pdserve bench and `vllm bench serve` split the
same end-to-end latency differently into TTFT and TPOT: this prints each socket read's time
since the request was sent and how many `data:` events it held.

    python benchmarks/results/raw_stream_timing.py [HOST] [PORT] [MODEL]
"""

from __future__ import annotations

import json
import socket
import sys
import time


def main() -> None:
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
    model = sys.argv[3] if len(sys.argv) > 3 else "tiny"
    body = json.dumps({"model": model, "prompt": " hello world" * 64, "max_tokens": 32,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(3):
        with socket.create_connection((host, port), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start_s = time.perf_counter()
            sock.sendall(head + body)
            reads, received = [], b""
            while b"[DONE]" not in received:
                data = sock.recv(65536)
                if not data:
                    break
                reads.append((round((time.perf_counter() - start_s) * 1000, 1),
                              data.count(b"data: {")))
                received += data
        print("(ms since send, events in read):", reads[:12], "... reads:", len(reads))


if __name__ == "__main__":
    main()
