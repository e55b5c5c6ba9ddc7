"""A StructuredOutputs spec (protocol/sampling.py) as an xgrammar Grammar, with no tokenizer.

One function serves both sides: the router calls `build_grammar` to validate a request's spec
(an invalid JSON schema, regex or EBNF grammar is the client's 400, found before any worker
sees it), and the worker's engine (pdserve/serve/engine/structured.py) compiles what it returns
against its tokenizer. The mapping of each kind follows vLLM 0.32's xgrammar backend: `json_object`
is the schema {"type": "object"}, `choice` an EBNF alternation of string literals, and
`disable_any_whitespace` compact JSON (no optional whitespace, "," and ":" separators). Where
whitespace is allowed, a run of it holds at most MAX_JSON_WHITESPACE characters: enough to
pretty-print a few levels deep, too few for a model to pad its answer until max_tokens (an
unbounded run let a random model spend 1,373 characters, mostly spaces, on one answer).
xgrammar is imported on first use, so neither side pays for it without structured outputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.protocol.sampling import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar as xgr


class StructuredOutputsError(ValueError):
    """A structured-outputs spec that cannot be served (it does not parse or compile, or the
    worker has no tokenizer); the message names the problem."""


def build_grammar(spec: StructuredOutputs) -> xgr.Grammar:
    """The spec as an xgrammar Grammar; raises StructuredOutputsError naming the problem."""
    import xgrammar as xgr

    try:
        if spec.json is not None:
            return _json_grammar(spec.json, spec)
        if spec.json_object:
            return _json_grammar('{"type": "object"}', spec)
        if spec.regex is not None:
            if "\x00" in spec.regex:  # xgrammar's regex parser does not take NUL
                raise ValueError("the regex contains a NUL character")
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice:
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        assert spec.grammar is not None
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, InvalidJSONError
        raise StructuredOutputsError(f"invalid {spec_kind(spec)}: {short_message(exc)}"
                                     ) from None


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (vLLM's `choice_as_grammar`): EBNF
    string literals take JSON's escapes, so each choice is written as a JSON string."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 writes a length-bounded JSON string's characters (maxLength, minLength) as
# [^"\\\r\n]: that lets raw control characters (U+0000-U+001F) into the string, which JSON
# forbids (strict parsers, pydantic's among them, reject the output). Its unbounded strings
# exclude them; pdserve narrows the bounded ones' class the same way.
_LAX_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def _json_grammar(schema: str, spec: StructuredOutputs) -> xgr.Grammar:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, **_json_options(spec))
    text = str(grammar)
    if _LAX_STRING_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHARS, _JSON_STRING_CHARS))


MAX_JSON_WHITESPACE = 16
"""The longest run of whitespace between two JSON tokens: a newline and 15 spaces."""


def _json_options(spec: StructuredOutputs) -> dict[str, Any]:
    # As vLLM: without separators xgrammar would still allow a space after ',' and ':'.
    if spec.disable_any_whitespace:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def spec_kind(spec: StructuredOutputs) -> str:
    """What the spec constrains to, in words for error messages."""
    if spec.json is not None:
        return "JSON schema"
    if spec.json_object:
        return "json_object"
    if spec.regex is not None:
        return "regex"
    return "choice" if spec.choice else "grammar"


def short_message(exc: BaseException, limit: int = 400) -> str:
    """An exception's message on one line, at most `limit` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
