"""Structured outputs through the HTTP API: every dialect read at the router (stand-in
workers), and end to end on a colocated and a disaggregated cluster, where every response to
a JSON-schema request must parse and validate against its schema.

The model has random weights, and such a model may never close a free string or end an
unbounded array: every schema here bounds its strings (maxLength), arrays (maxItems) and
integers (minimum/maximum) or uses enums, so the grammar itself leads to the end. Between
JSON tokens the grammar allows any run of whitespace unless the request sets
disable_any_whitespace (vLLM's default too), and this tokenizer, trained on Python sources,
has many whitespace tokens a random model picks often: requests that allow whitespace get a
small schema and a large max_tokens. A response cut by max_tokens (finish_reason "length") is
not a valid structured output, so every one must end with finish_reason "stop".
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient
from helpers.router_util import StandInDispatcher, router_config
from pydantic import BaseModel, Field

from pdserve.protocol.sampling import SamplingParams, StructuredOutputs
from pdserve.router.app import build_app

# after each test on the shared cluster: nothing held (conftest)
pytestmark = pytest.mark.usefixtures("served_cluster_left_clean")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

ORDER = {  # nested objects, enums, a bounded array of objects
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "status": {"enum": ["new", "paid", "shipped"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5},
                           "vip": {"type": "boolean"}},
            "required": ["name", "vip"], "additionalProperties": False},
        "items": {
            "type": "array", "maxItems": 2,
            "items": {"type": "object",
                      "properties": {"sku": {"enum": ["a1", "b2"]},
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["id", "status", "customer", "items"],
    "additionalProperties": False,
}
FLAG = {  # few places for whitespace: for requests that allow it
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}
COMPACT_MAX_TOKENS = 300
SPACED_MAX_TOKENS = 1500


# ---- the router reads every dialect (stand-in workers) ------------------------------------
@pytest.fixture(scope="module")
def stand_in(llama_dir):
    config = router_config(llama_dir)
    dispatcher = StandInDispatcher(config)
    with TestClient(build_app(config, dispatcher)) as client:
        yield client, dispatcher


def _sent_spec(stand_in, path: str, **fields: Any) -> StructuredOutputs | None:
    client, dispatcher = stand_in
    body = ({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT
            else {"prompt": "hi"})
    r = client.post(path, json={**body, "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text
    sampling: SamplingParams = dispatcher.sent[-1]
    return sampling.structured_outputs


FLAG_TEXT = json.dumps(FLAG, separators=(",", ":"))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "flag", "schema": FLAG, "strict": True}}},
     StructuredOutputs(json=FLAG_TEXT)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": FLAG, "disable_any_whitespace": True}},
     StructuredOutputs(json=FLAG_TEXT, disable_any_whitespace=True)),
    ({"structured_outputs": {"json": json.dumps(FLAG)}}, StructuredOutputs(json=FLAG_TEXT)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputs(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputs(choice=("x", "y"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutputs(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
    ({"guided_json": FLAG, "guided_decoding_backend": "xgrammar"},
     StructuredOutputs(json=FLAG_TEXT)),
    ({"guided_regex": "a+", "guided_decoding_backend": "auto"}, StructuredOutputs(regex="a+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=("yes", "no"))),
    ({"guided_grammar": 'root ::= "b"'}, StructuredOutputs(grammar='root ::= "b"')),
    ({}, None),
])
def test_every_dialect_becomes_one_spec(stand_in, path, fields, expected) -> None:
    assert _sent_spec(stand_in, path, **fields) == expected


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one way only"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_json": FLAG, "guided_choice": ["a"]}, "guided_choice", "one way only"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "xgrammar"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}}, None,
     "invalid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, None, "invalid regex"),
    ({"guided_grammar": "root ::= missing_rule"}, None, "invalid grammar"),
])
def test_bad_structured_fields_are_400s_naming_the_problem(stand_in, fields, param, words
                                                           ) -> None:
    client, dispatcher = stand_in
    num_sent = len(dispatcher.sent)
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
                       (COMPLETIONS, {"prompt": "hi"})):
        for stream in (False, True):
            r = client.post(path, json={**body, **fields, "stream": stream})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert words in error["message"] and error["param"] == param, error
    assert len(dispatcher.sent) == num_sent  # refused at the router: no worker saw it


# ---- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(served_cluster):
    """The shared `pdserve up` (conftest.served_cluster), colocated and disaggregated."""
    return served_cluster


async def _one(client: httpx.AsyncClient, path: str, body: dict) -> tuple[str, str | None]:
    """(text, finish_reason) of one request, streamed or not."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if path == CHAT else choice["text"],
                choice["finish_reason"])
    text, finish_reason = "", None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                text += (choice["delta"].get("content") or "") if path == CHAT \
                    else choice["text"]
                finish_reason = choice["finish_reason"] or finish_reason
    return text, finish_reason


def _run_all(base_url: str, requests: list[tuple[str, dict]]) -> list[tuple[str, str | None]]:
    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            return await asyncio.gather(*(_one(client, path, body) for path, body in requests))

    return asyncio.run(main())


def _body(path: str, i: int, **fields: Any) -> dict:
    prompt = f"Record number {i}, as JSON:"
    base = ({"messages": [{"role": "user", "content": prompt}]} if path == CHAT
            else {"prompt": prompt})
    return {**base, "temperature": 0.7 + 0.1 * (i % 4), "seed": 1000 + i,
            "stream": i % 2 == 1, **fields}


def test_every_json_schema_response_validates(cluster) -> None:
    """88 concurrent requests per cluster (chat and completions, streamed and not, seeds and
    temperatures 0.7-1.0), in all three JSON-schema dialects."""
    requests, schemas = [], []
    for i in range(60):  # compact JSON (vLLM's structured_outputs), nested schema
        path = CHAT if i % 3 else COMPLETIONS
        requests.append((path, _body(path, i, max_tokens=COMPACT_MAX_TOKENS, structured_outputs={
            "json": ORDER, "disable_any_whitespace": True})))
        schemas.append(ORDER)
    for i in range(60, 80):  # OpenAI's response_format: whitespace allowed
        path = CHAT if i % 3 else COMPLETIONS
        requests.append((path, _body(path, i, max_tokens=SPACED_MAX_TOKENS, response_format={
            "type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}})))
        schemas.append(FLAG)
    for i in range(80, 88):  # vLLM's older guided_json
        requests.append((COMPLETIONS, _body(COMPLETIONS, i, max_tokens=SPACED_MAX_TOKENS,
                                            guided_json=FLAG)))
        schemas.append(FLAG)
    results = _run_all(cluster.base_url, requests)
    for (text, finish_reason), schema in zip(results, schemas, strict=True):
        assert finish_reason == "stop", (finish_reason, text)
        jsonschema.validate(json.loads(text), schema)
    # not all alike: the seeds and temperatures really sample
    assert len({text for text, _ in results[:60]}) > 10


def test_regex_choice_grammar_and_json_object(cluster) -> None:
    cases = [
        ({"guided_regex": r"[a-c]{2,4}-\d{2}"},
         lambda t: re.fullmatch(r"[a-c]{2,4}-\d{2}", t)),
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
         lambda t: t in ("alpha", "beta", "gamma")),
        ({"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9]){0,2} ")"'},
         lambda t: re.fullmatch(r"\(\d(\+\d){0,2}\)", t)),
    ]
    requests, checks = [], []
    for i in range(12):
        fields, check = cases[i % len(cases)]
        path = CHAT if i % 2 else COMPLETIONS
        requests.append((path, _body(path, i, max_tokens=50, **fields)))
        checks.append(check)
    # any JSON object: its strings are free, so a random model may run out of tokens
    for i in range(6):
        requests.append((CHAT, _body(CHAT, i, max_tokens=200,
                                     structured_outputs={"json_object": True,
                                                         "disable_any_whitespace": True})))
    results = _run_all(cluster.base_url, requests)
    for (text, finish_reason), check in zip(results[:12], checks, strict=True):
        assert finish_reason == "stop" and check(text), (finish_reason, text)
    finished = [text for text, finish_reason in results[12:] if finish_reason == "stop"]
    assert finished
    for text in finished:
        assert isinstance(json.loads(text), dict)


@pytest.fixture(scope="module")
def greedy_reference(llama_dir) -> dict[str, Any]:
    """The engine's own greedy output under ORDER, offline: what both clusters must return."""
    from pdserve.serve import LLM

    prompts = [[5, 6, 7, 8, 9, 10 + i] for i in range(3)]
    spec = StructuredOutputs(json=json.dumps(ORDER, separators=(",", ":")),
                             disable_any_whitespace=True)
    with LLM(llama_dir, num_kv_blocks=256) as llm:
        outputs = llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=COMPACT_MAX_TOKENS, structured_outputs=spec))
    return {"prompts": prompts, "texts": [o.outputs[0].text for o in outputs]}


def test_greedy_output_equals_the_colocated_engine(cluster, greedy_reference) -> None:
    """Disaggregated (the first token masked on prefill, the matcher rebuilt on decode) and
    colocated clusters both return exactly the offline engine's greedy text."""
    requests = [(COMPLETIONS, {"prompt": prompt, "temperature": 0, "stream": i == 1,
                               "max_tokens": COMPACT_MAX_TOKENS,
                               "structured_outputs": {"json": ORDER,
                                                      "disable_any_whitespace": True}})
                for i, prompt in enumerate(greedy_reference["prompts"])]
    results = _run_all(cluster.base_url, requests)
    assert [text for text, _ in results] == greedy_reference["texts"]
    for text, finish_reason in results:
        assert finish_reason == "stop"
        jsonschema.validate(json.loads(text), ORDER)


def test_logprobs_of_masked_tokens_are_written_as_vllm_does(cluster) -> None:
    """Logprobs are the masked distribution's (as vLLM's): a token the grammar forbids has
    logprob -inf, which JSON cannot hold, so it is written as vLLM writes it: -9999.0."""
    for stream in (False, True):
        r = httpx.post(f"{cluster.base_url}{CHAT}", timeout=120, json={
            "messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 10,
            "logprobs": True, "top_logprobs": 20, "temperature": 0, "stream": stream,
            "guided_choice": ["yes", "no"]})
        assert r.status_code == 200, r.text
        if not stream:
            entries = r.json()["choices"][0]["logprobs"]["content"]
        else:
            entries = [e for line in r.text.splitlines() if line.startswith("data: {")
                       for choice in json.loads(line[6:])["choices"]
                       for e in (choice.get("logprobs") or {}).get("content") or []]
        assert entries
        top = [t["logprob"] for t in entries[0]["top_logprobs"]]
        assert -9999.0 in top and min(top) == -9999.0  # fewer than 20 tokens are allowed
        assert entries[0]["logprob"] > -9999.0


def test_invalid_schema_is_a_400(cluster) -> None:
    r = httpx.post(f"{cluster.base_url}{CHAT}", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "required": 5}}}})
    assert r.status_code == 400, r.text
    assert "invalid JSON schema" in r.json()["error"]["message"]


class Flag(BaseModel):
    color: Literal["red", "green"]
    n: int = Field(ge=0, le=9)


def test_openai_sdk_parse_helper(cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    for seed in range(2):
        completion = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "a flag, please"}],
            response_format=Flag, max_completion_tokens=SPACED_MAX_TOKENS, temperature=0.8,
            seed=seed)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Flag), completion
        assert completion.choices[0].finish_reason == "stop"
