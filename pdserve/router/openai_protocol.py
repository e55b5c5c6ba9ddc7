"""OpenAI-compatible request and response bodies, validated at the front door.

Request fields follow the OpenAI API, plus vLLM's extra sampling fields (`ignore_eos`, `top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
`cache_salt`, `allowed_token_ids`, `bad_words`, `prompt_logprobs`), so clients written for
vLLM work unchanged. Chat requests also take tools (pdserve/router/tools.py). Anything pdserve
cannot honour (the legacy functions, tools on /v1/completions, ...: UNSUPPORTED_FIELDS) is rejected
with a 400 naming the field rather than silently ignored; fields neither API knows are
ignored, as both do.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.protocol.sampling import MAX_LOGPROBS, MAX_NUM_SEQS_PER_REQUEST, SamplingParams
from pdserve.router.logit_controls import control_fields
from pdserve.router.structured_request import structured_outputs_of
from pdserve.router.tools import TOOL_FIELDS, ChatTool, MessageToolCall, ToolChoice

MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 128
INT64_LIMIT = 2**63
"""Integers the workers take go over the wire as msgpack int64: larger is a 400, not an
encoding error."""
TokenId = Annotated[int, Field(ge=0, lt=INT64_LIMIT)]

UNSUPPORTED_FIELDS = (
    # OpenAI: tool calling, logit bias, audio and predicted output
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "modalities", "audio", "prediction",
    # vLLM: beam search, prompt logprobs and other extras that change what is generated
    "use_beam_search", "logits_processors", "truncate_prompt_tokens",
)
"""Fields a client may send (OpenAI's or vLLM's API has them) that pdserve does not honour
yet: given with a value that asks for something (see `_is_in_use`), the request is a 400
naming the field."""


def _unencodable_string_path(body: Any) -> str | None:
    """Where `body` (parsed JSON) holds a string that is not valid Unicode text: JSON may
    escape an unpaired UTF-16 surrogate ("\\ud800"), which no tokenizer, msgpack or UTF-8
    encoder takes. Iterative: a deeply nested body must not exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            stack += [(path or "body", k) for k in value]  # keys are strings too
        elif isinstance(value, list):
            stack += [(f"{path}.{i}", v) for i, v in enumerate(value)]
    return None


def check_unicode(body: Any) -> Any:
    """`body` unchanged, or a ValueError naming where it holds a string that is not valid
    Unicode (a pydantic "before" validator of every request body)."""
    path = _unencodable_string_path(body)
    if path is not None:
        raise ValueError(f"{path}: the string is not valid Unicode (an unpaired surrogate)")
    return body


def _is_in_use(name: str, value: Any) -> bool:
    """Whether `value` of unsupported field `name` asks for anything: null, empty, false and
    the defaults that mean "as usual" ask for nothing."""
    if value is None or value is False or value == [] or value == {}:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    if name == "tool_choice":
        return value != "none"
    if name == "parallel_tool_calls":
        return False  # meaningful only with tools, which are refused
    return True


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are ignored, as OpenAI and vLLM do (clients send e.g. `user`).
    model_config = ConfigDict(extra="ignore")
    served_fields: ClassVar[frozenset[str]] = frozenset()
    """Names in UNSUPPORTED_FIELDS that this endpoint does serve (chat: the tool fields)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    # vLLM's extra sampling fields
    ignore_eos: bool = False
    top_k: Annotated[int, Field(lt=INT64_LIMIT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, lt=INT64_LIMIT)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    # Structured outputs, in OpenAI's and vLLM's dialects (pdserve/router/structured_request.py)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # Logit controls and prompt logprobs (pdserve/router/logit_controls.py,
    # pdserve/router/prompt_outputs.py)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Not supported yet (UNSUPPORTED_FIELDS): declared, so the OpenAPI document lists them and
    # a request that uses one is refused, not served as if it had not asked.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    use_beam_search: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return check_unicode(body)

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.served_fields:
            return value
        if _is_in_use(info.field_name, value):
            raise ValueError(f"{info.field_name} is not supported by pdserve yet")
        return value

    @field_validator("n")
    @classmethod
    def _num_choices(cls, n: int) -> int:
        if n > MAX_NUM_SEQS_PER_REQUEST:
            raise ValueError(f"n must be at most {MAX_NUM_SEQS_PER_REQUEST}")
        return n

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, top_k: int | None) -> int | None:
        if top_k is not None and top_k < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or positive")
        return top_k

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int | None) -> int | None:
        if seed is not None and not (-(2**63) <= seed < 2**64):
            raise ValueError("seed must fit in 64 bits")
        return seed

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            try:
                is_id = -INT64_LIMIT <= int(token) < INT64_LIMIT
            except ValueError:
                is_id = False
            if not is_id:
                raise ValueError(f"logit_bias keys must be token ids, got {token[:40]!r}")
            if value != value:  # NaN
                raise ValueError("logit_bias values must be numbers")
        return bias

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, words: list[str] | None) -> list[str] | None:
        if words is not None and any(not w.strip() for w in words):
            raise ValueError("bad_words must be non-blank strings")
        return words

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingFields:
        if self.stream and self.prompt_logprobs:  # as vLLM: 0 is allowed (and not sent)
            raise ValueError("prompt_logprobs are not available when stream=true")
        return self

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string when given")
        return salt

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The one sampling type, as sent to the workers (ValueError if inconsistent)."""
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, cache_salt=self.cache_salt,
            structured_outputs=structured_outputs_of(self), **self._sampling_fields())

    def _sampling_fields(self) -> dict[str, Any]:
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "min_p": self.min_p,
            "n": self.n,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop": tuple(self.stop or ()),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            **control_fields(self),
        }


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    """0 only with echo: the prompt alone comes back (pdserve/router/prompt_outputs.py)."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise ValueError("batched prompts are not supported: send one prompt")
                self.prompt = prompt[0]
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(t < 0 for t in self.prompt):
            raise ValueError("prompt token ids must be non-negative")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_NUM_SEQS_PER_REQUEST:
            raise ValueError(f"best_of must be in [n, {MAX_NUM_SEQS_PER_REQUEST}] (n={self.n})")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot be streamed (as OpenAI): stream=false")
        return self

    def _sampling_fields(self) -> dict[str, Any]:
        return {**super()._sampling_fields(), "best_of": self.best_of}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant's calls (pdserve/router/tools.py); its content may then be null."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    served_fields: ClassVar[frozenset[str]] = TOOL_FIELDS
    messages: list[ChatMessage]
    # tool calling (pdserve/router/tools.py)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
