"""A schema fuzz of the router's HTTP API (schemathesis, from the app's own OpenAPI
document): whatever the request, valid by the schema or not, the router answers with an
OpenAI-style body, and never with a 5xx. In process, over stand-in workers that encode each
request as the real dispatcher would; the thousands-of-cases run against a real cluster is
benchmarks/fuzz_http.py.

Hypothesis drives schemathesis's strategies directly: schemathesis's own pytest plugin does
not run under pytest 9 (it reads a node attribute pytest 9 removed)."""

from __future__ import annotations

import pytest
import schemathesis
from helpers.router_util import StandInDispatcher, router_config
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from pdserve.router.app import build_app

MAX_EXAMPLES = 150
"""Per generation mode (bodies valid by the schema, and not): 300 cases in all."""


@pytest.fixture(scope="module")
def api_schema(llama_dir):
    config = router_config(llama_dir, max_tokens_ceiling=64)
    return schemathesis.openapi.from_asgi(
        "/openapi.json", build_app(config, StandInDispatcher(config))
    )


def check_response(case, response) -> None:
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:  # every refusal is an OpenAI-style error body
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"], response.text


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"]
)
def test_no_server_error_for_any_request(api_schema, mode) -> None:
    statuses = set()

    @given(case=api_schema.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case) -> None:
        response = case.call()
        statuses.add(response.status_code)
        check_response(case, response)

    fuzz()
    assert 400 in statuses, statuses  # validation was reached...
    if mode == GenerationMode.POSITIVE:
        assert 200 in statuses, statuses  # ...and, with valid bodies, serving too
