"""Moving a worker between the prefill and decode pools: the goodput controller's flip.

    leaving decode:   draining (no new requests) ─► its running requests handed over ─► idle
                      (each resumes on another decode worker: Dispatcher._migrating)
    leaving prefill:  draining ─► finishes what it holds (a prompt takes one TTFT) ─► idle
    then, both:       SetRole (sent again while the worker refuses: a hand-off still saving
                      or a load still ending) ─► the worker reports its new role ─► other pool

A decode worker's requests may run for minutes; waiting for them would make a move cost as
long as the longest answer, and the pool it leaves would serve with one worker less all that
while. Handing them over costs each request one recompute of its context on the worker that
takes it (the prompt's prefix loads from the store where it is there) and nothing else: the
client sees no gap and no repeat, seeded sampling continues at the same draw. The weights stay
loaded; a move fails no request. `hand_over=False` drains instead (the old behaviour, kept to
measure what a move costs either way: benchmarks/sim_fleet phases --controller-hand-over).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.router.policies import num_queued

if TYPE_CHECKING:
    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.worker_client import WorkerClient

logger = logging.getLogger(__name__)

ROLE_SWITCH_TIMEOUT_S = 5.0  # a drained worker reports its new role within this
SET_ROLE_RESEND_S = 0.5  # a worker that refused (still saving, loading) is asked again
POLL_S = 0.05  # how often a wait looks again


@dataclass(frozen=True)
class Move:
    """One worker moved to the other pool."""

    worker_id: str
    to_role: str
    seconds: float
    """From the pick to the worker serving in its new pool."""
    num_handed_over: int
    """Requests it held that resumed on other workers of the pool it left."""


async def move_worker(dispatcher: Dispatcher, to_role: str, drain_timeout_s: float,
                      hand_over: bool = True) -> Move | None:
    """Move one worker of the other pool to `to_role` (prefill | decode): the least busy one
    stops getting requests, hands over (decode, `hand_over`) or finishes the ones it holds,
    is told its new role and joins the new pool once it reports it. None if none moved: the
    other pool has one worker (it must keep it), or the drain or the switch timed out (it
    stays)."""
    if to_role not in ("prefill", "decode"):
        raise ValueError(f"can only flip to prefill or decode, not {to_role!r}")
    source, target = ((dispatcher.decode, dispatcher.prefill) if to_role == "prefill"
                      else (dispatcher.prefill, dispatcher.decode))
    candidates = [w for w in source if w.accepting]
    if len(candidates) < 2:
        return None
    started_s = time.monotonic()
    worker = min(candidates, key=lambda w: (w.num_inflight + num_queued(w), w.address))
    worker.draining = True
    num_handed_over = 0
    try:
        if hand_over and worker.role == "decode":
            num_handed_over = await worker.hand_over_inflight()
        if not await wait_until(lambda: is_idle(worker), drain_timeout_s):
            logger.warning("worker %s did not drain within %.0fs; it stays %s",
                           worker.worker_id, drain_timeout_s, worker.role)
            return None
        if not await _switch(worker, to_role):
            logger.warning("worker %s did not switch to %s; it stays %s",
                           worker.worker_id, to_role, worker.role)
            return None
    finally:
        worker.draining = False
    source.remove(worker)
    target.append(worker)
    worker.role = to_role
    move = Move(worker.worker_id, to_role, time.monotonic() - started_s, num_handed_over)
    logger.info("worker %s is now %s (%d prefill, %d decode) after %.2fs, %d requests handed "
                "over", worker.worker_id, to_role, len(dispatcher.prefill),
                len(dispatcher.decode), move.seconds, num_handed_over)
    return move


async def _switch(worker: WorkerClient, to_role: str) -> bool:
    """Ask until the worker reports `to_role`, at most ROLE_SWITCH_TIMEOUT_S: a worker that
    is idle at the router may still end a hand-off's save or a load, and refuses until then
    (it says so in its log)."""
    deadline = asyncio.get_running_loop().time() + ROLE_SWITCH_TIMEOUT_S
    while True:
        await worker.set_role(to_role)
        remaining_s = deadline - asyncio.get_running_loop().time()
        if await wait_until(lambda: worker.status is not None and worker.status.role == to_role,
                            min(SET_ROLE_RESEND_S, max(0.0, remaining_s))):
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False


def is_idle(worker: WorkerClient) -> bool:
    """Nothing of it is in flight at the router, and its last status shows no request."""
    status = worker.status
    return (worker.num_inflight == 0 and status is not None and status.num_running == 0
            and status.num_waiting == 0)


async def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True
