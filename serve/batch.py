"""What the scheduler hands the model runner for one step, and what comes back.

The scheduler schedules tokens, not phases: a step is a list of chunks, one per request,
each some of that request's not-yet-computed tokens. A decode is a chunk of one token; a
prefill chunk is many; a cached prefix simply starts at a later position.

    request tokens:  [ t0 t1 t2 t3 | t4 t5 t6 | t7 ... ]
                       computed     this chunk   later
                       (in KV)      start_pos=4
    block_table covers positions [0, start_pos + len(token_ids)).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqChunk:
    request_id: str
    token_ids: list[int]
    """Tokens computed this step; their KV is written into the cache."""
    start_pos: int
    """Position of token_ids[0] == tokens of this request already in the KV cache."""
    block_table: list[int]
    """Physical KV block ids of this request, in order, covering every position to the end."""
    need_logits: bool
    """Sample after this chunk (it ends at the request's last known token)."""


@dataclass
class StepInput:
    chunks: list[SeqChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
