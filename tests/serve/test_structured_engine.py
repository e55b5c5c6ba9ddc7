"""pdserve/serve/engine/structured.py inside the engine: grammars compiled and cached, masks applied
to every
sampled row, the grammar's end ending the request (ignore_eos and min_tokens included), state
rebuilt by replaying outputs (a hand-off, a fork), logprobs of the masked distribution.

Random-weight models never choose to close a free string or stop an unbounded array, so the
schemas here bound every string (maxLength), array (maxItems) and number (minimum/maximum).
Between JSON tokens xgrammar (like vLLM) allows any run of whitespace unless
disable_any_whitespace is set, and this tokenizer (trained on Python sources) has many
whitespace tokens, so a random model spends hundreds of tokens there: most requests ask for
compact JSON, and the few that allow whitespace get a small schema and a large max_tokens.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from helpers.engine_util import prefill_engine, run_to_completion

from pdserve.protocol.sampling import SamplingParams, StructuredOutputs
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.request import RequestStatus
from pdserve.serve.engine.roles import DecodeRole
from pdserve.serve.engine.structured import StructuredOutputManager
from pdserve.structured_grammar import StructuredOutputsError, build_grammar, choice_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "address": {"type": "object",
                    "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
SMALL = {"type": "object", "properties": {"role": {"enum": ["admin", "user"]}},
         "required": ["role"], "additionalProperties": False}
MAX_TOKENS = 400
MAX_TOKENS_WITH_WHITESPACE = 1500


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def engine(llama_dir, tokenizer):
    engine = Engine(ModelConfig(model=str(llama_dir)), CacheConfig(num_blocks=512),
                    tokenizer=tokenizer)
    yield engine
    engine.shutdown()


def _run(engine: Engine, requests) -> dict[str, tuple[str, str, list[int]]]:
    """request id -> (text, finish_reason, token ids) of every request run to the end."""
    outputs = run_to_completion(engine)
    result = {}
    for request_id, deltas in outputs.items():
        text = "".join(d.outputs[0].text for d in deltas)
        tokens = [t for d in deltas for t in d.outputs[0].token_ids]
        result[request_id] = (text, deltas[-1].outputs[0].finish_reason, tokens)
    assert set(result) == {r.request_id for r in requests}
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()
    return result


def test_json_schema_outputs_validate_greedy_and_sampled(engine) -> None:
    compact = StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
    requests = [engine.add_request(f"person number {i}:", SamplingParams(
        temperature=0.0 if i == 0 else 0.7 + 0.1 * (i % 4), seed=i, max_tokens=MAX_TOKENS,
        structured_outputs=compact)) for i in range(10)]
    spaced = StructuredOutputs(json=json.dumps(SMALL))
    requests += [engine.add_request(f"role {i}:", SamplingParams(
        temperature=0.8, seed=i, max_tokens=MAX_TOKENS_WITH_WHITESPACE,
        structured_outputs=spaced)) for i in range(2)]
    schemas = [PERSON] * 10 + [SMALL] * 2
    results = _run(engine, requests)
    for request, schema in zip(requests, schemas, strict=True):
        text, finish_reason, tokens = results[request.request_id]
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert tokens[-1] in engine.spec.eos_token_ids  # the grammar ended with eos
    assert engine.structured is not None and engine.structured.num_compiled >= 1


def test_compact_json_regex_choice_grammar_and_json_object(engine) -> None:
    cases = {
        "compact": (StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True),
                    _compact_person),
        "regex": (StructuredOutputs(regex=r"[a-c]{2,5}-\d{3}"),
                  lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t) or _fail(t)),
        "choice": (StructuredOutputs(choice=("red", "green", 'say "blue"\n')),
                   lambda t: t in ("red", "green", 'say "blue"\n') or _fail(t)),
        "grammar": (StructuredOutputs(grammar='root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'),
                    lambda t: re.fullmatch(r"\(\d(\+\d){0,3}\)", t) or _fail(t)),
        "json_object": (StructuredOutputs(json_object=True, disable_any_whitespace=True),
                        lambda t: isinstance(json.loads(t), dict) or _fail(t)),
    }
    requests = {}
    for name, (spec, _) in cases.items():
        for seed in range(4):
            request = engine.add_request(f"{name} {seed}", SamplingParams(
                temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=spec),
                request_id=f"{name}-{seed}")
            requests[request.request_id] = request
    results = _run(engine, list(requests.values()))
    for request_id, (text, finish_reason, _) in results.items():
        name = request_id.rsplit("-", 1)[0]
        if name == "json_object" and finish_reason == "length":
            continue  # {"type": "object"} has unbounded strings: a random model may not close
        assert finish_reason == "stop", (request_id, text)
        cases[name][1](text)


def _compact_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    # no whitespace outside strings: the text re-serialises compactly to itself
    return text == json.dumps(json.loads(text), separators=(",", ":"),
                              ensure_ascii=False) or _fail(text)


def _fail(text: str) -> bool:
    raise AssertionError(f"output does not match: {text!r}")


def test_plain_requests_build_nothing(llama_dir, tokenizer) -> None:
    engine = Engine(ModelConfig(model=str(llama_dir)), CacheConfig(num_blocks=64),
                    tokenizer=tokenizer)
    try:
        request = engine.add_request("hello", SamplingParams(max_tokens=4))
        _run(engine, [request])
        assert engine.structured is None and request.grammar is None
    finally:
        engine.shutdown()


def test_no_tokenizer_is_a_clear_error(llama_dir) -> None:
    engine = Engine(ModelConfig(model=str(llama_dir)), CacheConfig(num_blocks=16))
    try:
        with pytest.raises(StructuredOutputsError, match="tokenizer"):
            engine.make_request([5, 6, 7], SamplingParams(
                structured_outputs=StructuredOutputs(regex="a+")))
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_ignore_eos_and_min_tokens_do_not_break_a_complete_grammar(engine) -> None:
    choices = ("alpha", "beta")
    spec = StructuredOutputs(choice=choices)
    ignoring = engine.add_request("pick", SamplingParams(
        temperature=0.9, seed=1, max_tokens=50, ignore_eos=True, structured_outputs=spec))
    holding = engine.add_request("pick", SamplingParams(
        temperature=0.9, seed=2, max_tokens=50, min_tokens=40, structured_outputs=spec))
    # min_tokens holds the end back while the grammar allows more: "x" repeated
    repeat = engine.add_request("xs", SamplingParams(
        temperature=0.9, seed=3, max_tokens=50, min_tokens=8,
        structured_outputs=StructuredOutputs(regex="x+")))
    results = _run(engine, [ignoring, holding, repeat])
    for request in (ignoring, holding):
        text, finish_reason, _ = results[request.request_id]
        assert finish_reason == "stop" and text in choices, text
        assert request.num_output_tokens < 40
    text, finish_reason, tokens = results[repeat.request_id]
    assert finish_reason == "stop" and re.fullmatch("x+", text), text
    assert len(tokens) > 8  # 8 x-tokens at least, then the end


def test_grammar_end_tokens_include_stop_token_ids(engine, tokenizer) -> None:
    stop_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    request = engine.make_request("pick", SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=(stop_id,),
        structured_outputs=StructuredOutputs(choice=("one", "two"))))
    assert request.grammar is not None
    assert set(request.grammar.end_token_ids) == {*engine.spec.eos_token_ids, stop_id}


def test_logprobs_are_of_the_masked_distribution(engine) -> None:
    request = engine.add_request("yes or no", SamplingParams(
        temperature=0, max_tokens=10, logprobs=20,
        structured_outputs=StructuredOutputs(choice=("yes", "no"))))
    _run(engine, [request])
    first = request.output_logprobs[0]
    finite = [lp.logprob for lp in first.values() if lp.logprob != float("-inf")]
    # every token the grammar allows first is among the top 20; their mass is all of it
    assert 0 < len(finite) < len(first)
    assert math.isclose(sum(math.exp(lp) for lp in finite), 1.0, rel_tol=1e-4)
    assert first[request.output_token_ids[0]].rank == 1  # greedy: the best allowed token


def test_padded_vocab_never_samples_past_the_tokenizer(make_model_dir) -> None:
    """The model's logits are wider than the tokenizer (padded embeddings): the mask covers
    the whole width, so the extra ids are never sampled."""
    from transformers import AutoTokenizer

    model_dir = make_model_dir("llama", seed=3, vocab_size=1088)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = Engine(ModelConfig(model=str(model_dir)), CacheConfig(num_blocks=256),
                    tokenizer=tokenizer)
    try:
        assert engine.spec.vocab_size > len(tokenizer)
        spec = StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
        requests = [engine.add_request(f"p{i}", SamplingParams(
            temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=spec))
            for i in range(4)]
        for text, finish_reason, tokens in _run(engine, requests).values():
            assert finish_reason == "stop"
            jsonschema.validate(json.loads(text), PERSON)
            assert max(tokens) < len(tokenizer)
    finally:
        engine.shutdown()


def test_handoff_replays_the_first_token_and_matches_colocated(llama_dir, tokenizer) -> None:
    """Prefill samples the first token under the mask; the decode engine rebuilds the matcher
    from it and continues exactly as a colocated engine would (greedy and seeded)."""
    model_config = ModelConfig(model=str(llama_dir))
    cache_config = CacheConfig(num_blocks=128)
    colocated = Engine(model_config, cache_config, tokenizer=tokenizer)
    prefill, saver = prefill_engine(model_config, cache_config, tokenizer=tokenizer)
    decode = Engine(model_config, cache_config, tokenizer=tokenizer, role=DecodeRole())
    spec = StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
    prompt = list(range(3, 40))
    try:
        for i, params in enumerate((
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec),
                SamplingParams(temperature=0.9, seed=5, max_tokens=MAX_TOKENS,
                               structured_outputs=spec))):
            expected_request = colocated.add_request(prompt, params)
            expected = _run(colocated, [expected_request])[expected_request.request_id]
            prefill.add_request(prompt, params, request_id=f"r{i}")
            (first,) = prefill.step()
            assert first.outputs[0].finish_reason == "handoff"
            handoff = first.kv_handoff
            block_ids = decode.add_prefilled_request(f"r{i}", prompt, params,
                                                     [handoff.first_token_id])
            decode.runner.write_kv_blocks(block_ids, saver.blocks.pop(f"r{i}"))
            continued = decode.scheduler.requests[f"r{i}"]
            assert continued.grammar is not None and continued.grammar.num_accepted_tokens == 1
            text, finish_reason, tokens = _run(decode, [continued])[f"r{i}"]
            assert [handoff.first_token_id, *tokens] == expected[2]
            assert first.outputs[0].text + text == expected[0]
            assert finish_reason == "stop"
            jsonschema.validate(json.loads(expected[0]), PERSON)
    finally:
        for engine in (colocated, prefill, decode):
            engine.shutdown()


def test_a_fork_gets_its_own_state_by_replay(engine) -> None:
    """What n > 1 children do: each builds its grammar from its own spec and outputs; one
    child's tokens never move another's matcher."""
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="ab+c"))
    a_id, b_id, c_id = (engine.tokenizer.encode(s)[0] for s in "abc")
    parent = engine.make_request("p", params, output_token_ids=[a_id])
    child = engine.make_request("p", params, output_token_ids=[a_id, b_id])
    assert parent.grammar is not child.grammar
    assert (parent.grammar.num_accepted_tokens, child.grammar.num_accepted_tokens) == (1, 2)
    assert engine.structured is not None
    again = engine.structured.grammar_for(child)  # the documented way to get a fresh state
    assert again is not child.grammar and again.num_accepted_tokens == 2
    assert child.grammar.accept(c_id) and not parent.grammar.accept(c_id)
    assert child.grammar.accept(engine.spec.eos_token_ids[0]) and child.grammar.is_terminated
    with pytest.raises(StructuredOutputsError, match="does not follow"):
        engine.make_request("p", params, output_token_ids=[c_id])


def test_compile_cache_is_bounded_and_keyed_by_spec(tokenizer) -> None:
    manager = StructuredOutputManager(tokenizer, len(tokenizer), num_compiled_kept=2)
    specs = [StructuredOutputs(regex=f"a{{{n}}}") for n in range(1, 4)]
    first = manager.compile(specs[0])
    assert manager.compile(StructuredOutputs(regex="a{1}")) is first  # equal specs share
    manager.compile(specs[1])
    manager.compile(specs[2])  # evicts the least recently used (specs[0])
    assert manager.num_compiled == 2
    assert manager.compile(specs[0]) is not first
    manager.close()


def test_masks_only_for_structured_rows(engine) -> None:
    plain = engine.make_request("a", SamplingParams(max_tokens=4))
    shaped = engine.make_request("b", SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputs(regex="[0-9]+")))
    assert engine.structured is not None
    assert engine.structured.start_masks([plain]) is None
    masks = engine.structured.start_masks([plain, shaped])
    assert masks is not None and masks.rows == [1]
    import torch

    logits = torch.zeros(2, engine.spec.vocab_size)
    masks.apply(logits)
    assert torch.isfinite(logits[0]).all()  # the plain row is untouched
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed)


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json='{"type": "object", "properties": 5}'), "JSON schema"),
    (StructuredOutputs(json="{not json"), "JSON schema"),
    (StructuredOutputs(regex="(unclosed"), "regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar"),
])
def test_invalid_specs_name_the_problem(spec, message) -> None:
    with pytest.raises(StructuredOutputsError, match=f"invalid {message}"):
        build_grammar(spec)


def test_choice_grammar_escapes() -> None:
    build_grammar(StructuredOutputs(choice=('a "quoted"\nline', "back\\slash", "ünï")))
    assert choice_grammar(["x"]) == 'root ::= "x"'


def test_rejected_token_aborts(engine) -> None:
    request = engine.add_request("r", SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=StructuredOutputs(regex="[0-9]")))
    assert request.grammar is not None
    request.grammar.is_terminated = True  # a state that accepts nothing more
    # the mask is skipped for a terminated grammar, so the sampled token is rejected
    outputs = run_to_completion(engine)
    assert outputs[request.request_id][-1].outputs[0].finish_reason == "abort"
    assert request.status is RequestStatus.FINISHED_ABORTED


def test_bounded_json_strings_hold_no_control_characters() -> None:
    """xgrammar 0.2.9 lets raw control characters into a maxLength string (invalid JSON);
    pdserve's grammar does not."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}},
              "required": ["a"]}
    grammar = build_grammar(StructuredOutputs(json=json.dumps(schema)))
    assert _is_grammar_accept_string(grammar, '{"a": "abc"}')
    assert not _is_grammar_accept_string(grammar, '{"a": "a\x01c"}')


def test_the_utf8_guard_clears_the_bytes_of_a_surrogate() -> None:
    """ED then A0-BF is a UTF-16 surrogate's 3-byte form, which UTF-8 forbids: a token that
    holds it is never allowed, a token starting with A0-BF only never after one ending with
    ED (80-9F, U+D000-U+D7FF, stays); a row the guard would empty keeps the grammar's bits."""
    import numpy as np

    from pdserve.serve.engine.structured import Utf8Guard

    vocab = [b"a", b"\xed", b"\xa1x", b"\x85", b"x\xed\xa0y", b""]
    guard = Utf8Guard(vocab, 1)
    words = np.full(1, 0b111111, dtype=np.uint32)
    guard.apply(words, last_token_id=1)  # after a token ending with ED
    assert [t for t in range(6) if words[0] >> t & 1] == [0, 1, 3, 5]
    words[:] = 0b111111
    guard.apply(words, last_token_id=0)
    assert [t for t in range(6) if words[0] >> t & 1] == [0, 1, 2, 3, 5]
    words[:] = 0b110000  # only the forbidden token and the empty one
    guard.apply(words, last_token_id=None)
    assert words[0] == 0b100000
    words[:] = 0b010000  # the grammar allows nothing else: its choice stands
    guard.apply(words, last_token_id=None)
    assert words[0] == 0b010000


def test_a_json_string_never_continues_a_lead_byte_into_a_surrogate(engine, tokenizer) -> None:
    """Inside a JSON string after the byte ED, xgrammar allows A0-BF (a surrogate, three
    U+FFFD once decoded); the engine's mask does not, and still allows 80-9F."""
    import xgrammar as xgr

    decoded = xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab
    ids = {b: decoded.index(bytes([b])) for b in (0xED, 0xA1, 0x85)}  # a byte-level vocab
    quote = tokenizer.convert_tokens_to_ids('"')
    request = engine.make_request("a", SamplingParams(max_tokens=8, structured_outputs=(
        StructuredOutputs(json=json.dumps({"type": "string", "maxLength": 4})))),
        output_token_ids=[quote, ids[0xED]])
    masks = engine.structured.start_masks([request])
    import torch

    logits = torch.zeros(1, engine.spec.vocab_size)
    masks.apply(logits)
    assert logits[0, ids[0xA1]] == float("-inf")
    assert torch.isfinite(logits[0, ids[0x85]])
