"""Router <-> worker messages (ZeroMQ DEALER/ROUTER, msgpack; see protocol/codec.py).

    router --GenerateRequest--> prefill worker --Output(first token, KVHandoff)--> router
    router --GenerateRequest(handoff)--> decode worker --Output(deltas)...--> router
    router --AbortRequest--> any worker holding the request
    prefill worker --Output(staging)--> router --FollowPrefill--> decode worker   (same host:
                                        decode copies the prompt's KV layer by layer while
                                        the prefill forward stages it; the GenerateRequest
                                        with the hand-off then completes it)
    router --StatusRequest--> worker --WorkerStatus--> router     (heartbeat, load, step times)
    router --SetRole--> drained prefill/decode worker --WorkerStatus--> router   (role it has)

The prefill -> decode hand-off travels through the router inside these messages: it names the
prompt's KV blocks (by block key), the data node holding them (the prefill worker's own, or
the fleet store) and the sampling state, never the bytes. (Where the blocks lie in the prefill
worker's shared memory segment, it also says where: a decode worker on that host copies them
into its pool as the hand-off arrives.)
This module imports neither torch nor model code: the router and the workers both use it and
neither owns it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from pdserve.protocol.codec import Protocol
from pdserve.protocol.sampling import MAX_NUM_SEQS_PER_REQUEST, SamplingParams
from pdserve.protocol.store.data import ShmSegment, ShmSpan

WORKER_PROTOCOL = Protocol("worker")
_DATA_ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}")


@dataclass(frozen=True)
class KVHandoff:
    """What a decode worker needs to continue a request that a prefill worker started."""

    block_keys: list[bytes]
    """Keys of the prompt's full blocks, saved in the KV store by the prefill worker."""
    first_token_id: int
    """The token prefill sampled (already streamed to the client)."""
    num_output_tokens: int = 1
    """Output tokens generated so far: seeded sampling resumes its draw at this index."""
    prefill_worker_id: str = ""
    lease_id: int = 0
    """The store lease pinning the blocks until the decode worker loaded them (0: none);
    the decode worker releases it, and it expires if no decode worker ever does."""
    source_address: str = ""
    """The data node holding the blocks and the lease: the prefill worker's own hand-off
    node (tcp://host:port), read directly; "": the fleet store."""
    choice_first_tokens: dict[int, int] = field(default_factory=dict)
    """A request of n > 1 sequences (best_of included): choice index -> the first token
    prefill sampled for it, for every choice that continues on decode (those that ended at
    their first token are absent). Empty: one sequence, first_token_id, choice 0."""
    kv_cache_dtype: str = ""
    """The dtype of the handed-off KV blocks (the prefill worker's KV layout: e.g. bfloat16,
    or float8_e4m3fn with --kv-cache-dtype fp8). A decode worker whose cache holds another
    dtype refuses the hand-off with a clear error. "": not stated."""
    shm_segment: ShmSegment | None = None
    """The prefill worker's shared memory segment (pdserve/kvstore/shm_segment.py) when the blocks
    lie in it: a decode worker on that host copies them straight into its pool on arrival."""
    shm_spans: list[ShmSpan] = field(default_factory=list)
    """Where each of block_keys lies in shm_segment (empty: read them from source_address)."""

    def __post_init__(self) -> None:
        if self.shm_spans and (self.shm_segment is None
                               or len(self.shm_spans) != len(self.block_keys)):
            raise ValueError("shm_spans needs shm_segment and one span per block key")
        if self.source_address and not _DATA_ADDRESS.fullmatch(self.source_address):
            raise ValueError(f"source_address must be tcp://host:port, got "
                             f"{self.source_address[:80]!r}")
        if len(self.kv_cache_dtype) > 32:
            raise ValueError("kv_cache_dtype is a torch dtype name (at most 32 characters)")
        if any(not 0 <= i < MAX_NUM_SEQS_PER_REQUEST for i in self.choice_first_tokens):
            raise ValueError(f"choice indices must be in [0, {MAX_NUM_SEQS_PER_REQUEST})")


MAX_STAGED_BLOCKS = 1 << 20
BLOCK_KEY_BYTES = 16
"""A chained block key's length (pdserve/kvstore/block_key.py: blake2b-128)."""


@dataclass(frozen=True)
class KVStaging:
    """Where a prefill worker is staging a prompt's KV while its forward runs, for a decode
    worker to copy each layer into blocks it reserved as soon as it is staged, so the
    hand-off that follows finds the prompt in place: on the prefill worker's host out of its
    shared memory segment (the prompt's `num_blocks` blocks back to back from span.offset,
    whose allocation header counts the layers staged), elsewhere pulled from its hand-off
    node (`source_address`, GetLayersRequest for `staging_id`)."""

    segment: ShmSegment | None
    """None: the staging is not in a segment (none, or full); pull it."""
    span: ShmSpan | None
    num_blocks: int
    kv_cache_dtype: str = ""
    block_keys: list[bytes] = field(default_factory=list)
    """The staged blocks' keys (empty: not said): a decode worker that holds the leading ones
    already copies only the others; a pull names the blocks by them."""
    source_address: str = ""
    """The prefill worker's hand-off node, tcp://host:port ("": no pull)."""
    staging_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_blocks, bool) or not 0 < self.num_blocks <= MAX_STAGED_BLOCKS:
            raise ValueError(f"num_blocks must be in [1, {MAX_STAGED_BLOCKS}]")
        if len(self.kv_cache_dtype) > 32:
            raise ValueError("kv_cache_dtype is a torch dtype name (at most 32 characters)")
        if len(self.block_keys) > self.num_blocks or any(
                len(key) != BLOCK_KEY_BYTES for key in self.block_keys):
            raise ValueError(f"block_keys: at most num_blocks keys of {BLOCK_KEY_BYTES} bytes")
        if (self.segment is None) != (self.span is None):
            raise ValueError("a staging in a segment names both the segment and its span")
        if self.source_address and not _DATA_ADDRESS.fullmatch(self.source_address):
            raise ValueError(f"source_address must be tcp://host:port, got "
                             f"{self.source_address[:80]!r}")
        if isinstance(self.staging_id, bool) or not 0 <= self.staging_id < 1 << 63:
            raise ValueError("staging_id must be an integer in [0, 2**63)")
        if self.segment is None and not (self.source_address and self.staging_id):
            raise ValueError("a staging names its segment, or its node and staging id")


@WORKER_PROTOCOL.message("generate")
@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    """max_tokens is always set by the router (it knows the room left in the context)."""
    handoff: KVHandoff | None = None
    """None: start from the prompt. Set: decode role, continue after the prefill worker."""
    resume_output_ids: list[int] = field(default_factory=list)
    """Migration: the output tokens another worker already streamed before it died or hung.
    This worker computes the prompt's and their KV (the prompt's prefix from the store where
    it has it), streams only what follows, and seeded sampling resumes at their count."""
    resume_choices: dict[int, list[int]] = field(default_factory=dict)
    """Migration of a request of several sequences (n, best_of): choice index -> the output
    tokens another worker streamed for it, for every choice that had not ended. This worker
    computes the prompt once, forks into these choices, and each resumes after its own
    outputs (seeded draws at its own count)."""

    def __post_init__(self) -> None:
        if not self.request_id or not self.prompt_token_ids:
            raise ValueError("request_id and prompt_token_ids must not be empty")
        if self.sampling.max_tokens is None:
            raise ValueError("sampling.max_tokens must be set")
        if self.resume_output_ids and self.handoff is not None:
            raise ValueError("a request resumes from its outputs or from a hand-off, not both")
        if len(self.resume_output_ids) >= self.sampling.max_tokens:
            raise ValueError("nothing left to generate after the resumed outputs")
        if self.resume_output_ids and self.sampling.num_seqs > 1:
            raise ValueError("a request of several sequences (n or best_of > 1) resumes "
                             "by choice (resume_choices)")
        if self.resume_choices:
            if self.handoff is not None or self.resume_output_ids:
                raise ValueError("resume_choices is a migration's alone")
            if any(not 0 <= i < self.sampling.num_seqs or not outputs
                   or len(outputs) >= self.sampling.max_tokens
                   for i, outputs in self.resume_choices.items()):
                raise ValueError("resume_choices: choice indices of the request's sequences, "
                                 "each with outputs and room left to generate")
        if self.handoff is not None and any(i >= self.sampling.num_seqs
                                            for i in self.handoff.choice_first_tokens):
            raise ValueError("a hand-off names a choice index past the request's sequences")

    @property
    def choice_indices(self) -> list[int]:
        """The choices whose Outputs this request's worker streams (Output.index), each until
        its own finish_reason: all of them from the prompt; after a hand-off, those the
        prefill worker handed on."""
        if self.resume_choices:
            return sorted(self.resume_choices)
        if self.handoff is not None and self.handoff.choice_first_tokens:
            return sorted(self.handoff.choice_first_tokens)
        if self.handoff is not None:
            return [0]
        return list(range(self.sampling.num_seqs))


@WORKER_PROTOCOL.message("follow")
@dataclass(frozen=True)
class FollowPrefill:
    """Router -> the decode worker picked for a request whose prefill is running on this
    host: reserve blocks for its `num_prompt_tokens` and copy its KV out of `staging` as the
    layers land. The GenerateRequest with its hand-off follows (it joins the batch then),
    or an AbortRequest; a worker that gets neither drops the reservation after a while."""

    request_id: str
    num_prompt_tokens: int
    staging: KVStaging

    def __post_init__(self) -> None:
        if not self.request_id or isinstance(self.num_prompt_tokens, bool) or not (
                0 < self.num_prompt_tokens):
            raise ValueError("request_id must not be empty and num_prompt_tokens positive")


@WORKER_PROTOCOL.message("abort")
@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@WORKER_PROTOCOL.message("status_request")
@dataclass(frozen=True)
class StatusRequest:
    pass


@WORKER_PROTOCOL.message("set_role")
@dataclass(frozen=True)
class SetRole:
    """Flip a prefill or decode worker to the other role. The worker switches only when it
    is drained, and answers with its WorkerStatus either way."""

    role: str

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int = 0
    """token_id's rank among all tokens (1: the most likely); 0: not reported."""


WORKER_PHASES = ("queue", "prefill", "layer_save", "kv_save", "kv_load", "first_decode")
"""What a worker may report in Output.phase_seconds, each a duration on the worker's own clock
(no clock is compared across processes):

    queue         arrived at the worker -> first scheduled in a step (a prefill worker's
                  store prefix lookup and load included)
    prefill       first scheduled -> first token sampled (the prompt's forward steps), less
                  layer_save
    layer_save    prefill with a store: the time those steps spent in the per-layer KV save
                  hook (inside the forward)
    kv_save       first token sampled -> the hand-off Output sent (prefill with a store: the
                  wait for the KV save to complete)
    kv_load       decode: arrived -> joined the batch (the KV load from the store, or the wait
                  to be scheduled for a recompute)
    first_decode  decode: joined the batch -> its first token sampled
"""


@WORKER_PROTOCOL.message("output")
@dataclass(frozen=True)
class Output:
    """A delta of one request's output, streamed as the worker produces it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    """stop | length | abort | error; None while running. Prefill's hand-off says 'handoff'.
    Each choice of a request with n > 1 sequences ends with its own; an error ends all."""
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    handoff: KVHandoff | None = None
    error: str | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """On a request's first Output from a worker: how long it spent in each of that worker's
    phases (names from WORKER_PHASES); empty otherwise, and from peers that predate it."""
    index: int = 0
    """The choice this delta belongs to (n > 1, best_of); 0 for a one-sequence request."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """On the first Output of a request that asked for prompt_logprobs (from the worker that
    computed its prompt): one entry per prompt token, the first None (nothing precedes it)."""
    staging: KVStaging | None = None
    """A prefill worker's note, sent as its forward starts staging the prompt (no tokens, no
    finish): where a decode worker on this host can follow it (FollowPrefill)."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < MAX_NUM_SEQS_PER_REQUEST:
            raise ValueError(f"index must be in [0, {MAX_NUM_SEQS_PER_REQUEST})")
        for name, seconds in self.phase_seconds.items():
            if name not in WORKER_PHASES:
                raise ValueError(f"unknown phase {name!r}; expected one of {WORKER_PHASES}")
            if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                    or not 0 <= seconds < math.inf):
                raise ValueError(f"phase {name!r} must be a finite number of seconds >= 0, "
                                 f"got {seconds!r}")


@dataclass(frozen=True)
class StepSample:
    """One engine step's work and wall time, for fitting per-phase step-latency models.

    A chunk is a decode iff it is one token at or past the end of its prompt; every other
    chunk (a prompt chunk, a recomputed prompt with its outputs) is prefill."""

    seq: int
    """Per-engine step number, increasing from 1 (a reader dedups by it)."""
    num_prefill_tokens: int
    num_prefill_query_keys: int
    """Sum over prefill chunks of tokens x (start_pos + tokens): queries times keys."""
    num_decode_seqs: int
    num_decode_context_tokens: int
    """Sum over decode chunks of start_pos + 1: the keys each decode attends to."""
    seconds: float
    """Wall time of the step."""

    def __post_init__(self) -> None:
        counts = (self.seq, self.num_prefill_tokens, self.num_prefill_query_keys,
                  self.num_decode_seqs, self.num_decode_context_tokens)
        if min(counts) < 0 or not 0 <= self.seconds < float("inf"):
            raise ValueError("a step sample's counts and seconds must be finite and >= 0")


@WORKER_PROTOCOL.message("status")
@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    role: str
    model: str
    max_model_len: int
    is_ready: bool
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    kv_layout: dict[str, str | int] = field(default_factory=dict)
    """KVLayout fields, so the router computes the same block keys as the workers."""
    prefill_step_s: float = 0.0
    """Mean recent step time of steps that carried prefill tokens."""
    decode_step_s: float = 0.0
    """Mean recent step time of decode-only steps."""
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    kv_transfer: dict[str, float] = field(default_factory=dict)
    """Totals since start: {saved,loaded}_bytes, {save,load}_seconds, {save,load}_count;
    and num_handoff_leases: hand-offs its own node holds for decode now."""
    spec_decode: dict[str, float] = field(default_factory=dict)
    """Speculative decoding totals since start (empty when off): num_drafts,
    num_draft_tokens, num_accepted_tokens, and accepted_pos_<j> per draft position."""
    step_samples: list[StepSample] = field(default_factory=list)
    """The most recent step samples (at most 64), oldest first; a reader dedups by seq."""
    max_num_seqs: int = 0
    """The scheduler's batch limit (0: not reported)."""
    max_num_batched_tokens: int = 0
    """The scheduler's token budget per step (0: not reported)."""
    tensor_parallel_size: int = 1
    num_cached_blocks: int = 0
    """Of num_free_blocks, those holding reusable prefix KV (evictable)."""
    max_num_used_blocks: int = 0
    """The most KV blocks that requests held at once since the worker started (a block
    shared by several sequences of an n > 1 request counts once)."""
    moe_expert_tokens: list[int] = field(default_factory=list)
    """MoE models: (token, expert) assignments each routed expert computed since start,
    summed over rank 0's MoE layers (empty for a dense model)."""
    moe_dropped_tokens: int = 0
    """MoE models: assignments dropped past the expert capacity since start."""
    is_idle: bool = False
    """Holds nothing: no request owned, running, held for a save or loading, and no hand-off
    lease on its node (what a drain and a leak check wait for)."""
    kv_tiers: dict[str, float] = field(default_factory=dict)
    """Where prompt prefixes were found and what moved between the tiers since start
    (pdserve/serve/engine/kv_tiers.py), "<tier>_<counter>" for tier device | host | store and
    counter hit_tokens, read_bytes, written_bytes, evictions, writes_dropped; host_blocks and
    host_capacity_blocks; and the fetch-or-recompute rule's inputs (host_read_gb_per_s,
    store_read_gb_per_s, store_latency_ms, prefill_tokens_per_s, *_measured) and its
    decisions (loads_chosen, recomputes_chosen)."""
    cpu_path: dict[str, str] = field(default_factory=dict)
    """A CPU worker's kernel choice (pdserve/serve/executor/cpu_tuning.py): "path" (a path's
    label, or "portable": plain torch while the kernels build), "source" (portable, default,
    measured or cached), each candidate path's step times ("<path label>": "decode 1x256 0.912,
    ..." in ms), and "background" while a child builds and measures, or once it has
    (pdserve/serve/executor/cpu_preparation.py); empty elsewhere."""
    sim: dict[str, str] = field(default_factory=dict)
    """--engine sim (pdserve/serve/executor/sim_runner.py): what it simulates (profile,
    hardware, tensor_parallel_size, speedup, kv_fraction) and how it went (steps,
    simulated_s, overrun_steps, kv_mismatches), as text; empty for the model's engine."""
