"""Routing and admission policies: objects the router is given, not flags in its loop.

Prefill workers are scored by the prompt's cached prefix (the router's index of what each
worker recently computed, which it holds in its pool or host tier; then the store master's
answer, credited at what a store load saves on that worker) and by load; decode workers by free KV
blocks and batch size. Admission predicts a request's TTFT from the chosen prefill worker's
queue and measured step times and rejects early (HTTP 429/503) instead of queueing without
bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pdserve.router.worker_client import WorkerClient


class NoWorkerAvailable(RuntimeError):
    """No ready worker of the needed role: HTTP 503."""


class Overloaded(RuntimeError):
    """Admission control refused the request: HTTP 429."""


@dataclass(frozen=True)
class RouteContext:
    num_prompt_tokens: int
    num_store_cached_tokens: int = 0
    """Leading prompt tokens whose KV blocks the fleet-wide store already holds."""
    num_worker_cached_tokens: dict[str, int] = field(default_factory=dict)
    """Per worker address (first pool; decode too in disaggregated mode): leading prompt
    tokens it recently computed or took."""

    def num_cached_tokens(self, worker: WorkerClient) -> float:
        """Prompt tokens the worker need not compute, as they weigh: its own prefix (its
        pool or its host DRAM tier: the index cannot tell them apart, and a host load costs
        a few percent of a recompute) in full, the store's beyond that at the credit the
        worker measured for a store load (pdserve/serve/engine/kv_tiers.py: 1 - load time / compute
        time per token; 1 until it reports one)."""
        own = self.num_worker_cached_tokens.get(worker.address, 0)
        beyond = max(0, self.num_store_cached_tokens - own)
        return own + store_credit(worker) * beyond


def store_credit(worker: WorkerClient) -> float:
    """The share of a token's prefill a store load saves on this worker (its report)."""
    tiers = worker.status.kv_tiers if worker.status is not None else {}
    return min(1.0, max(0.0, tiers.get("store_token_credit", 1.0)))


@dataclass(frozen=True)
class CacheAwarePrefill:
    """Prefill score: the tokens this worker would have to compute (prompt minus the prefix
    it or the store already holds) plus a penalty per request already on it. With no cache
    information it is least-loaded routing."""

    load_penalty_tokens: int = 512
    """How many prompt tokens of prefix reuse one queued request is worth."""
    _turns: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)
    """Ties take turns: requests one at a time would otherwise all land on one worker."""

    def choose(self, workers: Sequence[WorkerClient], ctx: RouteContext) -> WorkerClient:
        ready = sorted((w for w in workers if w.accepting), key=lambda w: w.address)
        if not ready:
            raise NoWorkerAvailable("no prefill worker is ready")
        costs = [ctx.num_prompt_tokens - ctx.num_cached_tokens(w)
                 + self.load_penalty_tokens * (w.num_inflight + num_queued(w)) for w in ready]
        best = min(costs)
        tied = [w for w, c in zip(ready, costs, strict=True) if c == best]
        return tied[next(self._turns) % len(tied)]


@dataclass(frozen=True)
class LeastLoadPrefill:
    """Prefill score: requests on the worker (in flight from this router and queued on it),
    cache ignored; ties take turns (SGLang's and vLLM production-stack's least-load)."""

    _turns: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)

    def choose(self, workers: Sequence[WorkerClient], ctx: RouteContext) -> WorkerClient:
        ready = sorted((w for w in workers if w.accepting), key=lambda w: w.address)
        if not ready:
            raise NoWorkerAvailable("no prefill worker is ready")
        loads = [w.num_inflight + num_queued(w) for w in ready]
        tied = [w for w, load in zip(ready, loads, strict=True) if load == min(loads)]
        return tied[next(self._turns) % len(tied)]


@dataclass(frozen=True)
class RoundRobinPrefill:
    """Each ready worker in turn, whatever its cache or load."""

    _turns: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)

    def choose(self, workers: Sequence[WorkerClient], ctx: RouteContext) -> WorkerClient:
        ready = sorted((w for w in workers if w.accepting), key=lambda w: w.address)
        if not ready:
            raise NoWorkerAvailable("no prefill worker is ready")
        return ready[next(self._turns) % len(ready)]


PrefillPolicy = CacheAwarePrefill | LeastLoadPrefill | RoundRobinPrefill
PREFILL_ROUTING: dict[str, type[PrefillPolicy]] = {
    "cache-aware": CacheAwarePrefill,
    "least-load": LeastLoadPrefill,
    "round-robin": RoundRobinPrefill,
}
"""--prefill-routing: how the router picks a prefill (or colocated) worker."""


def num_blocks_needed_now(num_prompt_tokens: int, block_size: int) -> int:
    """KV blocks a decode worker must have free to admit a handed-off request: its prompt's
    and the next token's. Not prompt + max_tokens: a worker grows a request a block at a
    time (preempting, or holding a loaded request back, when short), so it never needs the
    worst case free at once; and counting that, a long-context default max_tokens (the room
    left in the context) would make every worker look too small to take the request."""
    return -(-(num_prompt_tokens + 1) // block_size)


class MostFreeKVDecode:
    """Decode score: most free KV blocks, then smallest running batch; among the workers
    with num_blocks_needed free when any has (else all: the chosen one queues it)."""

    def choose(self, workers: Sequence[WorkerClient], num_blocks_needed: int) -> WorkerClient:
        ready = [w for w in workers if w.accepting]
        if not ready:
            raise NoWorkerAvailable("no decode worker is ready")
        fitting = [w for w in ready if w.status and w.status.num_free_blocks >= num_blocks_needed]
        pool = fitting or ready  # none fits now: the worker queues it (bounded by admission)
        return max(pool, key=lambda w: (w.status.num_free_blocks if w.status else 0,
                                        -w.num_inflight, w.address))


def num_queued(worker: WorkerClient) -> int:
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
    """Requests ahead times the measured prefill step time, plus this prompt's own share
    (scaled by the fraction of it that is not cached)."""
    status = worker.status
    if status is None or status.prefill_step_s <= 0:
        return 0.0
    ahead = worker.num_inflight + status.num_waiting
    uncached = 1.0 - ctx.num_cached_tokens(worker) / max(ctx.num_prompt_tokens, 1)
    return (ahead + uncached) * status.prefill_step_s
