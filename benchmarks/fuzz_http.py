"""A schema fuzz of a running pdserve router, thousands of cases: schemathesis generates
requests from the router's own /openapi.json (bodies valid by the schema, and not), sends
each over HTTP with a timeout, and records every answer. The run passes when no answer is a
5xx, none hangs (times out), and the server still serves a plain completion afterwards.

    python -m benchmarks.fuzz_http --num-cases 3000 --out fuzz.json   # own cluster
    python -m benchmarks.fuzz_http --base-url http://127.0.0.1:8000 ...

Without --base-url it starts `pdserve up` (the embedded tiny model, disaggregated, with
--max-tokens-ceiling so a case generates a few tokens, not the whole context) on free
loopback ports and stops it at the end. Besides the schema cases it sends an oversized body
in chunked transfer encoding over a raw socket, which must get a 413. Needs schemathesis
(the `test` extra). The smaller in-process run is tests/router/test_router_fuzz.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks.output import add_output_dir, output_path


@dataclass
class FuzzResult:
    num_cases: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    num_server_errors: int = 0
    num_hangs: int = 0
    """Requests that got no answer within the per-request timeout."""
    num_transport_errors: int = 0
    """Connections refused or dropped without an answer."""
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
    chunked_oversize_status: int | None = None
    is_alive_after: bool = False
    wall_s: float = 0.0
    failures: list[dict[str, Any]] = field(default_factory=list)
    """The first few 5xx, hangs or transport errors, each with a curl command to replay it."""

    @property
    def passed(self) -> bool:
        return (
            self.num_server_errors == 0
            and self.num_hangs == 0
            and self.num_transport_errors == 0
            and self.is_alive_after
            and self.chunked_oversize_status == 413
        )


MAX_FAILURES_KEPT = 20


def fuzz(base_url: str, num_cases: int, timeout_s: float, seed: int) -> FuzzResult:
    """Half the cases valid by the schema, half not, over every operation."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    result, latencies, statuses = FuzzResult(), [], Counter()

    def record_failure(case: Any, what: str) -> None:
        if len(result.failures) < MAX_FAILURES_KEPT:
            result.failures.append({"what": what, "curl": case.as_curl_command()})

    def send(case: Any) -> None:
        import requests

        result.num_cases += 1
        start_s = time.monotonic()
        try:
            response = case.call(base_url=base_url, timeout=timeout_s)
        except requests.Timeout:
            result.num_hangs += 1
            record_failure(case, f"no answer in {timeout_s} s")
            return
        except requests.RequestException as exc:
            result.num_transport_errors += 1
            record_failure(case, f"transport error: {type(exc).__name__}: {exc}"[:300])
            return
        latencies.append(time.monotonic() - start_s)
        statuses[str(response.status_code)] += 1
        if response.status_code >= 500:
            result.num_server_errors += 1
            record_failure(case, f"{response.status_code}: {response.text[:300]}")

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        run = given(case=schema.as_strategy(generation_mode=mode))(send)
        run = settings(
            max_examples=num_cases // 2,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )(run)
        hypothesis_seed(seed)(run)()
    latencies.sort()
    if latencies:
        result.latency_p50_s = latencies[len(latencies) // 2]
        result.latency_p99_s = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        result.latency_max_s = latencies[-1]
    result.statuses = dict(sorted(statuses.items()))
    return result


def chunked_oversize_status(base_url: str, num_bytes: int = 9 * 1024 * 1024) -> int | None:
    """The status a /v1/completions body of `num_bytes` in chunked transfer encoding gets
    (no Content-Length, so only a limit counted on the bytes as they arrive catches it)."""
    host, port = httpx.URL(base_url).host, httpx.URL(base_url).port
    chunk = b"x" * 65536
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        try:
            for _ in range(num_bytes // len(chunk) + 1):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed while we were still sending
            pass
        reply = b""
        try:
            while b"\r\n" not in reply:
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
        except OSError:
            pass
    first_line = reply.split(b"\r\n", 1)[0].split()
    return int(first_line[1]) if len(first_line) >= 2 and first_line[1].isdigit() else None


def is_alive(base_url: str) -> bool:
    try:
        r = httpx.post(
            f"{base_url}/v1/completions",
            timeout=60,
            json={"prompt": "still there?", "max_tokens": 4, "temperature": 0},
        )
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def _free_port_block(count: int) -> int:
    for base in range(21000, 32000, count):
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


def start_cluster(
    log_path: Path, max_tokens_ceiling: int, timeout_s: float = 600.0
) -> tuple[subprocess.Popen, str]:
    base = _free_port_block(40)
    argv = [
        sys.executable,
        "-m",
        "pdserve.app.cli",
        "up",
        "--port",
        str(base),
        "--store-port",
        str(base + 10),
        "--worker-base-port",
        str(base + 20),
        "--max-tokens-ceiling",
        str(max_tokens_ceiling),
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while "pdserve is ready" not in log_path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"pdserve up did not start; see {log_path}")
        time.sleep(0.5)
    return process, f"http://127.0.0.1:{base}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url",
        default=None,
        help="a running router (default: start `pdserve up` for the run)",
    )
    parser.add_argument("--num-cases", type=int, default=3000)
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, help="per request: no answer within this is a hang"
    )
    parser.add_argument(
        "--max-tokens-ceiling",
        type=int,
        default=16,
        help="the started cluster's --max-tokens-ceiling",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="the JSON file (default: fuzz_http.json in --output-dir)")
    add_output_dir(parser, "fuzz_http")
    args = parser.parse_args(argv)
    process = None
    with tempfile.TemporaryDirectory(prefix="pdserve-fuzz-") as tmp:
        base_url = args.base_url
        if base_url is None:
            process, base_url = start_cluster(Path(tmp) / "up.log", args.max_tokens_ceiling)
        try:
            start_s = time.monotonic()
            result = fuzz(base_url, args.num_cases, args.timeout_s, args.seed)
            result.chunked_oversize_status = chunked_oversize_status(base_url)
            result.is_alive_after = is_alive(base_url)
            result.wall_s = time.monotonic() - start_s
        finally:
            if process is not None:
                os.kill(process.pid, signal.SIGTERM)
                process.wait(60)
    report = {
        **asdict(result),
        "passed": result.passed,
        "base_url": base_url,
        "num_cases_asked": args.num_cases,
        "timeout_s": args.timeout_s,
        "seed": args.seed,
    }
    text = json.dumps(report, indent=2)
    print(text)
    output = output_path(args, "fuzz_http", "fuzz_http.json", args.out)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
