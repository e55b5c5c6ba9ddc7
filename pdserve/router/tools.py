"""Tool calling for /v1/chat/completions, as OpenAI's API and vLLM serve it.

A request's `tools` go into the chat template (`apply_chat_template(..., tools=...)`), and its
`tool_choice` decides what happens to the output:

    "none"                 tools rendered; nothing constrained, nothing parsed (as vLLM)
    "auto"                 free generation; the operator's parser (`--enable-auto-tool-choice
                           --tool-call-parser NAME`, pdserve/router/tool_parsers.py) finds the calls
                           in the text, and the text around them stays content
    "required"             the output is constrained (StructuredOutputs on the worker) to a
                           JSON array of one or more `{"name": <a tool>, "parameters": <its
                           schema>}` (at most one when parallel_tool_calls is false): vLLM's
                           shape, so the calls always parse
    {"type": "function",   constrained to that function's parameters schema: the whole output
     "function": {...}}    is the one call's arguments

Tools given without tool_choice mean "auto"; "auto" on a router started without a parser is a
400, as in vLLM. The legacy `functions` / `function_call` fields are refused with a 400 (use
`tools` / `tool_choice`): mapping them would answer in `tool_calls`, which their clients do not
read.

The response carries `message.tool_calls` (ids `chatcmpl-tool-<hex>`, arguments as the JSON
text the model wrote) and finish_reason "tool_calls" (auto and required; a named choice says
"stop", as OpenAI does). A stream sends each call as OpenAI does: a first delta with its
index, id, type, name and arguments "", then argument fragments. Both come from one parse of
the text (pdserve/router/tool_parsers.py), so a stream accumulated by a client equals the body.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.protocol.sampling import SamplingParams, StructuredOutputs
from pdserve.router.errors import ApiError
from pdserve.router.tool_parsers import (
    KEEPS_SPECIAL_TOKENS,
    TOOL_CALL_PARSERS,
    MalformedJson,
    ParsedCall,
    ParsedText,
    Parser,
    ScanMemo,
    escape_controls,
    scan_call_array,
    skip_whitespace,
)

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig

TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
"""Request fields this module serves (on chat completions only)."""
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128
"""OpenAI's limit on `tools` per request."""
MAX_SCHEMA_DEPTH = 64


# ---- request models -----------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); None: no arguments."""
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            check_schema(parameters)
        return parameters


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's form)."""


class MessageToolCall(BaseModel):
    """A call in an assistant message of the chat history."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


_SCHEMA_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "additionalItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
           "maxProperties")


def check_schema(schema: Any, depth: int = 0) -> None:
    """Raise ValueError when `schema` is not a JSON schema (the keywords that shape a tool's
    arguments are checked: types, subschemas, required, enum, counts). Iterates no deeper
    than MAX_SCHEMA_DEPTH, so a hostile body cannot exhaust the stack."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object or a boolean")
    kinds = schema.get("type")
    if kinds is not None:
        kinds_list = kinds if isinstance(kinds, list) else [kinds]
        if not kinds_list or any(k not in _SCHEMA_TYPES for k in kinds_list):
            raise ValueError(f"type must be one of {sorted(_SCHEMA_TYPES)}, got {kinds!r}")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise ValueError(f"{key} must be an object of schemas")
            for sub in schema[key].values():
                check_schema(sub, depth + 1)
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise ValueError(f"{key} must be a non-empty array of schemas")
            for sub in schema[key]:
                check_schema(sub, depth + 1)
    for key in _SUBSCHEMAS:
        if key in schema:
            check_schema(schema[key], depth + 1)
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or
                                 any(not isinstance(r, str) for r in required) or
                                 len(set(required)) != len(required)):
        raise ValueError("required must be an array of unique strings")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError("enum must be an array")
    for key in _COUNTS:
        if key in schema and (not isinstance(schema[key], int) or isinstance(schema[key], bool)
                              or schema[key] < 0):
            raise ValueError(f"{key} must be a non-negative integer")


# ---- the plan of one request --------------------------------------------------------------
Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for: checked against the request and the router's
    flags (ApiError 400 otherwise) by `for_request`."""

    mode: Mode
    tools: tuple[ChatTool, ...]
    named: str | None = None
    parallel_tool_calls: bool = True
    parser: str | None = None
    """The auto mode's parser name (pdserve/router/tool_parsers.py)."""

    @classmethod
    def for_request(cls, tools: list[ChatTool] | None, tool_choice: ToolChoice | None,
                    parallel_tool_calls: bool | None, config: RouterConfig
                    ) -> ToolPlan | None:
        """None when the request has no tools (and no tool_choice that needs them)."""
        tools = tools or None  # [] asks for nothing, like null
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tools is None:
            if tool_choice != "none":
                raise ApiError(400, "When using `tool_choice`, `tools` must be set.",
                               "tool_choice")
            return None
        if len(tools) > MAX_TOOLS:
            raise ApiError(400, f"at most {MAX_TOOLS} tools per request", "tools")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ApiError(400, "tool function names must be unique", "tools")
        parallel = parallel_tool_calls is not False
        if isinstance(tool_choice, NamedToolChoice):
            if tool_choice.function.name not in names:
                raise ApiError(400, "The tool specified in `tool_choice` does not match any "
                               "of the specified `tools`", "tool_choice")
            return cls("named", tuple(tools), tool_choice.function.name, parallel)
        if tool_choice == "auto":
            if not config.enable_auto_tool_choice or config.tool_call_parser is None:
                raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice '
                               "and --tool-call-parser to be set", "tool_choice")
            return cls("auto", tuple(tools), None, parallel, config.tool_call_parser)
        return cls(tool_choice, tuple(tools), None, parallel)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's JSON form)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def structured_outputs(self) -> StructuredOutputs | None:
        """The grammar that makes required and named calls always parse."""
        # No optional whitespace in the JSON: a grammar that allows runs of it lets a model
        # (a random one does) write spaces until max_tokens, and the call never ends.
        if self.mode == "named":
            return StructuredOutputs(json=json.dumps(self._parameters(self.named)),
                                     disable_any_whitespace=True)
        if self.mode == "required":
            return StructuredOutputs(json=json.dumps(required_schema(
                self.tools, self.parallel_tool_calls)), disable_any_whitespace=True)
        return None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` with this plan's constraint (and, for parsers whose markers are special
        tokens, special tokens kept in the text)."""
        constraint = self.structured_outputs()
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ApiError(400, f"tool_choice {self._choice_text()} constrains the output "
                               "already: it cannot be combined with response_format or "
                               "structured outputs", "tool_choice")
            return replace(params, structured_outputs=constraint)
        if self.mode == "auto" and self.parser in KEEPS_SPECIAL_TOKENS:
            return replace(params, skip_special_tokens=False)
        return params

    def output(self) -> ToolCallOutput | None:
        """The per-request renderer of the output; None for "none" (plain content)."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            named = self.named
            assert named is not None
            return ToolCallOutput(functools.partial(parse_named, named),
                                  finishes_as_tool_calls=False)
        if self.mode == "required":
            return ToolCallOutput(parse_required, max_calls=None if self.parallel_tool_calls
                                  else 1)
        assert self.parser is not None
        return ToolCallOutput(TOOL_CALL_PARSERS[self.parser],
                              max_calls=None if self.parallel_tool_calls else 1)

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return parameters_schema(tool)

    def _choice_text(self) -> str:
        return f"function {self.named!r}" if self.mode == "named" else f'"{self.mode}"'


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    """A tool's arguments schema: no parameters still means a JSON object (as vLLM)."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: tuple[ChatTool, ...] | list[ChatTool], parallel_tool_calls: bool
                    ) -> dict[str, Any]:
    """tool_choice "required": a JSON array of calls, each `{"name", "parameters"}` of one of
    the tools (vLLM's shape). Each tool's `$defs` move to the top, where its `$ref`s point
    (`#/$defs/...`); two tools defining one name differently are a 400."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        parameters = dict(parameters_schema(tool))
        for def_name, definition in (parameters.pop("$defs", None) or {}).items():
            if def_name in defs and defs[def_name] != definition:
                raise ApiError(400, f"tools define `$defs/{def_name}` differently", "tools")
            defs[def_name] = definition
        alternatives.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str, is_final: bool, memo: ScanMemo | None = None) -> ParsedText:
    """The constrained output of tool_choice "required": `[{"name": ..., "parameters": ...}]`.
    An output cut short (max_tokens) keeps its calls so far, the last one unfinished, as
    its stream did; text that is no such array (the constraint was not applied) is content."""
    begin = skip_whitespace(text, 0)
    if begin == len(text):
        return ParsedText(text if is_final else "")
    if text[begin] != "[":
        return ParsedText(text)
    try:
        calls, end = scan_call_array(text, begin, ("parameters",), memo)
    except MalformedJson:
        return ParsedText(text) if is_final else ParsedText("")
    if is_final and not calls:
        return ParsedText(text)
    return ParsedText("", calls)


def parse_named(name: str, text: str, is_final: bool, memo: ScanMemo | None = None
                ) -> ParsedText:
    """The constrained output of a named tool_choice: the whole text is the arguments."""
    begin = skip_whitespace(text, 0)
    if begin == len(text):
        return ParsedText("")
    return ParsedText("", [ParsedCall(name, escape_controls(text[begin:], memo, begin),
                                      is_complete=is_final)])


# ---- the output of one request ------------------------------------------------------------
def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class _ChoiceStream:
    """What one choice's stream has sent so far."""

    text: str = ""
    content_sent: str = ""
    call_ids: list[str] = field(default_factory=list)
    arguments_sent: list[str] = field(default_factory=list)
    memo: ScanMemo = field(default_factory=ScanMemo)
    """The parser's scans so far (its text only grows)."""


class ToolCallOutput:
    """Turns one request's output text into tool calls: `rewrite_body` for a whole response,
    `rewrite_chunk` for a stream (state per choice index)."""

    def __init__(self, parse: Parser, max_calls: int | None = None,
                 finishes_as_tool_calls: bool = True) -> None:
        self.parse = parse
        self.max_calls = max_calls
        self.finishes_as_tool_calls = finishes_as_tool_calls
        self._streams: dict[int, _ChoiceStream] = {}

    def _calls(self, parsed: ParsedText) -> list[ParsedCall]:
        return parsed.calls if self.max_calls is None else parsed.calls[:self.max_calls]

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if has_calls and reason == "stop" and self.finishes_as_tool_calls:
            return "tool_calls"
        return reason

    # -- a whole response
    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for the output text, and whether it calls tools."""
        parsed = self.parse(text, True, None)
        calls = self._calls(parsed)
        content: str | None = parsed.content
        if calls and not parsed.content.strip():
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": new_tool_call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, bool(calls)

    def rewrite_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat.completion body with each choice's content turned into content + calls."""
        for choice in body.get("choices", []):
            message = choice.get("message") or {}
            new_message, has_calls = self.message(message.get("content") or "")
            choice["message"] = {**message, **new_message}
            choice["finish_reason"] = self.finish_reason(choice.get("finish_reason"), has_calls)
        return body

    # -- a stream
    def deltas(self, index: int, text: str, is_final: bool) -> list[dict[str, Any]]:
        """The delta messages for `text`, the next piece of choice `index`'s output."""
        state = self._streams.setdefault(index, _ChoiceStream())
        state.text += text
        parsed = self.parse(state.text, is_final, state.memo)
        calls = self._calls(parsed)
        deltas: list[dict[str, Any]] = []
        # Content waits until it holds more than whitespace (the body drops whitespace-only
        # content beside calls), or for the end when no call came.
        content = parsed.content
        if (content.startswith(state.content_sent) and len(content) > len(state.content_sent)
                and (content.strip() or (is_final and not calls and not state.call_ids))):
            deltas.append({"content": content[len(state.content_sent):]})
            state.content_sent = content
        for i, call in enumerate(calls):
            if i == len(state.call_ids):
                state.call_ids.append(new_tool_call_id())
                state.arguments_sent.append("")
                deltas.append({"tool_calls": [{
                    "index": i, "id": state.call_ids[i], "type": "function",
                    "function": {"name": call.name, "arguments": ""}}]})
            sent = state.arguments_sent[i]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                deltas.append({"tool_calls": [{
                    "index": i, "function": {"arguments": call.arguments[len(sent):]}}]})
                state.arguments_sent[i] = call.arguments
        return deltas

    def rewrite_chunk(self, chunk: dict[str, Any], index: int | None = None
                      ) -> list[dict[str, Any]]:
        """A chat.completion.chunk of plain content as the chunks to send: content and
        tool-call deltas; none while the text is held back; the finish on the last.
        `index`: the choice the chunk belongs to (n > 1), if its body does not say."""
        chunks = []
        for choice in chunk.get("choices", []):
            index = choice.get("index", 0) if index is None else index
            finish = choice.get("finish_reason")
            deltas = self.deltas(index, (choice.get("delta") or {}).get("content") or "",
                                 finish is not None)
            if finish is not None:
                finish = self.finish_reason(finish, bool(self._streams[index].call_ids))
            if not deltas and (finish is not None or choice.get("logprobs")):
                deltas = [{}]
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                chunks.append({**chunk, "choices": [{
                    **choice, "delta": delta, "finish_reason": finish if last else None,
                    "logprobs": choice.get("logprobs") if last else None}]})
        return chunks


# ---- the chat history ---------------------------------------------------------------------
def template_message(role: str, content: str, name: str | None,
                     tool_calls: list[MessageToolCall] | None,
                     tool_call_id: str | None) -> dict[str, Any]:
    """One history message as chat templates read it: assistant calls with their arguments
    as objects (templates write them with `tojson`; text that is not JSON stays text), tool
    results with the id of the call they answer."""
    message: dict[str, Any] = {"role": role, "content": content}
    if name is not None and role == "tool":
        message["name"] = name
    if tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name,
                          "arguments": _arguments_value(c.function.arguments)}}
            for c in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def check_history(messages: list[Any]) -> None:
    """OpenAI's rules for tool messages in the history (ApiError 400)."""
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise ApiError(400, "a message with role 'tool' needs the tool_call_id of the call "
                           "it answers", f"messages.{i}.tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, "only assistant messages carry tool_calls",
                           f"messages.{i}.tool_calls")
