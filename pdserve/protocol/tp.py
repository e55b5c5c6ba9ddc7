"""Engine process (TP rank 0) -> the other TP ranks: steps and KV commands.

Rank 0 broadcasts each message as codec bytes in a uint8 tensor over a gloo "control" group
(pdserve/serve/executor/model_runner.py); every other rank decodes it and does the same work:

    StepInput  "step"      run this step's forward (its chunks below); rank 0 keeps the logits
    ReadKV     "read_kv"   gather these blocks' KV heads to rank 0       (KV hand-off, save)
    WriteKV    "write_kv"  take your heads of these blocks from rank 0   (KV hand-off, load)
    Ping       "ping"      nothing to do: keeps an idle rank's receive from timing out
    Stop       "stop"      leave the receive loop and the process group

StepInput and SeqChunk are also what the scheduler hands the model runner in process, every
step, at any TP degree. The scheduler schedules tokens, not phases: a step is a list of
chunks, one per request, each some of that request's not-yet-computed tokens. A decode is a
chunk of one token; a prefill chunk is many; a cached prefix simply starts at a later position.

    request tokens:  [ t0 t1 t2 t3 | t4 t5 t6 | t7 ... ]
                       computed     this chunk   later
                       (in KV)      start_pos=4
    block_table covers positions [0, start_pos + len(token_ids)).

This module imports neither torch nor the engine: it is the boundary, owned by neither side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.codec import Protocol

TP_PROTOCOL = Protocol("tp")

# SeqChunk and StepInput are built for every request in every step, so they are plain
# (slotted, not frozen) dataclasses: a frozen one costs ~3x as much to construct, and the
# scheduler appends chunks to a step as it builds it. The codec only touches them at TP > 1.
# Semantic checks (vocabulary, positions, block ids) need the model and the pool: rank 0's
# runner makes them before it broadcasts, so they are not repeated in __post_init__.


@dataclass(slots=True)
class SeqChunk:
    """One request's tokens computed in a step."""

    request_id: str
    token_ids: list[int]
    """Tokens computed this step; their KV is written into the cache."""
    start_pos: int
    """Position of token_ids[0] == tokens of this request already in the KV cache."""
    block_table: list[int]
    """Physical KV block ids of this request, in order, covering every position to the end."""
    need_logits: bool
    """Sample after this chunk (it ends at the request's last known token)."""
    num_prompt_logits: int = 0
    """Also return the logits of this many leading rows, for prompt logprobs (every rank
    computes the same rows: pdserve/serve/engine/prompt_logprobs.py)."""
    num_draft_tokens: int = 0
    """Speculative decoding: the last this many token_ids are drafts to verify; the runner
    returns the logits of the chunk's last 1 + num_draft_tokens rows
    (pdserve/serve/engine/spec_decode.py)."""


@TP_PROTOCOL.message("step")
@dataclass(slots=True)
class StepInput:
    """One step: what the scheduler hands the runner, and what rank 0 sends the other ranks."""

    chunks: list[SeqChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@TP_PROTOCOL.message("read_kv")
@dataclass(frozen=True)
class ReadKV:
    """Every rank sends rank 0 its heads of these blocks (a gather on the control group)."""

    block_ids: list[int]


@TP_PROTOCOL.message("write_kv")
@dataclass(frozen=True)
class WriteKV:
    """Rank 0 broadcasts these whole-head blocks; every rank writes its own heads."""

    block_ids: list[int]
    layer: int = -1
    """-1: every layer; else that layer alone (a followed hand-off, a layer as it lands)."""

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not -1 <= self.layer < 1 << 16:
            raise ValueError("layer must be -1 (every layer) or a layer index")


@TP_PROTOCOL.message("ping")
@dataclass(frozen=True)
class Ping:
    pass


@TP_PROTOCOL.message("stop")
@dataclass(frozen=True)
class Stop:
    pass


TPMessage = StepInput | ReadKV | WriteKV | Ping | Stop
