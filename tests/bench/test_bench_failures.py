"""Failures explained: a server that answers some requests 429, some 500 and cuts some streams;
`pdserve bench` must count each cause, keep every request's message aligned with the requests
in the saved JSON (vLLM's `errors`), and print the first messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.bench_util import ScriptedSSEServer, TokenScript, cli, served_in_thread

from pdserve.benchmarks.bench_serve import run_load
from pdserve.benchmarks.client import EndpointConfig
from pdserve.benchmarks.datasets import BenchRequest, TokenCodec
from pdserve.benchmarks.metrics import error_counts
from pdserve.benchmarks.vllm_datasets import random_requests

OK = TokenScript(0.0, (0.001, 0.001))
RATE_LIMITED = TokenScript(0.0, (), status=429, error_type="rate_limit_error")
SERVER_ERROR = TokenScript(0.0, (), status=500, error_type="InternalServerError")
CUT = TokenScript(0.0, (0.001, 0.001, 0.001), cut_after_tokens=2)


def script_by_max_tokens(body: dict) -> TokenScript:
    """The fault is chosen by max_tokens, which the test sets per request."""
    return {1: OK, 2: RATE_LIMITED, 3: SERVER_ERROR, 4: CUT}[body["max_tokens"]]


async def test_each_cause_is_counted_with_its_message() -> None:
    kinds = [1, 2, 3, 4, 2, 1, 4, 2, 3, 1, 2]  # ok x3, 429 x4, 500 x2, cut x2
    requests = [BenchRequest(f"p{i}", 1, kind) for i, kind in enumerate(kinds)]
    async with ScriptedSSEServer(script_by_max_tokens) as server, httpx.AsyncClient() as http:
        endpoint = EndpointConfig(server.base_url, "scripted")
        outcomes, _ = await run_load(http, endpoint, requests, [0.0] * len(requests))
    assert error_counts(outcomes) == {
        "HTTP 429 rate_limit_error": 4,
        "HTTP 500 InternalServerError": 2,
        "stream cut": 2,
    }
    for kind, outcome in zip(kinds, outcomes, strict=True):
        assert outcome.success == (kind == 1)
        assert (outcome.error == "") == (kind == 1)
    assert outcomes[1].error.startswith("HTTP 429") and "scripted failure" in outcomes[1].error
    # A cut stream had tokens before the cut; it still failed.
    assert outcomes[3].error_cause == "stream cut" and outcomes[3].num_token_chunks == 2


async def test_unreachable_and_timeout_causes() -> None:
    async with httpx.AsyncClient() as http:
        # Port 9 (discard) is closed on loopback: connection refused.
        closed = EndpointConfig("http://127.0.0.1:9", "m")
        slow_server = ScriptedSSEServer(lambda body: TokenScript(5.0, ()))
        async with slow_server:
            slow = EndpointConfig(slow_server.base_url, "m", request_timeout_s=0.2)
            (refused,), _ = await run_load(http, closed, [BenchRequest("a", 1, 1)], [0.0])
            (timed_out,), _ = await run_load(http, slow, [BenchRequest("a", 1, 1)], [0.0])
    assert refused.error_cause == "connect" and "ConnectError" in refused.error
    assert timed_out.error_cause == "timeout" and "ReadTimeout" in timed_out.error


@pytest.fixture
def faulty_server() -> Iterator[ScriptedSSEServer]:
    with served_in_thread(ScriptedSSEServer(script_by_max_tokens)) as server:
        yield server


def test_cli_reports_causes_in_table_json_and_messages(
    faulty_server: ScriptedSSEServer, tmp_path: Path, capsys
) -> None:
    # Output lengths 1..4 (2 +- 60%) pick each request's fault; seed 8 draws 6 OK, 8 x 429,
    # 4 x 500 and 6 cuts (distinct counts, so the most-frequent-first order is fixed).
    flags = [
        "--num-prompts",
        "24",
        "--seed",
        "8",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--random-range-ratio",
        "0.6",
    ]
    kinds = [
        r.expected_output_len for r in random_requests(TokenCodec(None), 24, 4, 2, "0.6", seed=8)
    ]
    rc = cli(
        "--base-url",
        faulty_server.base_url,
        *flags,
        "--request-rate",
        "inf",
        "--save-result",
        "--no-plots",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "f.json",
        "--disable-tqdm",
    )
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["error_counts"] == {
        "HTTP 429 rate_limit_error": 8,
        "stream cut": 6,
        "HTTP 500 InternalServerError": 4,
    }
    assert (result["completed"], result["failed"]) == (6, 18)
    # `errors` is aligned with the requests: "" exactly where that request was served OK,
    # and each message names its own fault.
    marks = {1: "", 2: "HTTP 429", 3: "HTTP 500", 4: "RemoteProtocolError"}
    assert len(result["errors"]) == len(kinds) == 24
    for kind, error in zip(kinds, result["errors"], strict=True):
        assert error == "" if kind == 1 else marks[kind] in error
    # Table rows under "Failed requests": each cause with its count.
    lines = [line.split() for line in out.splitlines()]
    for cause, count in result["error_counts"].items():
        assert [*f"{cause}:".split(), str(count)] in lines
    # The first message of each cause, with its request index.
    for cause in result["error_counts"]:
        first = next(
            i
            for i, k in enumerate(kinds)
            if marks[k] and cause.startswith({2: "HTTP 429", 3: "HTTP 500", 4: "stream cut"}[k])
        )
        assert f"request {first} failed ({cause}):" in out
