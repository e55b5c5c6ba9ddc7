"""The JSON grammars of structured outputs (pdserve/structured_grammar.py) bound every run of
whitespace: a model cannot pad a JSON answer with spaces until max_tokens."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from pdserve.protocol.sampling import StructuredOutputs
from pdserve.structured_grammar import MAX_JSON_WHITESPACE, build_grammar

SCHEMA = json.dumps({"type": "object", "required": ["name", "tags"], "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}})


@pytest.mark.parametrize("spec", [StructuredOutputs(json=SCHEMA),
                                  StructuredOutputs(json_object=True)],
                         ids=["json", "json_object"])
def test_a_run_of_whitespace_is_bounded(spec):
    grammar = build_grammar(spec)
    pretty = json.dumps({"name": "a", "tags": ["b", "c"]}, indent=4)
    assert accepts(grammar, pretty)  # pretty-printing still fits
    longest = " " * MAX_JSON_WHITESPACE
    assert accepts(grammar, '{"name":' + longest + '"a", "tags": []}')
    assert not accepts(grammar, '{"name":' + longest + ' "a", "tags": []}')
    assert not accepts(grammar, '{"name": "a", "tags": []' + " " * 500 + "}")


def test_compact_json_allows_none():
    grammar = build_grammar(StructuredOutputs(json=SCHEMA, disable_any_whitespace=True))
    assert accepts(grammar, '{"name":"a","tags":["b"]}')
    assert not accepts(grammar, '{"name": "a","tags":["b"]}')
