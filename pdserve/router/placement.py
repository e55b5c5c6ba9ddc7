"""Where a request's prompt is computed in disaggregated mode: on a prefill worker (remote, the
default) or on the decode worker that will generate its answer (local; Dynamo calls it
conditional disaggregation).

A short prompt gains little from a prefill worker: its compute is a few decode steps' worth,
while the remote path adds a hand-off (a save, a load, two more hops) and a place in the
prefill queue. A prompt mostly cached on a decode worker (a chat's next turn, whose history
that worker computed: it holds the prompt it loaded and the answer it generated) has little
left to compute there. Either goes local when a decode worker has headroom:

    uncached = prompt tokens - the leading tokens the router saw that worker take
    local    when uncached <= max_local_tokens, on the decode worker with the fewest uncached
             (then the fewest in flight), if it queues nothing and runs under
             HEADROOM_SHARE of its batch limit
    remote   otherwise

The decode worker then runs the request from its prompt (its prefix cache serves what it
holds), exactly as a colocated worker would: the same tokens. What was placed where is in the
router's /status (`placement`) and /metrics (pdserve:request_placements_total{placement}).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.router.policies import RouteContext
    from pdserve.router.worker_client import WorkerClient

HEADROOM_SHARE = 0.75
"""A decode worker takes a local prefill only while it runs fewer than this share of its
batch limit: the prompt's step stalls every sequence it runs for that step."""


@dataclass(frozen=True)
class LocalPrefill:
    max_local_tokens: int = 0
    """Uncached prompt tokens a decode worker computes itself; 0: every prompt is remote."""

    def __post_init__(self) -> None:
        if self.max_local_tokens < 0:
            raise ValueError("max_local_tokens must be >= 0")

    def choose(self, decode: Sequence[WorkerClient], ctx: RouteContext
               ) -> WorkerClient | None:
        """The decode worker to prefill this prompt on, or None: remote."""
        if self.max_local_tokens <= 0:
            return None
        candidates = [w for w in decode if w.accepting and has_headroom(w)]
        if not candidates:
            return None

        def uncached(worker: WorkerClient) -> int:
            return ctx.num_prompt_tokens - ctx.num_worker_cached_tokens.get(worker.address, 0)

        best = min(candidates, key=lambda w: (uncached(w), w.num_inflight, w.address))
        return best if uncached(best) <= self.max_local_tokens else None


def has_headroom(worker: WorkerClient) -> bool:
    status = worker.status
    if status is None or status.num_waiting > 0:
        return False
    limit = status.max_num_seqs or 1
    return worker.num_inflight < HEADROOM_SHARE * limit
