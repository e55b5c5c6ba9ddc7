"""A request's path through the workers (docs/architecture.md).

    colocated:  router -> colocated worker -> deltas
    disagg:     router -> prefill worker -> first token + KVHandoff
                       -> decode worker (loads the blocks from the store) -> deltas
                (the prefill worker says where it stages the prompt as its forward starts,
                 and the decode worker picked then follows it layer by layer: out of the
                 shared segment on the same host, pulled from the prefill worker's hand-off
                 node on another: FollowPrefill, pdserve/serve/worker/follow.py; the hand-off
                 goes to that worker)

`Dispatcher.run` yields the worker outputs of one request as they come. Whatever way the
request ends (finish, error, timeout, client disconnect: the generator is closed), every
worker that still holds it is told to abort, so no blocks or leases outlive it.

Migration: a worker that dies or goes silent while it holds a request does not fail it, nor
does a decode worker that the controller moves to the prefill pool (it hands its requests
over: pdserve/router/moves.py). The request moves to another worker of the same pool, at
most `max_migrations` times:
    before the worker streamed anything   the same request again (a prefill's prompt, or a
                                          decode's hand-off, whose KV is still leased)
    after it streamed some outputs        prompt + those outputs (resume_output_ids): the new
                                          worker recomputes them (the prompt's prefix from
                                          the store where it is there) and streams only
                                          what follows, so the client sees no gap and no
                                          repeat; seeded sampling draws by output index,
                                          so it continues at the same draw
A request of n > 1 sequences (best_of too) streams until each of its choices has ended (an
Output.finish_reason per index); it moves like any request before its first output, and
after outputs with each unfinished choice's outputs so far (resume_choices: the new worker
prefills the prompt once, forks, and each choice resumes after its own tokens; the choices
that ended stay ended). Nothing is left on any worker either way.

A pool with no ready worker for now (its workers restarting) holds the request rather than
refusing it: admission, a migration and the decode pick wait up to `pool_wait_s` for one
(`wait_for_ready`), and only then is it HTTP 503. At most `max_pool_waiters` requests wait so;
the next gets HTTP 503 at once (uvicorn would hold any number). A worker restarted at the
address that failed is a new process: a migration may go back to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

import zmq.asyncio

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import FollowPrefill, GenerateRequest, KVStaging, Output
from pdserve.router.config import RouterConfig
from pdserve.router.fleet_watch import FleetWatch
from pdserve.router.moves import Move, move_worker, wait_until
from pdserve.router.phases import Migration, RequestPhases, WorkerLeg
from pdserve.router.placement import LocalPrefill
from pdserve.router.policies import (
    PREFILL_ROUTING,
    AdmissionPolicy,
    MostFreeKVDecode,
    NoWorkerAvailable,
    PrefillPolicy,
    RouteContext,
    num_blocks_needed_now,
    num_queued,
)
from pdserve.router.prefix_index import PrefixIndex, StoreLookup, request_block_keys
from pdserve.router.worker_client import WorkerClient, WorkerDied

logger = logging.getLogger(__name__)

HANDOFF = "handoff"
MAX_TRACKED_REQUESTS = 100_000  # prompt keys kept for requests admitted and not ended

class RequestFailed(RuntimeError):
    """A worker reported an error, died, or went silent past its timeout."""


class WorkerSilent(RequestFailed):
    """The worker holding the request sent nothing within its timeout (hung)."""


def _worker_failed(exc: RequestFailed) -> bool:
    """The worker, not the request, failed: worth moving the request elsewhere."""
    return isinstance(exc, WorkerSilent) or isinstance(exc.__cause__, WorkerDied)


class Dispatcher:
    """The router's way to the workers: owns a client per worker in each pool, the prefill and
    decode policies, admission, the prefix index and the store lookup, and walks one request
    through prefill and decode (`run`), migrating it when a worker dies. Called by the HTTP
    routes (pdserve/router/routes.py); the fleet watch and the controller change its pools."""

    def __init__(
        self,
        config: RouterConfig,
        prefill_policy: PrefillPolicy | None = None,
        decode_policy: MostFreeKVDecode | None = None,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.config = config
        self.context = zmq.asyncio.Context()

        def clients(addrs: Sequence[str], role: str) -> list[WorkerClient]:
            return [self.new_worker(a, role) for a in addrs]

        self.colocated = clients(config.colocated_addrs, "colocated")
        self.prefill = clients(config.prefill_addrs, "prefill")
        self.decode = clients(config.decode_addrs, "decode")
        self.prefill_policy = prefill_policy or PREFILL_ROUTING[config.prefill_routing]()
        self.prefix_index = PrefixIndex()
        self.store_lookup = (StoreLookup(config.store_master_addr)
                             if config.store_master_addr else None)
        self.decode_policy = decode_policy or MostFreeKVDecode()
        self.placement = LocalPrefill(config.local_prefill_max_tokens)
        self.num_placed = {"local": 0, "remote": 0}
        """Disaggregated requests admitted with their prompt on a decode worker / on prefill."""
        self._prompt_keys: OrderedDict[str, list[bytes]] = OrderedDict()
        """Admitted requests' prompt block keys, until they end: the decode worker picked
        for one is recorded in the prefix index as holding its prompt."""
        self.admission = admission or AdmissionPolicy(
            max_inflight_per_worker=config.max_inflight_per_worker,
            max_predicted_ttft_s=config.max_predicted_ttft_s,
        )
        self.on_migration: Callable[[str, bool], None] | None = None
        """Told (pool role, whether outputs had been streamed) each time a request moves."""
        self.num_pool_waiters = 0
        """Requests waiting now for a worker of an empty pool (wait_for_ready)."""
        self.fleet_watch: FleetWatch | None = None
        """With config.discovery: adds and drops workers as the registry says."""

    @property
    def workers(self) -> list[WorkerClient]:
        return self.colocated + self.prefill + self.decode

    def new_worker(self, address: str, role: str) -> WorkerClient:
        """A client of the worker at `address`, not started, in no pool yet."""
        return WorkerClient(address, role, self.context,
                            heartbeat_timeout_s=self.config.heartbeat_timeout_s)

    def pool(self, role: str) -> list[WorkerClient]:
        return {"prefill": self.prefill, "decode": self.decode,
                "colocated": self.colocated}[role]

    @property
    def is_disaggregated(self) -> bool:
        """Requests go prefill -> decode. Static: as configured; with discovery: whenever
        the registry holds prefill or decode workers (colocated ones then wait)."""
        if self.config.discovery is None:
            return self.config.is_disaggregated
        return bool(self.prefill or self.decode)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        if self.config.discovery is not None:
            self.fleet_watch = FleetWatch(self, self.config.discovery,
                                          self.config.discovery_ttl_s)
            self.fleet_watch.start()

    async def close(self) -> None:
        if self.fleet_watch is not None:
            await self.fleet_watch.close()
        for worker in self.workers:
            await worker.close()
        if self.store_lookup is not None:
            self.store_lookup.close()
        self.context.term()

    def is_ready(self) -> bool:
        if self.is_disaggregated:
            return any(w.is_ready for w in self.prefill) and any(w.is_ready for w in self.decode)
        return any(w.is_ready for w in self.colocated)

    def max_model_len(self) -> int | None:
        """The smallest context limit a live worker reports (None before any reported): a
        worker caps its model's limit to what its KV pool holds, and a request may go to
        any worker."""
        limits = [w.status.max_model_len for w in self.workers
                  if w.is_alive and w.status is not None]
        return min(limits, default=None)

    @property
    def first_pool(self) -> list[WorkerClient]:
        """Where requests start: prefill workers, or colocated ones."""
        return self.prefill if self.is_disaggregated else self.colocated

    async def route_context(self, prompt_token_ids: list[int], cache_salt: str | None
                            ) -> tuple[RouteContext, list[bytes]]:
        """How much of the prompt is cached, in the store and on each first-pool worker."""
        status = next((w.status for w in self.first_pool if w.is_ready and w.status), None)
        if status is None or not status.kv_layout:
            return RouteContext(len(prompt_token_ids)), []
        keys = request_block_keys(prompt_token_ids, status.kv_layout, status.model, cache_salt)
        block_size = int(status.kv_layout["block_size"])
        num_store = 0
        if self.store_lookup is not None:
            num_store = await self.store_lookup.num_cached_blocks(keys) * block_size
        workers = self.first_pool + (self.decode if self.is_disaggregated
                                     and self.placement.max_local_tokens > 0 else [])
        per_worker = {w.address: self.prefix_index.num_leading_blocks(keys, w.address)
                      * block_size for w in workers}
        return RouteContext(len(prompt_token_ids), num_store, per_worker), keys

    def admit(self, request_id: str, ctx: RouteContext, keys: list[bytes]) -> WorkerClient:
        """Pick the first worker for a request and reserve its slot there, or raise
        NoWorkerAvailable / Overloaded: in disaggregated mode a decode worker where the
        request's prompt is placed there (pdserve/router/placement.py), else a prefill one."""
        if self.is_disaggregated and self.placement.max_local_tokens > 0:
            # (only then does a decode worker's prefix matter: the index's room is shared)
            self._prompt_keys[request_id] = keys
            while len(self._prompt_keys) > MAX_TRACKED_REQUESTS:  # admitted, never run
                self._prompt_keys.popitem(last=False)
            local = self.placement.choose(self.decode, ctx)
            if local is not None:
                self.admission.check(local, ctx)
                local.reserve(request_id)
                self.prefix_index.record(keys, local.address)
                self.num_placed["local"] += 1
                return local
        worker = self.prefill_policy.choose(self.first_pool, ctx)
        self.admission.check(worker, ctx)
        if self.is_disaggregated:
            decoders = [w for w in self.decode if w.accepting]
            if not decoders:
                raise NoWorkerAvailable("no decode worker is ready")
            self.admission.check(min(decoders, key=lambda w: w.num_inflight), ctx)
        worker.reserve(request_id)
        self.prefix_index.record(keys, worker.address)  # it is about to compute them
        if self.is_disaggregated:
            self.num_placed["remote"] += 1
        return worker

    async def flip_one(self, to_role: str, drain_timeout_s: float, hand_over: bool = True
                       ) -> Move | None:
        """Move one worker of the other pool to `to_role` (pdserve/router/moves.py)."""
        return await move_worker(self, to_role, drain_timeout_s, hand_over)

    async def run(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        first_worker: WorkerClient,
        phases: RequestPhases | None = None,
    ) -> AsyncIterator[Output]:
        """`phases`: where the request's send and first-Output times and the workers'
        reported phases are recorded (pdserve/router/phases.py)."""
        request = GenerateRequest(request_id, prompt_token_ids, sampling)
        phases = phases or RequestPhases(0.0)
        # Prefill hands off each continuing choice (n > 1: several); one carries the KVHandoff.
        handed_off: list[Output] = []
        pool = self.prefill if self.is_disaggregated else self.colocated
        follower: WorkerClient | None = None  # the decode worker following the prefill
        try:
            if first_worker.role == "decode":  # placed: the decode worker computes the prompt
                async with aclosing(self._migrating(self.decode, first_worker, request, {},
                                                    phases.first)) as stream:
                    async for output in stream:
                        yield output
                return
            async with aclosing(self._migrating(pool, first_worker, request, {},
                                                phases.first)) as stream:
                async for output in stream:
                    if output.staging is not None:
                        follower = await self._follow(request, output.staging, follower)
                    elif output.finish_reason == HANDOFF:
                        handed_off.append(output)  # prefill is done with this choice
                    else:
                        yield output  # colocated, or prefill finished by itself (stop, length)
            carrier = next((o for o in handed_off if o.handoff is not None), None)
            if carrier is None:
                for output in handed_off:
                    yield output
                return
            for output in handed_off:
                yield dataclasses.replace(output, finish_reason=None, handoff=None)
            # (the prompt's logprobs came from prefill: decode never computes them again)
            decode_request = dataclasses.replace(
                request, handoff=carrier.handoff,
                sampling=dataclasses.replace(request.sampling, prompt_logprobs=None))
            first_tokens = {output.index: list(output.token_ids) for output in handed_off}
            # the follower (if any) gets the hand-off; from here the decode leg owns it
            decode_worker, follower = follower, None
            if decode_worker is not None and not decode_worker.accepting:
                await decode_worker.abort(request_id)  # draining or gone since: pick anew
                decode_worker = None
            async with aclosing(self._migrating(self.decode, decode_worker, decode_request,
                                                first_tokens, phases.decode)) as stream:
                async for output in stream:
                    yield output
        finally:
            self._prompt_keys.pop(request_id, None)
            if follower is not None:  # no hand-off came for it: its reservation goes back
                await follower.abort(request_id)

    async def _follow(self, request: GenerateRequest, staging: KVStaging,
                      follower: WorkerClient | None) -> WorkerClient | None:
        """A prefill worker stages the prompt as its forward starts: pick the decode worker
        now, and let it copy each layer as it lands (out of the shared segment on the same
        host; on another host it pulls each layer from the prefill worker's hand-off node).
        A migrated prefill stages anew: the old follower lets go."""
        if follower is not None:
            await follower.abort(request.request_id)
        if request.sampling.num_seqs > 1 or not self.decode:
            return None  # (several choices fork on decode: they load as usual)
        try:
            follower = self._pick(self.decode, set(), request)
        except NoWorkerAvailable:
            return None
        await follower.follow(FollowPrefill(request.request_id, len(request.prompt_token_ids),
                                            staging))
        return follower

    async def _migrating(self, pool: list[WorkerClient], worker: WorkerClient | None,
                         request: GenerateRequest, streamed: dict[int, list[int]],
                         leg: WorkerLeg) -> AsyncIterator[Output]:
        """Stream `request` from `worker` (None: the pool's pick) and, when a worker dies or
        hangs, from another of `pool` (see the module docstring). `streamed`: per choice
        index, the output tokens the client already has (a decode leg starts with prefill's
        first token of each choice it continues)."""
        streamed = {index: list(tokens) for index, tokens in streamed.items()}
        num_given = sum(len(tokens) for tokens in streamed.values())
        open_choices = set(request.choice_indices)  # those that have not ended
        tried: set[str] = set()
        current = request
        for migration in itertools.count():
            if worker is None:
                worker = await self._pick_waiting(pool, tried, current)
            tried.add(worker.address)
            role = worker.role  # (a worker that left its pool has another role by now)
            try:
                async with aclosing(self._stream(worker, current, leg)) as stream:
                    async for output in stream:
                        if output.finish_reason != HANDOFF:
                            streamed.setdefault(output.index, []).extend(output.token_ids)
                            if output.finish_reason is not None:
                                open_choices.discard(output.index)
                        yield output
                return
            except RequestFailed as exc:
                if not _worker_failed(exc) or migration >= self.config.max_migrations:
                    raise
                if not any(w.accepting and w.address not in tried for w in pool):
                    # the pool is empty for now (its workers restarting): wait for one, and
                    # take a restarted one again, a new process at the same address
                    if not await self.wait_for_ready([pool]):
                        raise NoWorkerAvailable(f"no other {role} worker is ready "
                                                f"within {self.config.pool_wait_s:g}s") from exc
                    tried = {a for a in tried
                             if not any(w.address == a and w.accepting for w in pool)}
                num_streamed = sum(len(tokens) for tokens in streamed.values())
                resumed = num_streamed > num_given  # it streamed outputs: resume after them
                if resumed and request.sampling.num_seqs > 1:
                    current = self._resume_choices(request, worker, streamed, open_choices,
                                                   pool, exc)
                    logger.warning("%s worker %s failed after %d tokens of %s (%s); resuming "
                                   "its %d choices on another", role, worker.address,
                                   num_streamed, request.request_id, exc, len(open_choices))
                elif resumed:
                    current = dataclasses.replace(request, handoff=None,
                                                  resume_output_ids=list(streamed[0]))
                    logger.warning("%s worker %s failed after %d tokens of %s (%s); resuming "
                                   "on another", role, worker.address, num_streamed,
                                   request.request_id, exc)
                else:
                    logger.warning("%s worker %s died before its first token of %s (%s); "
                                   "moving the request", role, worker.address,
                                   request.request_id, exc)
                leg.on_migration(Migration(time.monotonic(), role, worker.worker_id,
                                           resumed, str(exc)))
                if self.on_migration is not None:
                    self.on_migration(role, resumed)
                worker = None

    def _resume_choices(self, request: GenerateRequest, worker: WorkerClient,
                        streamed: dict[int, list[int]], open_choices: set[int],
                        pool: list[WorkerClient], exc: Exception) -> GenerateRequest:
        """A request of several sequences whose worker died after outputs: each choice that
        has not ended resumes after its own (GenerateRequest.resume_choices). Not from a
        prefill worker (its choices' first tokens leave with the hand-off's step), nor
        before every open choice has an output; RequestFailed there."""
        choices = {index: list(streamed.get(index, ())) for index in sorted(open_choices)}
        if pool is self.prefill or not all(choices.values()):
            raise RequestFailed(f"{worker.role} worker {worker.address} failed between the "
                                "first outputs of a request with n or best_of > 1, which "
                                f"cannot move then: {exc}") from exc
        return dataclasses.replace(request, handoff=None, resume_output_ids=[],
                                   resume_choices=choices)

    async def wait_for_ready(self, pools: Sequence[list[WorkerClient]]) -> bool:
        """Wait until each of `pools` has a worker that takes requests, at most pool_wait_s
        (a restart); False when one is still empty then. NoWorkerAvailable at once when
        max_pool_waiters requests wait already."""

        def all_ready() -> bool:
            return all(any(w.accepting for w in pool) for pool in pools)

        if all_ready():
            return True
        if self.num_pool_waiters >= self.config.max_pool_waiters:
            raise NoWorkerAvailable(f"no worker is ready, and {self.num_pool_waiters} requests "
                                    "wait for one already (--max-pool-waiters)")
        self.num_pool_waiters += 1
        try:
            return await wait_until(all_ready, self.config.pool_wait_s)
        finally:
            self.num_pool_waiters -= 1

    async def _pick_waiting(self, pool: list[WorkerClient], tried: set[str],
                            request: GenerateRequest) -> WorkerClient:
        """_pick, waiting for a ready worker where the pool has none now (wait_for_ready)."""
        try:
            return self._pick(pool, tried, request)
        except NoWorkerAvailable:
            if not await self.wait_for_ready([pool]):
                raise
            return self._pick(pool, tried, request)

    def _pick(self, pool: list[WorkerClient], tried: set[str], request: GenerateRequest
              ) -> WorkerClient:
        """Where a request goes next: a decode worker by free KV, else the least busy."""
        candidates = [w for w in pool if w.address not in tried]
        if pool is self.decode:
            block_size = max((w.status.block_size for w in pool if w.status), default=16)
            num_tokens = len(request.prompt_token_ids) + len(request.resume_output_ids)
            chosen = self.decode_policy.choose(candidates,
                                               num_blocks_needed_now(num_tokens, block_size))
            keys = self._prompt_keys.get(request.request_id)
            if keys:  # it will hold the prompt: a next turn may be placed there
                self.prefix_index.record(keys, chosen.address)
            return chosen
        ready = [w for w in candidates if w.accepting]
        if not ready:
            raise NoWorkerAvailable("no worker is ready")
        return min(ready, key=lambda w: (w.num_inflight + num_queued(w), w.address))

    async def _stream(self, worker: WorkerClient, request: GenerateRequest, leg: WorkerLeg
                      ) -> AsyncIterator[Output]:
        # Stamped before the send: on a busy host the worker may run before this task does
        # again, and the worker's phases must fall inside the interval the router measures.
        sent_s = time.monotonic()
        queue = await worker.generate(request)
        leg.on_sent(sent_s, worker.worker_id)
        finished = False
        open_choices = set(request.choice_indices)  # each ends with its own finish_reason
        timeout_s = self.config.first_token_timeout_s
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout_s)
                except asyncio.TimeoutError:
                    raise WorkerSilent(
                        f"worker {worker.address} sent nothing for {timeout_s:.0f}s"
                    ) from None
                if isinstance(item, BaseException):
                    finished = True  # the worker is gone; nothing left to abort there
                    raise RequestFailed(str(item)) from item
                item, received_s = item
                if item.staging is not None:  # a note for the router, not an output
                    yield item
                    continue
                leg.on_output(item, received_s)
                if item.error is not None:
                    finished = True
                    raise RequestFailed(item.error)
                timeout_s = self.config.token_timeout_s
                if item.finish_reason is not None:
                    open_choices.discard(item.index)
                    finished = not open_choices
                yield item
                if finished:
                    return
        finally:
            if finished:
                worker.finish(request.request_id)
            else:  # closed early: client gone, timeout, or the caller stopped at the hand-off
                await worker.abort(request.request_id)
