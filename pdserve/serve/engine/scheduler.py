"""Continuous batching that schedules tokens, not phases (vLLM V1's scheduler, simplified).

Each step has a token budget (max_num_batched_tokens). It goes, in this order, to

    1. running requests with one token left to compute (decodes): one token each
    2. running requests part-way through their prompt (chunked prefill)
    3. waiting requests in arrival order (new ones and preempted ones), whose cached prefix
       counts as computed (the pool's, then the host tier's, copied in: kv_tiers.py),
       while max_num_seqs allows and blocks last (a request of n > 1 sequences takes n
       seats from its admission on: it forks into n once prefilled)

When a running request needs a block and none is left, the most recently admitted running
request is preempted by recompute: its blocks are freed (its full blocks stay in the prefix
cache, so the recompute is often a cache hit) and it goes back to the front of the waiting
queue. Preempting most-recent-first and pushing to the front keeps arrival order.

A request whose KV arrives from elsewhere (a decode worker's hand-off, a prefix loaded from
the store) holds its blocks from its arrival, but its seat is bounded by max_num_seqs as any
other's: past the limit it is parked, its KV kept, and takes the first seat that frees, ahead
of the waiting queue (vLLM's decode side likewise queues remote-KV requests behind the seats).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import SchedulerConfig
from pdserve.serve.engine.block_manager import BlockManager, NoFreeBlocksError
from pdserve.serve.engine.kv_tiers import KVOffload
from pdserve.serve.engine.prompt_logprobs import num_prompt_logit_rows, wants_prompt_logits
from pdserve.serve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

PENDING_TOKEN_ID = 0
"""Stands in a chunk for a token sampled on the device and not yet on the host."""


class RequestRejectedError(ValueError):
    """The request can never be served by this engine (too long for the model or pool)."""


@dataclass
class SchedulerOutput:
    step: StepInput = field(default_factory=StepInput)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """(request, number of tokens computed this step), in the order of step.chunks."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def mark_started(self) -> None:
        """Stamp first_scheduled_s on the requests this is the first step of."""
        now_s = time.monotonic()
        for request, _ in self.scheduled:
            if request.first_scheduled_s is None:
                request.first_scheduled_s = now_s


class Scheduler:
    """Decides each step's tokens: owns the waiting and running queues and admits, chunks,
    preempts (by recompute) and finishes requests, taking blocks from the block manager.
    Schedules tokens, not phases: decodes first, then prefill chunks within the step's
    token budget. Called by the Engine, once per step (`schedule`, then `update_after_step`)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: deque[Request] = deque()
        """Requests with their KV in their blocks (add_running_request) waiting for a seat."""
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Prefix-cache counters in tokens (vLLM's prefix_cache_queries / _hits), per admission.
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        """Hits in every tier below this worker; of them, in its own pool:"""
        self.num_device_hit_tokens = 0
        self.lower: KVOffload | None = None
        """The host tier below the pool (pdserve/serve/engine/kv_tiers.py): a waiting request's
        prefix past the pool's hits is copied in from there, where it is worth it."""

    # ---- admission ----------------------------------------------------------------------
    def check_admissible(self, request: Request) -> None:
        """Raise RequestRejectedError if the request could never run to completion."""
        num_prompt = request.num_prompt_tokens
        if request.num_seqs > self.config.max_num_seqs:
            raise RequestRejectedError(
                f"request {request.request_id!r}: {request.num_seqs} sequences (n, best_of) "
                f"exceed max_num_seqs={self.config.max_num_seqs}")
        if num_prompt >= self.max_model_len:
            raise RequestRejectedError(
                f"request {request.request_id!r}: prompt of {num_prompt} tokens leaves no room "
                f"to generate within max_model_len={self.max_model_len}")
        if not self.config.enable_chunked_prefill and \
                num_prompt > self.config.max_num_batched_tokens:
            raise RequestRejectedError(
                f"request {request.request_id!r}: prompt of {num_prompt} tokens exceeds "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} and chunked "
                f"prefill is off")
        # The last generated token's KV is never computed, hence the - 1.
        max_positions = num_prompt + request.max_tokens - 1
        num_blocks = self.block_manager.num_blocks_for(max_positions)
        if num_blocks > self.block_manager.num_blocks:
            raise RequestRejectedError(
                f"request {request.request_id!r}: {max_positions} tokens need {num_blocks} KV "
                f"blocks but the pool has {self.block_manager.num_blocks}; lower max_tokens or "
                f"grow the pool")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_admissible(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running_request(self, request: Request, block_ids: list[int] | None) -> list[int]:
        """Admit a request whose first request.num_computed_tokens tokens already have KV
        (decode role): it gets block_ids (or fresh blocks) and runs from the next step, or,
        with every seat taken (max_num_seqs), from the step after a seat frees."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_admissible(request)
        num_tokens = request.num_computed_tokens
        if not 0 < num_tokens < request.num_tokens:
            raise ValueError("num_computed_tokens must cover the prompt and leave a token")
        bm = self.block_manager
        if block_ids is None:
            # Fresh blocks only: prefix hits would point at KV the caller does not load into.
            if not bm.can_allocate(request, num_tokens, reuse_prefix=False):
                raise NoFreeBlocksError(f"no blocks for {num_tokens} prefilled tokens")
            bm.allocate(request, num_tokens, reuse_prefix=False)
        elif len(block_ids) != bm.num_blocks_for(num_tokens):
            raise ValueError(f"{len(block_ids)} block ids for {num_tokens} tokens")
        else:
            bm.claim(request, block_ids)
        request.num_cached_tokens = num_tokens
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.parked.append(request)
        self._seat_parked()
        return list(bm.block_table(request.request_id))

    @property
    def num_seats(self) -> int:
        """Seats taken (max_num_seqs bounds them): a request of n sequences takes n."""
        return sum(r.num_seqs for r in self.running)

    def _seat_parked(self) -> None:
        if not self.parked:  # the common case: no sum over the batch on every step
            return
        num_seats = self.num_seats
        while self.parked and num_seats + self.parked[0].num_seqs <= self.config.max_num_seqs:
            request = self.parked.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_seats += request.num_seqs

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._seat_parked()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            uncomputed = r.num_uncomputed_tokens
            if uncomputed == 1:
                decodes.append(r)
            elif uncomputed > 1:
                prefills.append(r)
        num_prefills = 0
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier this step
                continue
            uncomputed = request.num_uncomputed_tokens
            if uncomputed > 1:
                if self._prefills_full(num_prefills):
                    continue
                num_prefills += 1
            # With drafts (speculative decoding) a decode verifies 1 + k tokens.
            num_new = min(uncomputed + len(request.spec_token_ids), budget)
            if num_new < uncomputed and not self.config.enable_chunked_prefill:
                continue
            while not self.block_manager.can_append(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                budget += scheduled.pop(victim.request_id, 0)
                if victim is request:
                    break
            else:
                self.block_manager.append_slots(request, num_new)
                scheduled[request.request_id] = num_new
                budget -= num_new
        # vLLM's rule: a step that had to preempt admits nobody new (memory is short); nor
        # does one with parked requests, whose KV is here already and who came first.
        if not preempted and not self.parked:
            budget = self._admit_waiting(budget, scheduled, num_prefills)
        return self._build_output(scheduled, preempted)

    def _prefills_full(self, num_prefills: int) -> bool:
        return 0 < self.config.max_prefills_per_step <= num_prefills

    def _admit_waiting(self, budget: int, scheduled: dict[str, int], num_prefills: int) -> int:
        bm = self.block_manager
        num_seats = self.num_seats
        while self.waiting and budget > 0 and not self._prefills_full(num_prefills) and \
                num_seats + self.waiting[0].num_seqs <= self.config.max_num_seqs:
            request = self.waiting[0]
            # Prompt logprobs need every prompt row computed: no prefix hit (as vLLM)
            reuse = not wants_prompt_logits(request)
            num_hit = bm.num_cached_tokens(request) if reuse else 0  # in the pool
            load = self.lower.plan(request, num_hit) if reuse and self.lower else None
            num_cached = num_hit + (len(load.keys) * bm.block_size if load else 0)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    if load:
                        self.lower.cancel(load)
                    break
                num_new = budget
            if not bm.can_allocate(request, num_cached + num_new, reuse):
                if load:
                    self.lower.cancel(load)
                break  # first come, first served: nobody overtakes the head of the queue
            bm.allocate(request, num_cached + num_new, reuse)
            if load:  # the blocks after the pool's hits: their KV comes from the host tier
                first = num_hit // bm.block_size
                self.lower.load(load, bm.block_table(request.request_id)
                                [first:first + len(load.keys)])
            request.num_computed_tokens = num_cached
            self.num_prefix_queried_tokens += request.num_tokens
            self.num_prefix_hit_tokens += num_cached
            self.num_device_hit_tokens += num_hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(request)
            num_seats += request.num_seqs
            num_prefills += 1
            scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _build_output(self, scheduled: dict[str, int],
                      preempted: list[Request]) -> SchedulerOutput:
        output = SchedulerOutput(preempted=preempted)
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            num_known = request.num_tokens + request.num_pending_tokens
            num_drafts = max(0, start + num_new - num_known)
            known = request.all_token_ids[start:start + num_new - num_drafts]
            output.step.chunks.append(SeqChunk(
                request_id=request_id,
                # A pending token (async scheduling) is a placeholder here: the step takes its
                # id from the step in flight's sampled ids on the device (overlap.py).
                token_ids=(known + [PENDING_TOKEN_ID] * (num_new - num_drafts - len(known))
                           + request.spec_token_ids[:num_drafts]),
                start_pos=start,
                block_table=list(self.block_manager.block_table(request_id)),
                need_logits=start + num_new - num_drafts == num_known,
                num_prompt_logits=num_prompt_logit_rows(request, start, num_new),
                num_draft_tokens=num_drafts,
            ))
            output.scheduled.append((request, num_new))
        return output

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # drafts follow a forward; the recompute makes new ones
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: its tokens' KV is in the cache; publish newly full blocks."""
        self.commit(output, self.advance(output))

    def advance(self, output: SchedulerOutput) -> list[int]:
        """The step's tokens count as computed (drafts only once verified: the engine's
        speculative decoding, pdserve/serve/engine/spec_decode.py); returns each request's computed
        count, for commit(). Async scheduling (pdserve/serve/engine/overlap.py) advances as it
        launches a step, for the next schedule, and commits once the step is done (nothing is
        published before its KV exists)."""
        ends = []
        for (request, num_new), chunk in zip(output.scheduled, output.step.chunks,
                                             strict=True):
            request.num_computed_tokens += num_new - chunk.num_draft_tokens
            ends.append(request.num_computed_tokens)
        return ends

    def commit(self, output: SchedulerOutput, ends: list[int]) -> None:
        """Async scheduling, once a launched step is done: publish the blocks it filled (up
        to `ends`, what advance() returned: a later step may already be in flight)."""
        for (request, _), end in zip(output.scheduled, ends, strict=True):
            self.block_manager.commit_computed(request, end)

    # ---- leaving ------------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request in any state and free its blocks; None if unknown."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.parked:
            self.parked.remove(request)
        self.block_manager.free(request)
        request.status = status
        return request

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
