"""A request inside the engine, and what the engine reports about it (vLLM's output shapes).

A request's tokens are its prompt followed by what it generated so far; the scheduler only
tracks how many of them are in the KV cache:

    all_token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
                      prompt (P)          output (k)
    num_computed_tokens <= len(all_token_ids); the gap is what the next steps compute. Under
    async scheduling one more token may be pending (sampled on the device, not yet here).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import KVHandoff

if TYPE_CHECKING:
    from pdserve.serve.engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was freed (recompute)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_HANDOFF = "finished_handoff"  # prefill role: first token sampled, KV handed off

    # Both look up the member's value, a str: hashing a member itself runs Enum.__hash__ in
    # Python, and the engine asks each running request several times a step.
    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM finish_reason string, None while unfinished."""
        return _FINISH_REASONS.get(self._value_)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED.value: "stop",
    RequestStatus.FINISHED_LENGTH.value: "length",
    RequestStatus.FINISHED_ABORTED.value: "abort",
    RequestStatus.FINISHED_HANDOFF.value: "handoff",
}


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    """1 for the most likely token."""
    decoded_token: str | None = None


# One entry per output token: token id -> its Logprob (top-n plus the sampled token).
TokenLogprobs = dict[int, Logprob]


@dataclass(eq=False)  # identity: requests are compared in queues, never by value
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    """Effective cap: the params' max_tokens bounded by max_model_len - prompt length."""
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    arrival_time_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    """Tokens sampled by a step still in flight and not yet appended (async scheduling,
    pdserve/serve/engine/overlap.py): the scheduler counts them as known, their ids are on the
    device."""
    num_cached_tokens: int | None = None
    """Prefix-cache hit of the first scheduling, in tokens (None until first scheduled)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if one did."""
    block_keys: list[bytes] = field(default_factory=list)
    """Chained keys of this request's full blocks, extended as tokens arrive (block manager)."""
    first_scheduled_s: float | None = None
    """time.monotonic() at the start of the first step that scheduled it (engine)."""
    first_sampled_s: float | None = None
    """time.monotonic() when this engine first sampled a token for it (a handed-over token
    does not count)."""
    index: int = 0
    """The choice this sequence is (CompletionOutput.index): a forked child's index."""
    parent_id: str | None = None
    """A child forked from a request of n > 1 sequences (pdserve/serve/engine/parallel_sampling.py):
    the request id its outputs go out under (its own id is '{index}_{parent_id}')."""
    num_seqs: int = 1
    """Sequences this request becomes: a parent forks into this many once its prompt is
    prefilled, and takes as many batch seats (max_num_seqs) from its admission on."""
    grammar: GrammarState | None = None
    """Its structured-outputs state (pdserve/serve/engine/structured.py), None without structured
    outputs."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """While the engine computes the prompt logprobs it asked for
    (pdserve/serve/engine/prompt_logprobs.py): one entry per prompt token, filled in as its chunks
    run; None otherwise (not asked, or already reported)."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """sampling_params.bad_words as token ids (pdserve/serve/engine/logit_controls.py), set by the
    engine."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: drafts of the tokens after the last one, verified in the next
    step (pdserve/serve/engine/spec_decode.py); empty without."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    """'stop' | 'length' | 'abort' | 'handoff', None while running."""
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's news from one engine step (a delta: new tokens and text only), or the
    whole completion when returned by LLM.generate."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_handoff: KVHandoff | None = None
    """Set by a prefill-role engine on the request's last output (the block keys are its full
    prompt blocks; the worker's hand-off component fills in what the save produced)."""
    first_scheduled_s: float | None = None
    """The request's Request.first_scheduled_s (the worker reports its phases from these)."""
    first_sampled_s: float | None = None
    """The request's Request.first_sampled_s."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """vLLM's prompt logprobs (first entry None), on the request's first output only."""
