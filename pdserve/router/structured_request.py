"""A request body's structured-output fields, read into the one StructuredOutputs spec.

Clients ask for structured output in three dialects, all accepted on /v1/completions and
/v1/chat/completions, streaming or not:

    OpenAI  response_format: {"type": "text"}                      (free text: no spec)
                             {"type": "json_object"}               any JSON object
                             {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    vLLM    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object",
                                 "disable_any_whitespace"}
    vLLM's older fields  guided_json, guided_regex, guided_choice, guided_grammar,
                         guided_decoding_backend ("xgrammar", "auto" or absent: the one backend),
                         guided_whitespace_pattern (refused: xgrammar has no such option)

At most one way of asking is allowed per request (two are a 400, not a silent pick); a
response_format schema is always enforced (vLLM ignores `strict` likewise). Reading is cheap
and runs in SamplingFields.sampling_params; `check_structured_outputs` then parses the schema,
regex or grammar with xgrammar (no tokenizer needed: pdserve.structured_grammar), off the
event loop, so an invalid one is the client's 400 naming the problem and never a worker error.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.protocol.sampling import StructuredOutputs
from pdserve.structured_grammar import StructuredOutputsError, build_grammar

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older per-kind fields, each one way of asking."""
GUIDED_BACKENDS = ("xgrammar", "auto")
STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object",
                           "disable_any_whitespace"}
"""vLLM's StructuredOutputsParams fields pdserve honours; the others (structural_tag,
whitespace_pattern, disable_additional_properties) are refused when they ask for anything."""


class StructuredRequestError(ValueError):
    """A structured-output field the router refuses (a 400), with the field at fault."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs_of(body: Any) -> StructuredOutputs | None:
    """The spec a body asks for (None: free text), from whichever dialect it used; raises
    StructuredRequestError when the fields are malformed, conflicting or unsupported."""
    _check_guided_options(body)
    asked: list[tuple[str, StructuredOutputs]] = []
    response_format = _from_response_format(getattr(body, "response_format", None))
    if response_format is not None:
        asked.append(("response_format", response_format))
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        asked.append(("structured_outputs", _from_structured_outputs(structured)))
    for name in GUIDED_FIELDS:
        value = getattr(body, name, None)
        if value is not None:
            asked.append((name, _from_guided(name, value)))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise StructuredRequestError(
            f"ask for structured output one way only; this request sets {names}", asked[1][0])
    return asked[0][1] if asked else None


def check_structured_outputs(spec: StructuredOutputs) -> None:
    """Parse the spec's schema / regex / grammar with xgrammar (CPU work: call it off the
    event loop); raises StructuredRequestError naming the problem."""
    try:
        build_grammar(spec)
    except StructuredOutputsError as exc:
        raise StructuredRequestError(str(exc), None) from None


def _check_guided_options(body: Any) -> None:
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise StructuredRequestError(
            f"guided_decoding_backend {backend!r} is not available: pdserve decodes with "
            "'xgrammar' (or 'auto')", "guided_decoding_backend")
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        raise StructuredRequestError(
            "guided_whitespace_pattern is not supported (xgrammar has no whitespace pattern; "
            "structured_outputs.disable_any_whitespace gives compact JSON)",
            "guided_whitespace_pattern")


def _from_response_format(value: Any) -> StructuredOutputs | None:
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, dict):
        raise StructuredRequestError("response_format must be an object with a 'type'", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredRequestError(
                "response_format.json_schema must be an object with a 'schema'",
                "response_format.json_schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise StructuredRequestError("response_format.json_schema.name must be a string",
                                         "response_format.json_schema.name")
        if "schema" not in spec:
            raise StructuredRequestError("response_format.json_schema.schema is required",
                                         "response_format.json_schema.schema")
        return StructuredOutputs(json=_schema_text(spec["schema"],
                                                   "response_format.json_schema.schema"))
    raise StructuredRequestError(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
        "'json_schema'", "response_format.type")


def _from_structured_outputs(value: Any) -> StructuredOutputs:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredRequestError("structured_outputs must be an object", param)
    in_use = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(in_use) - STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise StructuredRequestError(
            f"structured_outputs.{unknown[0]} is not supported by pdserve",
            f"{param}.{unknown[0]}")
    for flag in ("json_object", "disable_any_whitespace"):
        if not isinstance(value.get(flag, False) or False, bool):
            raise StructuredRequestError(f"structured_outputs.{flag} must be a boolean",
                                         f"{param}.{flag}")
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if k in in_use]
    if len(kinds) != 1:
        raise StructuredRequestError(
            "structured_outputs needs exactly one of json, regex, choice, grammar, "
            f"json_object; got {', '.join(kinds) or 'none'}", param)
    kind = kinds[0]
    where = f"{param}.{kind}"
    whitespace = bool(value.get("disable_any_whitespace") or False)
    if kind == "json":
        return StructuredOutputs(json=_schema_text(value["json"], where),
                                 disable_any_whitespace=whitespace)
    if kind == "json_object":
        return StructuredOutputs(json_object=True, disable_any_whitespace=whitespace)
    return _one_of(kind, value[kind], where, whitespace)


def _from_guided(name: str, value: Any) -> StructuredOutputs:
    if name == "guided_json":
        return StructuredOutputs(json=_schema_text(value, name))
    return _one_of(name.removeprefix("guided_"), value, name, False)


def _one_of(kind: str, value: Any, param: str, disable_any_whitespace: bool
            ) -> StructuredOutputs:
    """A regex, choice or grammar spec, its value's type checked."""
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise StructuredRequestError(f"{param} must be a non-empty list of non-empty "
                                         "strings", param)
        return StructuredOutputs(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise StructuredRequestError(f"{param} must be a non-empty string", param)
    if kind == "regex":
        return StructuredOutputs(regex=value)
    return StructuredOutputs(grammar=value, disable_any_whitespace=disable_any_whitespace)


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or JSON text of one) as canonical JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise StructuredRequestError(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise StructuredRequestError(f"{param} must be a JSON schema object", param)
    return json.dumps(schema, separators=(",", ":"))  # key order kept: it orders the output
