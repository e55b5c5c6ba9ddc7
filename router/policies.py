"""Routing and admission policies: objects the router is given, not flags in its loop.

Prefill workers are scored by the prompt's cached prefix (from the store master, and in the
future each worker's own prefix cache) and by load; decode workers by free KV blocks and
batch size. Admission predicts a request's TTFT from the chosen prefill worker's queue and
measured step times and rejects early (HTTP 429/503) instead of queueing without bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.router.worker_client import WorkerClient


class NoWorkerAvailable(RuntimeError):
    """No ready worker of the needed role: HTTP 503."""


class Overloaded(RuntimeError):
    """Admission control refused the request: HTTP 429."""


@dataclass(frozen=True)
class RouteContext:
    num_prompt_tokens: int
    num_store_cached_tokens: int
    """Leading prompt tokens whose KV blocks the store already holds."""


class LeastLoadedPrefill:
    """Prefill score: fewer queued prompt tokens first; a shared-store hit helps every worker
    alike, so it lowers the predicted work rather than picking a worker."""

    def choose(self, workers: Sequence[WorkerClient], ctx: RouteContext) -> WorkerClient:
        ready = [w for w in workers if w.is_ready]
        if not ready:
            raise NoWorkerAvailable("no prefill worker is ready")
        return min(ready, key=lambda w: (w.num_inflight + _queued(w), w.address))


class MostFreeKVDecode:
    """Decode score: most free KV blocks, then smallest running batch."""

    def choose(self, workers: Sequence[WorkerClient], num_blocks_needed: int) -> WorkerClient:
        ready = [w for w in workers if w.is_ready]
        if not ready:
            raise NoWorkerAvailable("no decode worker is ready")
        fitting = [w for w in ready if w.status and w.status.num_free_blocks >= num_blocks_needed]
        pool = fitting or ready  # none fits now: the worker queues it (bounded by admission)
        return max(pool, key=lambda w: (w.status.num_free_blocks if w.status else 0,
                                        -w.num_inflight, w.address))


def _queued(worker: WorkerClient) -> int:
    return worker.status.num_waiting if worker.status else 0


@dataclass(frozen=True)
class AdmissionPolicy:
    max_inflight_per_worker: int = 256
    """Requests a worker may hold (running + queued) before new ones get 429."""
    max_predicted_ttft_s: float | None = None
    """Reject when the predicted TTFT exceeds this (None: no TTFT-based admission)."""

    def check(self, worker: WorkerClient, ctx: RouteContext) -> None:
        if worker.num_inflight >= self.max_inflight_per_worker:
            raise Overloaded(
                f"server overloaded: {worker.num_inflight} requests in flight on the worker "
                f"(limit {self.max_inflight_per_worker}); retry later"
            )
        if self.max_predicted_ttft_s is None or worker.status is None:
            return
        predicted = predicted_ttft_s(worker, ctx)
        if predicted > self.max_predicted_ttft_s:
            raise Overloaded(
                f"server overloaded: predicted time to first token {predicted:.2f}s exceeds "
                f"the limit {self.max_predicted_ttft_s:.2f}s; retry later"
            )


def predicted_ttft_s(worker: WorkerClient, ctx: RouteContext) -> float:
    """Queue ahead (in steps) times the measured prefill step time, plus this prompt's own."""
    status = worker.status
    if status is None or status.prefill_step_s <= 0:
        return 0.0
    steps_ahead = worker.num_inflight + status.num_waiting
    return (steps_ahead + 1) * status.prefill_step_s
