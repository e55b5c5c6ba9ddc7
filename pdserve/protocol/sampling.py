"""How one request samples and when it stops, in vLLM's vocabulary: the one sampling type.

The router builds it from an OpenAI body, it crosses to the workers inside GenerateRequest
(protocol/worker.py) and the engine samples by it. The field names and meanings follow vLLM's
`SamplingParams` so client code ports unchanged. n > 1 (and best_of) make one request several
sequences that share the prompt's KV (pdserve/serve/engine/parallel_sampling.py); each sequence
samples with
`for_child(index)`. This module imports nothing but the standard library, so every side can
use it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_LOGPROBS = 20
MAX_NUM_SEQS_PER_REQUEST = 16
"""The most sequences one request may fork into (n, and best_of): each takes a batch seat."""


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output to a grammar, as vLLM's `StructuredOutputsParams`: exactly one of
    json, json_object, regex, choice, grammar is set. The router builds it from
    `response_format`, vLLM's `structured_outputs` / `guided_*` fields or a tool choice; the
    worker that samples compiles it (pdserve/serve/engine/structured.py) and masks every step's
    logits, so the text always matches. The grammar state is never sent: a worker that continues a
    request (a hand-off, a migration) rebuilds it by replaying the output tokens so far."""

    json: str | None = None
    """A JSON schema, serialised as JSON text."""
    json_object: bool = False
    """Any JSON object (`response_format: {"type": "json_object"}`)."""
    regex: str | None = None
    choice: tuple[str, ...] = ()
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's / GBNF dialect, root rule `root`)."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (no runs of spaces and newlines between tokens)."""

    def __post_init__(self) -> None:
        if not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [self.json is not None, self.json_object, self.regex is not None,
                 bool(self.choice), self.grammar is not None]
        if sum(kinds) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, "
                             "regex, choice, grammar")
        if any(not c for c in self.choice):
            raise ValueError("structured output choices must be non-empty strings")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Completions returned per prompt (choices 0..n-1), in [1, MAX_NUM_SEQS_PER_REQUEST]."""
    best_of: int | None = None
    """Sequences generated (>= n; None: n); the n with the highest cumulative logprob are
    returned (vLLM's V0 meaning). Not streamable when > n."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or vLLM's -1) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: output token i draws from a generator seeded by (seed, i), so the
    draw is reproducible and a decode worker can resume it knowing only i."""
    presence_penalty: float = 0.0
    """Subtract this from logits of tokens that appear in the output so far."""
    frequency_penalty: float = 0.0
    """Subtract this times the token's count in the output so far."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens in the prompt or output."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's max_model_len."""
    min_tokens: int = 0
    """Suppress eos and stop_token_ids until this many tokens are generated."""
    ignore_eos: bool = False
    """Keep generating past eos (stop only at max_tokens, stop strings or stop ids)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the output text is cut where the first one starts."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (finish_reason 'stop')."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) in the output text."""
    logprobs: int | None = None
    """Return this many top log-probabilities per output token, plus the sampled one's."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    cache_salt: str | None = None
    """Tenant salt folded into the block-key root: salted prefixes never match unsalted."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, EBNF); None: free."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit before sampling (OpenAI's logit_bias, clamped to
    [-100, 100] as vLLM does); None: no bias."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled (vLLM); None: all."""
    bad_words: tuple[str, ...] = ()
    """Words never generated (vLLM): the worker tokenizes each (with and without a leading
    space) and bans a word's last token whenever the output so far ends with its others."""
    prompt_logprobs: int | None = None
    """Return this many top log-probabilities per prompt token, plus the prompt token's own
    (vLLM); the request then computes its whole prompt (no prefix-cache hit), as vLLM."""

    def __post_init__(self) -> None:
        # vLLM accepts a bare string and lists; normalise to tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not 1 <= self.n <= MAX_NUM_SEQS_PER_REQUEST:
            raise ValueError(f"n must be in [1, {MAX_NUM_SEQS_PER_REQUEST}], got {self.n}")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_NUM_SEQS_PER_REQUEST:
            raise ValueError(f"best_of must be in [n, {MAX_NUM_SEQS_PER_REQUEST}] (n={self.n}), "
                             f"got {self.best_of}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 for all), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._check_logit_controls()

    def _check_logit_controls(self) -> None:
        if self.logit_bias is not None:
            if any(b != b for b in self.logit_bias.values()):  # NaN
                raise ValueError("logit_bias values must be numbers")
            object.__setattr__(self, "logit_bias", {
                int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty when given")
        if not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if any(not w for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        # An attribute, not a property: the sampler asks it of every row in every step.
        object.__setattr__(self, "has_logit_controls", bool(
            self.logit_bias or self.allowed_token_ids is not None or self.bad_words))

    @property
    def num_seqs(self) -> int:
        """Sequences the request generates: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    def for_child(self, index: int) -> SamplingParams:
        """The params of sequence `index` of a request with num_seqs > 1 (vLLM's rule,
        v1/engine/parallel_sampling.py): one sequence (n = 1, no best_of), and a seeded
        request's child `index` draws with seed + index, so child 0 samples exactly what the
        same request with n = 1 would, and every child is reproducible on its own."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, best_of=None, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
