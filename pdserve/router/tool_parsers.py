"""Model text -> tool calls: one parser per model family's tool-call format, for
`tool_choice: "auto"` (vLLM's `--tool-call-parser NAME`), plus the scanner they share.

Every parser is one pure function of the text so far, `parse(text, is_final, memo)`, that returns
the content to show and the calls it can already name. It is written so that, as the text
grows, the content only grows at its end and each call's arguments only grow at their end:
the streamer (pdserve/router/tools.py) sends the differences as deltas, and the non-streamed body is
the same function at `is_final=True`, so a stream and a body of one text agree. While the
text is unfinished a parser holds back what may still become a call (a tail that could be the
start of a marker, a call whose name is not complete); a call is named once its name is
complete and its arguments have begun. Text that turns out not to be a well-formed call stays
content (at the end, the whole text is content, as vLLM does); a call streamed before its
text went wrong cannot be taken back.

    hermes       Qwen2/2.5, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json  Llama 3.x: [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                 or (tokenizer v11+) [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
    deepseek_v3  DeepSeek-V3/R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
                 <｜tool▁sep｜>name ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>;
                 V3.1's
                 <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>

The scanner reads JSON prefixes without parsing them: it finds where a value ends (or that it
has not ended yet), and the members of an object, so arguments stream as the raw text the
model wrote (raw control characters in strings escaped). A complete value is then checked with
`json.loads`. A stream passes a ScanMemo, so that each parse resumes the scans the last one
left open: a long call costs the router O(length), not O(length^2) (a 9k-character call in
4-character deltas: 0.3 s of CPU instead of 9 s on the loaded 2-core box).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""What OpenAI accepts as a function name."""
ARGUMENT_KEYS = ("arguments", "parameters")
"""Where a call object keeps its arguments (Llama 3 writes `parameters`, others `arguments`)."""
_WHITESPACE = " \t\n\r"
_CONTROL = re.compile(r"[\x00-\x1f]")


class MalformedJson(ValueError):
    """The text cannot be (the start of) what the format wants there."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments' JSON text as the model wrote it (so far, while not is_complete)."""
    is_complete: bool = True


@dataclass(frozen=True)
class ParsedText:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


# ---- the JSON prefix scanner ------------------------------------------------------------
def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


class ScanMemo:
    """Where the scans of one growing text stopped. A stream parses its whole text again at
    every delta; with a memo, a value still open at the last parse resumes where that scan
    stopped, so a long call costs O(length) in all, not O(length^2). Valid only while the
    text grows at its end (a stream's text does); a one-off parse needs none."""

    def __init__(self) -> None:
        self.open_values: dict[int, tuple[int, list[str], bool, bool]] = {}
        """start -> (scanned up to, bracket stack, in a string, after a backslash)."""
        self.ends: dict[int, int] = {}
        """start -> end of a value found complete."""
        self.escapes: dict[int, tuple[int, str, bool, bool]] = {}
        """start -> escape_controls' progress: (raw chars done, output, in string, escaped)."""
        self.objects: set[tuple[int, int]] = set()
        """(start, end) of complete argument spans checked to be JSON objects."""


def value_end(text: str, pos: int, memo: ScanMemo | None = None) -> int | None:
    """Index just past the JSON value that starts at text[pos], or None while the text ends
    inside it. Raises MalformedJson when no JSON value starts there. Containers are matched
    by brackets only (strings skipped); a complete value still goes through json.loads."""
    if memo is not None and pos in memo.ends:
        return memo.ends[pos]
    n, first = len(text), text[pos]
    if first in '"{[':
        if memo is not None and pos in memo.open_values:
            i, stack, in_string, escaped = memo.open_values[pos]
            stack = list(stack)
        else:
            i, stack, in_string, escaped = pos + 1, [] if first == '"' else [first], \
                first == '"', False
        while i < n:
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if not stack:
                        break  # the end of a string value
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                stack.append(ch)
            elif ch in "}]":
                if "{[".index(stack.pop()) != "}]".index(ch):
                    raise MalformedJson(f"unbalanced {ch!r} at {i}")
                if not stack:
                    break
            i += 1
        else:
            if memo is not None:
                memo.open_values[pos] = (n, stack, in_string, escaped)
            return None
        if memo is not None:
            memo.ends[pos] = i + 1
        return i + 1
    if first in "-0123456789":
        i = pos + 1
        while i < n and text[i] in "+-0123456789.eE":
            i += 1
        return None if i == n else i  # a number at the end may still go on
    for literal in ("true", "false", "null"):
        if text.startswith(literal, pos):
            return pos + len(literal)
        if literal.startswith(text[pos:]):
            return None
    raise MalformedJson(f"no JSON value at {pos}: {text[pos:pos + 20]!r}")


@dataclass(frozen=True)
class ObjectScan:
    """A JSON object read so far: each member's value span, the last one possibly open."""

    members: dict[str, tuple[int, int | None]]
    """key -> (start, end) of its value in the text; end None while the value is open."""
    end: int | None
    """Index past the closing brace; None while the object is open."""


def scan_object(text: str, pos: int, memo: ScanMemo | None = None) -> ObjectScan:
    """The object that starts at text[pos] == '{' (MalformedJson if it cannot be one)."""
    members: dict[str, tuple[int, int | None]] = {}
    n = len(text)

    def still_open() -> ObjectScan:
        return ObjectScan(members, None)

    i = skip_whitespace(text, pos + 1)
    if i == n:
        return still_open()
    if text[i] == "}":
        return ObjectScan(members, i + 1)
    while True:
        if text[i] != '"':
            raise MalformedJson(f"expected a key at {i}")
        key_end = value_end(text, i, memo)
        if key_end is None:
            return still_open()
        key = _loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i == n:
            return still_open()
        if text[i] != ":":
            raise MalformedJson(f"expected ':' at {i}")
        i = skip_whitespace(text, i + 1)
        if i == n:
            return still_open()
        end = value_end(text, i, memo)
        members[key] = (i, end)
        if end is None:
            return still_open()
        i = skip_whitespace(text, end)
        if i == n:
            return still_open()
        if text[i] == "}":
            return ObjectScan(members, i + 1)
        if text[i] != ",":
            raise MalformedJson(f"expected ',' or '}}' at {i}")
        i = skip_whitespace(text, i + 1)
        if i == n:
            return still_open()


def _loads(span: str) -> object:
    try:  # strict=False: raw control characters inside strings (escape_controls fixes them)
        return json.loads(span, strict=False)
    except ValueError as exc:
        raise MalformedJson(str(exc)) from None


def escape_controls(json_text: str, memo: ScanMemo | None = None, key: int = 0) -> str:
    """`json_text` with raw control characters inside its strings escaped (a model, and
    grammars such as xgrammar's JSON strings, may write a raw tab there, which strict JSON
    parsers such as the client's json.loads refuse). Character by character, so the result
    for a prefix is a prefix of the result for the whole: it streams. With a memo, a text
    that grew since the last call (under the same key) is escaped from where it stopped."""
    saved = memo.escapes.get(key) if memo is not None else None
    if saved is None and not _CONTROL.search(json_text):
        return json_text
    done, out, in_string, escaped = saved or (0, "", False, False)
    parts = [out]
    for ch in json_text[done:]:
        if in_string and not escaped and ch < " ":
            parts.append(json.dumps(ch)[1:-1])
            continue
        parts.append(ch)
        if escaped:
            escaped = False
        elif in_string and ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
    result = "".join(parts)
    if memo is not None:
        memo.escapes[key] = (len(json_text), result, in_string, escaped)
    return result


def arguments_span(text: str, start: int, end: int | None, memo: ScanMemo | None = None
                   ) -> str:
    """Arguments text (so far): it must be (the start of) a JSON object."""
    if text[start] != "{":
        raise MalformedJson("the arguments are not a JSON object")
    if end is not None and (memo is None or (start, end) not in memo.objects):
        if not isinstance(_loads(text[start:end]), dict):
            raise MalformedJson("the arguments are not a JSON object")
        if memo is not None:
            memo.objects.add((start, end))
    return escape_controls(text[start:end], memo, start)


def call_from_object(text: str, scan: ObjectScan, name_key: str = "name",
                     argument_keys: tuple[str, ...] = ARGUMENT_KEYS,
                     memo: ScanMemo | None = None) -> ParsedCall | None:
    """The call an object (so far) names: None until its name is complete and its arguments
    have begun (or it closed without arguments: `{}`)."""
    if name_key not in scan.members or scan.members[name_key][1] is None:
        return None
    start, end = scan.members[name_key]
    name = _loads(text[start:end])
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise MalformedJson(f"not a function name: {name!r}")
    key = next((k for k in argument_keys if k in scan.members), None)
    if key is None:
        return None if scan.end is None else ParsedCall(name, "{}")
    start, end = scan.members[key]
    arguments = arguments_span(text, start, end, memo)
    return ParsedCall(name, arguments, is_complete=end is not None)


def scan_call_array(text: str, pos: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS,
                    memo: ScanMemo | None = None) -> tuple[list[ParsedCall], int | None]:
    """`[{"name": ..., "arguments": ...}, ...]` from text[pos] == '[': the calls named so
    far and the index past ']' (None while open)."""
    calls: list[ParsedCall] = []
    n = len(text)
    i = skip_whitespace(text, pos + 1)
    if i < n and text[i] == "]":
        return calls, i + 1
    while i < n:
        if text[i] != "{":
            raise MalformedJson(f"expected a call object at {i}")
        scan = scan_object(text, i, memo)
        call = call_from_object(text, scan, argument_keys=argument_keys, memo=memo)
        if call is not None:
            calls.append(call)
        if scan.end is None:
            return calls, None
        i = skip_whitespace(text, scan.end)
        if i == n:
            break
        if text[i] == "]":
            return calls, i + 1
        if text[i] != ",":
            raise MalformedJson(f"expected ',' or ']' at {i}")
        i = skip_whitespace(text, i + 1)
    return calls, None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _unfinished(calls: list[ParsedCall]) -> bool:
    return bool(calls) and not calls[-1].is_complete


def _as_content(text: str) -> ParsedText:
    return ParsedText(text)


# ---- the parsers --------------------------------------------------------------------------
def parse_hermes(text: str, is_final: bool, memo: ScanMemo | None = None) -> ParsedText:
    start_tag, end_tag = "<tool_call>", "</tool_call>"
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos, n = 0, len(text)

    def add_content(segment: str) -> None:
        # Between and after calls, whitespace-only text (the newlines around the tags) is
        # layout, not content.
        if pos == 0 or segment.strip():
            content.append(segment)

    try:
        while True:
            start = text.find(start_tag, pos)
            if start == -1:
                tail = text[pos:]
                add_content(tail if is_final else tail[:len(tail) - held_back(tail, start_tag)])
                break
            add_content(text[pos:start])
            i = skip_whitespace(text, start + len(start_tag))
            if i == n:
                if is_final:
                    raise MalformedJson("an empty tool call")
                break
            if text[i] != "{":
                raise MalformedJson("a tool call that is not a JSON object")
            scan = scan_object(text, i, memo)
            call = call_from_object(text, scan, memo=memo)
            if call is not None:
                calls.append(call)
            if scan.end is None:
                if is_final:
                    raise MalformedJson("an unfinished tool call")
                break
            i = skip_whitespace(text, scan.end)
            if text.startswith(end_tag, i):
                pos = i + len(end_tag)
            elif end_tag.startswith(text[i:]) and not is_final:
                break  # the end tag is still being written
            elif i == n and is_final:
                pos = n  # the model stopped right after the call: accept it
            else:
                raise MalformedJson(f"expected {end_tag} at {i}")
    except MalformedJson:
        if is_final:
            return _as_content(text)
        # hold everything from the bad call on until the end decides
    return ParsedText("".join(content), calls)


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, is_final: bool, memo: ScanMemo | None = None) -> ParsedText:
    """Llama 3.x's JSON tool calls: the whole output is calls (an optional <|python_tag|>, then
    one or more objects separated by ';'), or it is all content."""
    begin = skip_whitespace(text, 0)
    stripped = text[begin:]
    if not is_final and (not stripped or PYTHON_TAG.startswith(stripped)):
        return ParsedText("")
    if not (stripped.startswith(PYTHON_TAG) or stripped.startswith("{")):
        return _as_content(text)
    calls: list[ParsedCall] = []
    n = len(text)
    i = skip_whitespace(text, begin + len(PYTHON_TAG) if stripped.startswith(PYTHON_TAG)
                        else begin)
    try:
        while i < n:
            if text[i] != "{":
                raise MalformedJson(f"expected a call object at {i}")
            scan = scan_object(text, i, memo)
            call = call_from_object(text, scan, memo=memo)
            if call is not None:
                calls.append(call)
            if scan.end is None:
                if is_final:
                    raise MalformedJson("an unfinished tool call")
                break
            if call is None:
                raise MalformedJson("an object that names no function")
            i = skip_whitespace(text, scan.end)
            if i < n:
                if text[i] != ";":
                    raise MalformedJson(f"expected ';' at {i}")
                i = skip_whitespace(text, i + 1)
        if is_final and not calls:
            raise MalformedJson("no tool call")
    except MalformedJson:
        if is_final:
            return _as_content(text)
    return ParsedText("", calls)


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral(text: str, is_final: bool, memo: ScanMemo | None = None) -> ParsedText:
    start = text.find(MISTRAL_CALLS)
    if start == -1:
        keep = len(text) if is_final else len(text) - held_back(text, MISTRAL_CALLS)
        return ParsedText(text[:keep])
    content, calls = text[:start], []
    i = skip_whitespace(text, start + len(MISTRAL_CALLS))
    try:
        if i < len(text) and text[i] == "[":
            calls, end = scan_call_array(text, i, memo=memo)
            if is_final and (end is None or not calls or text[end:].strip()):
                raise MalformedJson("an unfinished or trailing tool-call list")
        else:
            calls = _mistral_v11_calls(text, start, is_final, memo)
        if is_final and (not calls or _unfinished(calls)):
            raise MalformedJson("no complete tool call")
    except MalformedJson:
        if is_final:
            return _as_content(text)
    return ParsedText(content, calls)


def _mistral_v11_calls(text: str, start: int, is_final: bool, memo: ScanMemo | None
                       ) -> list[ParsedCall]:
    """[TOOL_CALLS]name[ARGS]{...} repeated (Mistral tokenizers v11 and later)."""
    calls: list[ParsedCall] = []
    pos, n = start, len(text)
    while pos < n:
        if not text.startswith(MISTRAL_CALLS, pos):
            if is_final or not MISTRAL_CALLS.startswith(text[pos:]):
                raise MalformedJson(f"expected {MISTRAL_CALLS} at {pos}")
            break
        name_start = pos + len(MISTRAL_CALLS)
        args_tag = text.find(MISTRAL_ARGS, name_start)
        if args_tag == -1:
            if is_final:
                raise MalformedJson("a call without [ARGS]")
            break
        name = text[name_start:args_tag].strip()
        if not FUNCTION_NAME.match(name):
            raise MalformedJson(f"not a function name: {name!r}")
        i = skip_whitespace(text, args_tag + len(MISTRAL_ARGS))
        if i == n:
            break
        end = value_end(text, i, memo)
        calls.append(ParsedCall(name, arguments_span(text, i, end, memo),
                                is_complete=end is not None))
        if end is None:
            break
        pos = skip_whitespace(text, end)
    return calls


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DS_FENCE_OPEN, DS_FENCE_CLOSE = "```json", "```"


def parse_deepseek_v3(text: str, is_final: bool, memo: ScanMemo | None = None) -> ParsedText:
    """DeepSeek-V3's calls after <｜tool▁calls▁begin｜>, in either of its two forms: V3 and R1
    write `function<｜tool▁sep｜>NAME` then the arguments fenced as ```json, V3.1 writes
    `NAME<｜tool▁sep｜>` then the bare arguments object; which one is told by what follows
    the separator (an object: V3.1)."""
    start = text.find(DS_CALLS_BEGIN)
    if start == -1:
        keep = len(text) if is_final else len(text) - held_back(text, DS_CALLS_BEGIN)
        return ParsedText(text[:keep])
    content, calls = text[:start], []
    pos, n = skip_whitespace(text, start + len(DS_CALLS_BEGIN)), len(text)
    try:
        while pos < n:
            if text.startswith(DS_CALLS_END, pos):
                pos = skip_whitespace(text, pos + len(DS_CALLS_END))
                if pos < n:
                    raise MalformedJson(f"text after {DS_CALLS_END}")
                break
            if not text.startswith(DS_CALL_BEGIN, pos):
                if is_final or not (DS_CALL_BEGIN.startswith(text[pos:])
                                    or DS_CALLS_END.startswith(text[pos:])):
                    raise MalformedJson(f"expected {DS_CALL_BEGIN} at {pos}")
                break
            call, pos = _deepseek_call(text, pos + len(DS_CALL_BEGIN), is_final, memo)
            if call is not None:
                calls.append(call)
            if pos is None:
                break
            pos = skip_whitespace(text, pos)
        if is_final and (not calls or _unfinished(calls)):
            raise MalformedJson("no complete tool call")
    except MalformedJson:
        if is_final:
            return _as_content(text)
    return ParsedText(content, calls)


def _deepseek_call(text: str, pos: int, is_final: bool, memo: ScanMemo | None
                   ) -> tuple[ParsedCall | None, int | None]:
    """One call from just past <｜tool▁call▁begin｜>: the call (None until named) and the
    index past its <｜tool▁call▁end｜> (None while unfinished)."""
    sep = text.find(DS_SEP, pos)
    if sep == -1:
        if is_final:
            raise MalformedJson(f"a call without {DS_SEP}")
        return None, None
    head, i, n = text[pos:sep].strip(), skip_whitespace(text, sep + len(DS_SEP)), len(text)
    if i == n:
        return None, None
    fenced = text[i] != "{"
    if fenced:  # V3: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
        if head != "function":
            raise MalformedJson(f"a call of type {head!r}")
        line_end = text.find("\n", i)
        if line_end == -1:
            return None, None
        name = text[i:line_end].strip()
        i = skip_whitespace(text, line_end)
        if not text.startswith(DS_FENCE_OPEN, i):
            if is_final or not DS_FENCE_OPEN.startswith(text[i:]):
                raise MalformedJson(f"expected {DS_FENCE_OPEN} at {i}")
            return None, None
        i = skip_whitespace(text, i + len(DS_FENCE_OPEN))
        if i == n:
            return None, None
    else:  # V3.1: NAME<｜tool▁sep｜>{...}
        name = head
    if not FUNCTION_NAME.match(name):
        raise MalformedJson(f"not a function name: {name!r}")
    end = value_end(text, i, memo)
    call = ParsedCall(name, arguments_span(text, i, end, memo), is_complete=end is not None)
    if end is None:
        return call, None
    i = skip_whitespace(text, end)
    if fenced:
        if not text.startswith(DS_FENCE_CLOSE, i):
            if is_final or not DS_FENCE_CLOSE.startswith(text[i:]):
                raise MalformedJson(f"expected {DS_FENCE_CLOSE} at {i}")
            return call, None
        i = skip_whitespace(text, i + len(DS_FENCE_CLOSE))
    if text.startswith(DS_CALL_END, i):
        return call, i + len(DS_CALL_END)
    if is_final or not DS_CALL_END.startswith(text[i:]):
        raise MalformedJson(f"expected {DS_CALL_END} at {i}")
    return call, None


Parser = Callable[[str, bool, ScanMemo | None], ParsedText]
"""parse(text so far, is_final, memo): see the module docstring."""
TOOL_CALL_PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "deepseek_v3": parse_deepseek_v3,
}
"""`--tool-call-parser NAME` -> parser, as vLLM names them."""
KEEPS_SPECIAL_TOKENS = frozenset({"llama3_json", "mistral", "deepseek_v3"})
"""Parsers whose markers are special tokens (<|python_tag|>, [TOOL_CALLS]): the detokenizer
must keep special tokens in the text, or the parser never sees them."""
