"""Tool calling on /v1/chat/completions (pdserve/router/tools.py, pdserve/router/tool_parsers.py).

- The parsers, per model family, on hand-written model texts (well-formed, with content
  around the calls, several calls, malformed ones that stay content), and the stream of each
  text (fed in every chunking) accumulating to exactly the non-streamed message.
- The request surface through the real router app over scripted stand-in workers: 400s for
  bad tools and choices, the constraint each choice sends to the workers, tools and tool
  histories rendered through the chat template, and the openai SDK reading `tool_calls`
  streamed and not.
- End to end on a random-weight model (the tests' tiny Llama, whose tokenizer has the default
  model's chat template), colocated and disaggregated: with
  tool_choice "required" and a named function the grammar makes every output parse, and the
  arguments validate against the function's schema (jsonschema). The schemas are bounded
  (enums, strings and arrays with maximum lengths, integer ranges) and max_tokens is ample,
  so that a random model always finishes its JSON: an unbounded string would let it ramble to
  max_tokens, cut the call short, and the test would measure the model, not the server.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random

import jsonschema
import pytest
from fastapi.testclient import TestClient
from helpers.router_util import StandInDispatcher, router_config

from pdserve.protocol.worker import WORKER_PROTOCOL, GenerateRequest, Output
from pdserve.router.app import build_app
from pdserve.router.tool_parsers import TOOL_CALL_PARSERS, ParsedCall, escape_controls
from pdserve.router.tools import (
    ChatTool,
    ToolCallOutput,
    check_schema,
    parse_named,
    parse_required,
    required_schema,
)

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
BOOKING = {
    "type": "object",
    "properties": {
        "nights": {"type": "integer", "minimum": 1, "maximum": 9},
        "guests": {"type": "array", "items": {"type": "string", "maxLength": 6},
                   "maxItems": 2},
        "breakfast": {"type": "boolean"},
    },
    "required": ["nights", "breakfast"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "book_hotel", "parameters": BOOKING}},
]
SCHEMAS = {"get_weather": WEATHER, "book_hotel": BOOKING}


# ---- streams accumulate to the body -------------------------------------------------------
def accumulate(deltas: list[dict]) -> dict:
    """A client's accumulation of delta messages (as the openai SDK merges them)."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in part:
                assert call["id"] is None, "a call's id is sent once, in its first delta"
                assert part["function"]["arguments"] == ""  # OpenAI's first delta
                call["id"], call["name"] = part["id"], part["function"]["name"]
            call["arguments"] += part["function"].get("arguments", "")
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


def streamed(output: ToolCallOutput, pieces: list[str]) -> dict:
    deltas = []
    for k, piece in enumerate(pieces):
        deltas += output.deltas(0, piece, is_final=k == len(pieces) - 1)
    return accumulate(deltas)


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """The text in one piece, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    ways = [[text], list(text) or [""]]
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) \
            if len(text) > 1 else []
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


def check_stream_matches_body(parse, text: str) -> dict:
    body, _ = ToolCallOutput(parse).message(text)
    for pieces in chunkings(text):
        got = streamed(ToolCallOutput(parse), pieces)
        assert (got["content"] or None) == (body["content"] or None), (pieces, got, body)
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in body.get("tool_calls", [])]
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in got["calls"]] == \
            calls, (pieces, got)
        assert all(c["id"].startswith("chatcmpl-tool-") for c in got["calls"])
    return body


def calls_of(body: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in body.get("tool_calls", [])]


# ---- parsers ------------------------------------------------------------------------------
HERMES_CASES = [
    # (model text, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     "\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {"nights": 2}, "name": "book_hotel"}\n'
     "</tool_call>", "Let me check.\n",
     [("get_weather", {"city": "Oslo"}), ("book_hotel", {"nights": 2})]),
    ('<tool_call>{"name": "f", "arguments": {"s": "a \\" } </tool_call> {"}}</tool_call>', None,
     [("f", {"s": 'a " } </tool_call> {'})]),
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    # a raw tab inside a string (grammars allow it, strict JSON does not): escaped
    ('<tool_call>{"name": "f", "arguments": {"s": "a\tb"}}</tool_call>', None,
     [("f", {"s": "a\tb"})]),
    # the model stopped right after the object (the end tag was a stop string)
    ('<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),
    ("no call here, only <tool text", "no call here, only <tool text", []),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
    '<tool_call>{"name": "get weather!", "arguments": {}}</tool_call>',  # not a name
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>',
    "<tool_call>get_weather(city='Paris')</tool_call>",
    "<tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>',
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_parser(text, content, calls) -> None:
    body = check_stream_matches_body(TOOL_CALL_PARSERS["hermes"], text)
    assert body["content"] == content
    assert calls_of(body) == calls


@pytest.mark.parametrize("parser,text", [
    *[("hermes", t) for t in HERMES_MALFORMED],
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),  # cut short
    ("llama3_json", '{"answer": 42}'),  # JSON, but no call
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some'),
    ("llama3_json", "<|python_tag|>brave_search.call(query='x')"),
    ("llama3_json", "[1, 2, 3]"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}'),
    ("mistral", '[TOOL_CALLS]{"name": "f"}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] more'),
    ("mistral", "[TOOL_CALLS]f[ARGS]"),
    ("mistral", "[TOOL_CALLS]not a name[ARGS]{}"),
])
def test_malformed_calls_stay_content(parser, text) -> None:
    body, has_calls = ToolCallOutput(TOOL_CALL_PARSERS[parser]).message(text)
    assert not has_calls and "tool_calls" not in body
    assert body["content"] == text


@pytest.mark.parametrize("parser,text,first_call", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
               '<tool_call>{"name": "g", "arguments": {"b": 2', ("f", '{"a": 1}')),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "param',
     ("f", '{"a": 1}')),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": [1, {"b": "]"}]}}, {"na',
     ("f", '{"a": [1, {"b": "]"}]}')),
    ("hermes", "Hi <tool_call>{broken", None),
])
def test_a_stream_cut_short_keeps_what_it_sent(parser, text, first_call) -> None:
    """Text cut short after a complete call (max_tokens): the body, which cannot parse the
    whole, is all content; the stream has sent the complete call already and cannot take it
    back, and adds the rest as content. Cut before any call, the two agree."""
    output = ToolCallOutput(TOOL_CALL_PARSERS[parser])
    deltas = []
    for k, ch in enumerate(text):
        deltas += output.deltas(0, ch, is_final=k == len(text) - 1)
    got = accumulate(deltas)
    body, has_calls = ToolCallOutput(TOOL_CALL_PARSERS[parser]).message(text)
    assert not has_calls and body["content"] == text
    if first_call is None:
        assert got == {"content": text, "calls": []}
    else:
        assert (got["calls"][0]["name"], got["calls"][0]["arguments"]) == first_call


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}', None,
     [("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ('  {"name": "a", "arguments": {}}; {"name": "b", "parameters": {"x": [1, 2]}}', None,
     [("a", {}), ("b", {"x": [1, 2]})]),
    ("The weather is fine {not json}", "The weather is fine {not json}", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_parser(text, content, calls) -> None:
    body = check_stream_matches_body(TOOL_CALL_PARSERS["llama3_json"], text)
    assert body["content"] == content
    assert calls_of(body) == calls


MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}]',
     None, [("get_weather", {"city": "Lyon", "unit": "celsius"})]),
    ('Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"k": "[TOOL_CALLS]"}}, '
     '{"name": "b", "arguments": {}}]', "Sure. ", [("a", {"k": "[TOOL_CALLS]"}), ("b", {})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]book_hotel[ARGS]{"nights": 3}',
     None, [("get_weather", {"city": "Nice"}), ("book_hotel", {"nights": 3})]),
    ("Just text [TOOL", "Just text [TOOL", []),
]


@pytest.mark.parametrize("text,content,calls", MISTRAL_CASES)
def test_mistral_parser(text, content, calls) -> None:
    body = check_stream_matches_body(TOOL_CALL_PARSERS["mistral"], text)
    assert body["content"] == content
    assert calls_of(body) == calls


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_CASES = [
    # V3 / R1: type, separator, name, fenced arguments
    (f"Checking.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
     f'{{"city": "Oslo"}}\n```{DS_CALL_END}{DS_CALL}function{DS_SEP}book_hotel\n```json\n'
     f'{{"nights": 2, "tags": ["```"]}}\n```{DS_CALL_END}{DS_END}', "Checking.",
     [("get_weather", {"city": "Oslo"}), ("book_hotel", {"nights": 2, "tags": ["```"]})]),
    # V3.1: name, separator, bare arguments
    (f'{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Rome"}}{DS_CALL_END}{DS_END}', None,
     [("get_weather", {"city": "Rome"})]),
    ("Plain text <｜tool", "Plain text <｜tool", []),
]


@pytest.mark.parametrize("text,content,calls", DEEPSEEK_CASES)
def test_deepseek_v3_parser(text, content, calls) -> None:
    body = check_stream_matches_body(TOOL_CALL_PARSERS["deepseek_v3"], text)
    assert body["content"] == content
    assert calls_of(body) == calls


@pytest.mark.parametrize("text", [
    f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Os',  # cut short
    f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n{{}}{DS_CALL_END}{DS_END}",  # no fence
    f"{DS_BEGIN}{DS_CALL}not a name{DS_SEP}{{}}{DS_CALL_END}{DS_END}",
    f"{DS_BEGIN}{DS_CALL}f{DS_SEP}[1]{DS_CALL_END}{DS_END}",
    f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{{}}{DS_CALL_END}{DS_END} trailing",
])
def test_malformed_deepseek_calls_stay_content(text) -> None:
    body, has_calls = ToolCallOutput(TOOL_CALL_PARSERS["deepseek_v3"]).message(text)
    assert not has_calls and body["content"] == text


def test_a_marker_prefix_is_held_back_until_it_is_decided() -> None:
    output = ToolCallOutput(TOOL_CALL_PARSERS["hermes"])
    assert output.deltas(0, "Hello <tool", is_final=False) == [{"content": "Hello "}]
    assert output.deltas(0, "box", is_final=False) == [{"content": "<toolbox"}]
    output = ToolCallOutput(TOOL_CALL_PARSERS["hermes"])
    assert output.deltas(0, "  \n", is_final=False) == []  # whitespace waits
    deltas = output.deltas(0, '<tool_call>{"name": "f", "arguments": {"a"', is_final=False)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a"'}}
    assert output.deltas(0, ": 1}}</tool_call>\n", is_final=True) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]


def test_raw_control_characters_in_strings_are_escaped_as_they_stream() -> None:
    raw = '{"a": "x\ty\n", "b": ["\\"\t"],\t"c": 1}'
    assert escape_controls(raw) == '{"a": "x\\ty\\n", "b": ["\\"\\t"],\t"c": 1}'
    assert json.loads(escape_controls(raw)) == json.loads(raw, strict=False)
    for cut in range(len(raw)):
        assert escape_controls(raw).startswith(escape_controls(raw[:cut]))
    body = check_stream_matches_body(functools.partial(parse_named, "f"), raw)
    assert json.loads(body["tool_calls"][0]["function"]["arguments"]) == \
        json.loads(raw, strict=False)


def test_choices_stream_their_calls_apart() -> None:
    """n > 1: interleaved chunks of two choices, each parsed on its own."""
    output = ToolCallOutput(parse_required)
    texts = {0: '[{"name": "a", "parameters": {"x": 1}}]', 1: '[{"name": "b", "parameters": {}}]'}
    deltas: dict[int, list[dict]] = {0: [], 1: []}
    for k in range(max(map(len, texts.values()))):
        for index, text in texts.items():
            if k < len(text):
                chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": text[k]},
                                                 "logprobs": None, "finish_reason":
                                                 "stop" if k == len(text) - 1 else None}]}
                for out in output.rewrite_chunk(chunk, index):
                    deltas[index].append(out["choices"][0]["delta"])
                    if out["choices"][0]["finish_reason"]:
                        assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in accumulate(deltas[0])["calls"]] == \
        [("a", '{"x": 1}')]
    assert [(c["name"], c["arguments"]) for c in accumulate(deltas[1])["calls"]] == \
        [("b", "{}")]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    body, _ = ToolCallOutput(TOOL_CALL_PARSERS["hermes"], max_calls=1).message(text)
    assert calls_of(body) == [("a", {})]
    got = streamed(ToolCallOutput(TOOL_CALL_PARSERS["hermes"], max_calls=1), list(text))
    assert [c["name"] for c in got["calls"]] == ["a"]


# ---- required and named: the constrained outputs ------------------------------------------
def test_required_schema_has_vllms_shape_and_accepts_only_valid_calls() -> None:
    tools = [ChatTool.model_validate(t) for t in TOOLS]
    schema = required_schema(tools, parallel_tool_calls=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [a["properties"]["name"] for a in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["book_hotel"]}]
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
            {"name": "book_hotel", "parameters": {"nights": 2, "breakfast": False}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"nights": 2}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(tools, parallel_tool_calls=False)["maxItems"] == 1


def test_required_schema_lifts_defs() -> None:
    tool = ChatTool.model_validate({"function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "integer"}}}}})
    schema = required_schema([tool], True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_required_and_named_outputs_stream_as_their_bodies() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}, '
            '{"name": "book_hotel", "parameters": {"nights": 1, "breakfast": true}}]')
    body = check_stream_matches_body(parse_required, text)
    assert calls_of(body) == [("get_weather", {"city": "Oslo", "unit": "celsius"}),
                              ("book_hotel", {"nights": 1, "breakfast": True})]
    body = check_stream_matches_body(functools.partial(parse_named, "get_weather"),
                                     '{"city": "Oslo", "unit": "celsius"}')
    assert calls_of(body) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    # unconstrained text (no grammar applied) is content, not a call
    assert ToolCallOutput(parse_required).message("hello")[0]["content"] == "hello"
    # cut short by max_tokens: the calls so far, the last one unfinished, as it streamed
    cut = text[:60]
    body = check_stream_matches_body(parse_required, cut)
    assert body["tool_calls"][0]["function"]["arguments"] == cut[cut.index('{"city"'):]


@pytest.mark.parametrize("schema", [
    {"type": "objekt"}, {"type": "object", "properties": []},
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "required": "a"}, {"anyOf": []}, {"maxLength": -1},
    {"type": "array", "items": 3},
])
def test_check_schema_refuses_what_is_no_schema(schema) -> None:
    with pytest.raises(ValueError):
        check_schema(schema)


def test_check_schema_accepts_schemas() -> None:
    for schema in (WEATHER, BOOKING, {}, {"type": ["string", "null"]},
                   {"anyOf": [{"type": "integer"}, True]}):
        check_schema(schema)
        jsonschema.Draft202012Validator.check_schema(schema)


# ---- through the router app, over scripted stand-in workers --------------------------------
class ScriptedDispatcher(StandInDispatcher):
    """Stand-in workers that answer with `self.script`'s text, a piece per output (each
    through the worker protocol's codec), then finish with `self.finish_reason`."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for worker in self.workers:  # room for the tools' signatures in the prompt
            worker.status = dataclasses.replace(worker.status, max_model_len=2048)
        self.script: list[str] = ["x"]
        self.finish_reason = "stop"
        self.prompts: list[list[int]] = []

    async def run(self, request_id, prompt_token_ids, sampling, first_worker, phases=None):
        request = GenerateRequest(request_id, prompt_token_ids, sampling)
        assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(request)) == request
        self.sent.append(sampling)
        self.prompts.append(list(prompt_token_ids))
        first_worker.finish(request_id)
        for k, piece in enumerate(self.script):
            last = k == len(self.script) - 1
            output = Output(request_id, [7], piece, self.finish_reason if last else None,
                            num_prompt_tokens=len(prompt_token_ids))
            yield WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(output))


@pytest.fixture()
def app_client(llama_dir):
    def make(**config):
        config = router_config(llama_dir, **config)
        dispatcher = ScriptedDispatcher(config)
        return TestClient(build_app(config, dispatcher)), dispatcher
    return make


def _stream_body(client: TestClient, body: dict) -> tuple[dict, str | None]:
    """The stream of `body` accumulated: the message and the finish reason."""
    deltas, finish = [], None
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    return accumulate(deltas), finish


@pytest.mark.parametrize("body,message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "objekt"}}}]},
     "type must be one of"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    # a schema the grammar compiler refuses, for a choice that compiles it
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}],
      "tool_choice": "required"}, "invalid JSON schema"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "does not match any"),
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser"),
    ({"tools": TOOLS * 2, "tool_choice": "required"}, "unique"),
    ({"functions": [{"name": "f"}]}, "functions is not supported"),
    ({"function_call": "auto"}, "function_call is not supported"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "only assistant messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {}}]}]},
     "messages.0.tool_calls.0.function.name"),
])
def test_bad_tool_requests_are_openai_400s(app_client, body, message) -> None:
    client, dispatcher = app_client()
    with client:
        r = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert message in error["message"] or message == error["param"], error
    assert dispatcher.sent == []


def test_completions_refuse_tools(app_client) -> None:
    client, _ = app_client()
    with client:
        r = client.post("/v1/completions", json={"prompt": "hi", "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_each_choice_sends_its_constraint(app_client) -> None:
    client, dispatcher = app_client()
    with client:
        for choice in ("required", {"type": "function", "function": {"name": "book_hotel"}},
                       "none"):
            r = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4, "tools": TOOLS,
                                        "tool_choice": choice, "parallel_tool_calls": False})
            assert r.status_code == 200, r.text
        required, named, none = dispatcher.sent
        schema = json.loads(required.structured_outputs.json)
        assert schema == required_schema([ChatTool.model_validate(t) for t in TOOLS], False)
        assert json.loads(named.structured_outputs.json) == BOOKING
        assert none.structured_outputs is None
        # tool_choice "none" with tools: rendered, not parsed ("x" stays content)
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "x"}
        r = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4})
        with_tools, without = dispatcher.prompts[-2], dispatcher.prompts[-1]
        assert len(with_tools) > len(without) + 50  # the signatures are in the prompt


def test_tool_history_renders_through_the_template(app_client, llama_dir) -> None:
    from transformers import AutoTokenizer

    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"},
    ]
    client, dispatcher = app_client()
    with client:
        r = client.post(CHAT, json={"messages": messages, "tools": TOOLS, "max_tokens": 4,
                                    "tool_choice": "none"})
        assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    text = tokenizer.decode(dispatcher.prompts[-1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '"name": "book_hotel"' in text  # the tools, in the system block
    expected = tokenizer.apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in messages[:1]] + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "chatcmpl-tool-1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            messages[2]], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == expected


REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},'
                 ' {"name": "book_hotel", "parameters": {"nights": 2, "breakfast": true}}]')
AUTO_TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
             '"unit": "celsius"}}\n</tool_call>')


@pytest.mark.parametrize("choice,script,finish", [
    ("required", REQUIRED_TEXT, "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}},
     '{"city": "Oslo", "unit": "celsius"}', "stop"),
    ("auto", AUTO_TEXT, "tool_calls"),
])
def test_openai_sdk_reads_tool_calls_streamed_and_not(app_client, choice, script, finish
                                                      ) -> None:
    from openai import OpenAI

    client, dispatcher = app_client(enable_auto_tool_choice=True, tool_call_parser="hermes")
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, len(script)), 12))
    dispatcher.script = [script[a:b] for a, b in zip([0, *cuts], [*cuts, len(script)],
                                                     strict=True)]
    with client:
        sdk = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        request = dict(model="llama-model", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                       max_tokens=64)
        request["model"] = sdk.models.list().data[0].id
        completion = sdk.chat.completions.create(**request)
        choice0 = completion.choices[0]
        assert choice0.finish_reason == finish
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice0.message.tool_calls]
        assert calls and all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
                             for c in choice0.message.tool_calls)
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        with sdk.chat.completions.stream(**request) as stream:
            final = stream.get_final_completion()
        got = final.choices[0]
        assert got.finish_reason == finish
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in got.message.tool_calls] == calls
        assert (got.message.content or None) == (choice0.message.content or None)
        # and by hand: OpenAI's delta shapes
        message, stream_finish = _stream_body(client, {**request, "stream": True})
        assert stream_finish == finish
        assert [(c["name"], json.loads(c["arguments"])) for c in message["calls"]] == calls
    if choice == "auto":
        assert choice0.message.content == "Checking.\n"
        assert dispatcher.sent[0].structured_outputs is None
    else:
        assert choice0.message.content is None
        assert dispatcher.sent[0].structured_outputs is not None


def test_auto_without_a_call_is_plain_content(app_client) -> None:
    client, dispatcher = app_client(enable_auto_tool_choice=True, tool_call_parser="mistral")
    dispatcher.script = ["Hello", " there"]
    with client:
        r = client.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 8})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "Hello there"}
        assert choice["finish_reason"] == "stop"
        assert dispatcher.sent[-1].skip_special_tokens is False  # [TOOL_CALLS] is special
        message, finish = _stream_body(client, {"messages": MESSAGES, "tools": TOOLS,
                                                "max_tokens": 8})
        assert message == {"content": "Hello there", "calls": []} and finish == "stop"


def test_parsed_call_defaults() -> None:
    assert ParsedCall("f", "{}").is_complete


def test_a_cached_default_model_gets_the_tools_template(tmp_path) -> None:
    from pdserve.serve import default_model

    target = tmp_path / default_model.DEFAULT_MODEL_NAME
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_text("{}")
    (target / "chat_template.jinja").write_text("{% for message in messages %}{% endfor %}")
    assert default_model.default_model_dir(tmp_path) == target
    template = (target / "chat_template.jinja").read_text()
    assert template == default_model.CHAT_TEMPLATE and "tool_call" in template


def test_flags_reach_the_router_config(llama_dir) -> None:
    import argparse

    from pdserve.app import launcher
    from pdserve.router import server

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    router = next(c for c in launcher.plan(args, "/m", gpus=[]).children
                  if c.role == "router")
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    config = server.config_from_args(parser.parse_args(
        [*router.argv[1:], "--colocated", "tcp://127.0.0.1:1"]))
    assert config.enable_auto_tool_choice and config.tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        router_config(llama_dir, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        router_config(llama_dir, tool_call_parser="pythonic")


# ---- end to end: the grammar makes required and named calls parse -------------------------
NUM_REQUIRED = 16
"""Required tool calls per mode, seeds 0..NUM_REQUIRED-1, every other one streamed."""
E2E_MAX_TOKENS = 400
"""Ample for the bounded schemas above (a call is at most ~150 characters), so a random
model always finishes its JSON before max_tokens."""


@pytest.fixture(scope="module")
def cluster(served_cluster):
    """The shared `pdserve up` (conftest.served_cluster), colocated and disaggregated."""
    return served_cluster


def _cluster_call(base_url: str, body: dict, stream: bool) -> tuple[list[dict], str, dict]:
    """(calls as {"name", "arguments"}, finish_reason, usage-or-{}) of one request."""
    import httpx

    if not stream:
        r = httpx.post(f"{base_url}{CHAT}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls = [c["function"] for c in choice["message"].get("tool_calls", [])]
        return calls, choice["finish_reason"], choice["message"]
    deltas, finish = [], None
    with httpx.stream("POST", f"{base_url}{CHAT}", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    deltas.append(choice["delta"])
                    finish = choice["finish_reason"] or finish
    message = accumulate(deltas)
    return ([{"name": c["name"], "arguments": c["arguments"]} for c in message["calls"]],
            finish, message)


def test_required_tool_calls_always_parse(cluster) -> None:
    for seed in range(NUM_REQUIRED):
        parallel = seed % 3 != 2
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                "max_tokens": E2E_MAX_TOKENS, "temperature": 1.0, "seed": seed,
                "parallel_tool_calls": parallel}
        calls, finish, message = _cluster_call(cluster.base_url, body, stream=seed % 2 == 1)
        assert finish == "tool_calls", (seed, message)
        assert calls and (parallel or len(calls) == 1), (seed, message)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_tool_choice_calls_that_function(cluster) -> None:
    for seed in range(4):
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": E2E_MAX_TOKENS,
                "tool_choice": {"type": "function", "function": {"name": "book_hotel"}},
                "temperature": 1.0, "seed": 100 + seed}
        calls, finish, message = _cluster_call(cluster.base_url, body, stream=seed % 2 == 1)
        assert finish == "stop" and [c["name"] for c in calls] == ["book_hotel"], message
        jsonschema.validate(json.loads(calls[0]["arguments"]), BOOKING)


def test_auto_parses_the_models_text_streamed_and_not(cluster) -> None:
    """The random model writes no <tool_call>: its text comes back as content, the same
    streamed and not (one seed, one sampled output), and the finish is the model's."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 24, "temperature": 1.0,
            "seed": 3}
    calls, finish, message = _cluster_call(cluster.base_url, body, stream=False)
    streamed_calls, streamed_finish, streamed_message = _cluster_call(cluster.base_url, body,
                                                                      stream=True)
    assert calls == streamed_calls and finish == streamed_finish in ("stop", "length")
    assert message["content"] and message["content"] == streamed_message["content"]


def test_openai_sdk_gets_the_same_calls_streamed_and_not(cluster) -> None:
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    request = dict(model=sdk.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                   tool_choice="required", max_tokens=E2E_MAX_TOKENS, temperature=1.0,
                   seed=7)
    completion = sdk.chat.completions.create(**request)
    with sdk.chat.completions.stream(**request) as stream:
        streamed_completion = stream.get_final_completion()
    # one seed, one sampled output: the stream accumulates to the same calls
    calls = [(c.function.name, c.function.arguments)
             for c in completion.choices[0].message.tool_calls]
    assert calls == [(c.function.name, c.function.arguments)
                     for c in streamed_completion.choices[0].message.tool_calls]
    assert completion.choices[0].finish_reason == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    # a chat history with the call and its result goes back through the template
    call = completion.choices[0].message.tool_calls[0]
    follow_up = sdk.chat.completions.create(
        model=request["model"], tools=TOOLS, max_tokens=8, tool_choice="none",
        messages=[*MESSAGES, completion.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow_up.choices[0].message.tool_calls is None
    assert follow_up.usage.prompt_tokens > completion.usage.prompt_tokens
