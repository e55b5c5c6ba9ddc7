"""The router's HTTP surface under hostile or careless clients, through the real app over
stand-in workers: a body limit that chunked bodies cannot bypass, unsupported fields refused
by name, the operator's max_tokens default and ceiling, a constant-time key check, optional
auth on /metrics and /status, and tokenization off the event loop."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest
from fastapi.testclient import TestClient
from helpers.router_util import WORKER_MAX_MODEL_LEN, StandInDispatcher, router_config

from pdserve.ports import PortInUse, check_port_free, port_holder
from pdserve.router import app as router_app
from pdserve.router.app import build_app
from pdserve.router.openai_protocol import UNSUPPORTED_FIELDS

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def _client(model_dir, **config):
    config = router_config(model_dir, **config)
    dispatcher = StandInDispatcher(config)
    return TestClient(build_app(config, dispatcher)), dispatcher


@pytest.fixture()
def small_limit(llama_dir):
    client, dispatcher = _client(llama_dir, max_request_bytes=4096)
    with client:
        yield client, dispatcher


def _chunks(body: bytes, size: int = 512):
    for i in range(0, len(body), size):
        yield body[i : i + size]


def test_chunked_body_over_the_limit_is_a_413(small_limit) -> None:
    client, dispatcher = small_limit
    big = json.dumps({"prompt": "word " * 2000, "max_tokens": 1}).encode()
    assert len(big) > 4096
    r = client.post(
        "/v1/completions", content=_chunks(big), headers={"content-type": "application/json"}
    )
    assert "content-length" not in r.request.headers  # it really was chunked
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == 413 and "4096 bytes" in error["message"]
    assert dispatcher.sent == []
    # a declared length over the limit is refused before reading, with the same body
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    # a chunked body under the limit is served
    small = json.dumps({"prompt": "word " * 100, "max_tokens": 1}).encode()
    r = client.post(
        "/v1/completions", content=_chunks(small, 64), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text


IN_USE = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "use_beam_search": True,
    "logits_processors": ["p"],
    "truncate_prompt_tokens": 5,
}


CHAT_SERVES = {"tools", "tool_choice"}
"""Refused by /v1/completions, served by chat (tool calling: tests/router/test_tool_calls.py)."""


def test_every_unsupported_field_has_a_case() -> None:
    # parallel_tool_calls alone asks for nothing (it only qualifies `tools`)
    assert set(IN_USE) == set(UNSUPPORTED_FIELDS) - {"parallel_tool_calls"}


@pytest.mark.parametrize("name", sorted(IN_USE))
def test_unsupported_field_is_a_400_naming_it(small_limit, name) -> None:
    client, dispatcher = small_limit
    for path, body in ((CHAT, {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        if path == CHAT and name in CHAT_SERVES:
            continue
        r = client.post(path, json={**body, name: IN_USE[name]})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == name and f"{name} is not supported" in error["message"]
    assert dispatcher.sent == []


def test_fields_that_ask_for_nothing_are_accepted(small_limit) -> None:
    client, _ = small_limit
    r = client.post(
        CHAT,
        json={
            "messages": MESSAGES,
            "max_tokens": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
            "parallel_tool_calls": True,
            "guided_json": None,
            "use_beam_search": False,
        },
    )
    assert r.status_code == 200, r.text


def test_operator_default_and_ceiling_for_max_tokens(llama_dir) -> None:
    client, dispatcher = _client(llama_dir, max_tokens_ceiling=20)
    with client:
        r = client.post(CHAT, json={"messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert dispatcher.sent[-1].max_tokens == 20  # the room left, capped by the ceiling
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert dispatcher.sent[-1].max_tokens == 16  # OpenAI's default, under the ceiling
        r = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 20})
        assert r.status_code == 200 and dispatcher.sent[-1].max_tokens == 20
        for field in ("max_tokens", "max_completion_tokens"):
            r = client.post(CHAT, json={"messages": MESSAGES, field: 21})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "max_tokens"
            assert "at most 20 tokens per request" in r.json()["error"]["message"]
        assert len(dispatcher.sent) == 3

    client, dispatcher = _client(llama_dir, default_max_tokens=5)
    with client:
        for path, body in ((CHAT, {"messages": MESSAGES}), ("/v1/completions", {"prompt": "a"})):
            assert client.post(path, json=body).status_code == 200
            assert dispatcher.sent[-1].max_tokens == 5
        # no ceiling: an explicit max_tokens up to the context is served
        r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 200})
        assert r.status_code == 200 and dispatcher.sent[-1].max_tokens == 200
        # the default never exceeds the room left
        prompt = [5] * (WORKER_MAX_MODEL_LEN - 3)
        assert client.post("/v1/completions", json={"prompt": prompt}).status_code == 200
        assert dispatcher.sent[-1].max_tokens == 3

    with pytest.raises(ValueError, match="must not exceed"):
        router_config(llama_dir, default_max_tokens=30, max_tokens_ceiling=20)


def test_api_key_is_compared_in_constant_time(llama_dir, monkeypatch) -> None:
    compared = []
    real = router_app.hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(router_app.hmac, "compare_digest", recording)
    client, _ = _client(llama_dir, api_key="s3cret")
    with client:
        ok = {"authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert compared[-1] == (b"Bearer s3cret", b"Bearer s3cret")
        for headers in (
            {"authorization": "Bearer s3creX"},
            {"authorization": "Bearer s3"},
            {"authorization": "s3cret"},
            {},
        ):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert len(compared) == 5
        # without --ops-need-api-key the operations endpoints stay open
        assert client.get("/metrics").status_code == 200
        assert client.get("/status").status_code == 200


def test_ops_endpoints_can_need_the_key(llama_dir) -> None:
    client, _ = _client(llama_dir, api_key="k", ops_need_api_key=True)
    with client:
        for path in ("/metrics", "/status"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"authorization": "Bearer nope"}).status_code == 401
            assert client.get(path, headers={"authorization": "Bearer k"}).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key
        assert client.get("/no/such/path").status_code == 404
    with pytest.raises(ValueError, match="needs an api_key"):
        router_config(llama_dir, ops_need_api_key=True)


def test_tokenization_and_chat_template_run_off_the_event_loop(small_limit) -> None:
    client, _ = small_limit
    tokenizer = client.app.state.serving.model.tokenizer
    threads = []

    class Recording:
        def __call__(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return tokenizer(*args, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            return tokenizer.apply_chat_template(*args, **kwargs)

    client.app.state.serving.model.tokenizer = Recording()
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert len(threads) == 3 and all(name.startswith("tokenize") for name in threads), threads


def test_restart_counts_from_the_launcher_are_exported(llama_dir, tmp_path) -> None:
    state = tmp_path / "supervisor.json"
    client, _ = _client(llama_dir, supervisor_state_file=str(state))
    with client:
        assert "pdserve:process_restarts_total{" not in client.get("/metrics").text  # no file
        state.write_text(json.dumps({"restarts": {"decode-0": 2, "router": 0}}))
        text = client.get("/metrics").text
        assert 'pdserve:process_restarts_total{process="decode-0"} 2.0' in text
        assert 'pdserve:process_restarts_total{process="router"} 0.0' in text


def test_a_taken_port_names_its_holder() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        holder = port_holder(port)
        assert holder is not None and holder.pid == os.getpid()
        with pytest.raises(
            PortInUse, match=f"127.0.0.1:{port} is already in use by process {os.getpid()} "
        ):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # released: free again


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ""}',  # no tokens at all
        b'{"prompt": "a", "stop_token_ids": [1180591620717411303424]}',  # past msgpack's int64
        b'{"prompt": "a", "top_k": 1180591620717411303424}',
        b'{"prompt": "a", "min_tokens": 1180591620717411303424}',
        b'{"prompt": "\\ud800 x"}',  # an unpaired surrogate: no tokenizer or encoder takes it
        b'{"prompt": "a", "stop": ["\\udfff"]}',
        b'{"\\ud800": 1, "prompt": "a"}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}",  # nested past the parser's depth
    ],
    ids=lambda raw: raw[:40].decode(errors="replace"),
)
def test_bodies_that_once_gave_a_500_are_a_400(small_limit, raw) -> None:
    client, dispatcher = small_limit
    path = CHAT if b"messages" in raw else "/v1/completions"
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400
    assert dispatcher.sent == []


def test_logprobs_reach_the_client_through_the_wire(small_limit) -> None:
    """A token's top logprobs are an int-keyed map on the wire: the schema fuzz found every
    request with logprobs hanging, its outputs dropped by the router as malformed."""
    client, _ = small_limit
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    r = client.post(
        CHAT, json={"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
