"""The router's live view of the fleet: the registry (pdserve/discovery.py) applied to the
dispatcher's worker pools.

    etcd ──watch──► RegistryWatch (thread) ──records──► FleetWatch.apply (event loop)
                                                          │
                    joined:  a WorkerClient in the pool of its registered role
                    left:    out of its pool at once (no new requests), draining; its client
                             is closed once the requests it holds have finished
                    store-master record: the prefix lookups' master (unless --store-master)

A worker that leaves gracefully (SIGTERM) withdraws its record, then finishes what it holds:
its requests stream on from the client kept here. A worker that dies drops its connection,
and its requests move at once through the dispatcher's migration path (pdserve/router/dispatch.py);
its record goes when its lease expires. A router holds no state the fleet needs beyond this
view, so any number of routers serve one fleet, and a restarted router finds every worker
on its first read of the registry. The router registers itself too (role `router`), so
tools see every front door.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from pdserve.addresses import reachable
from pdserve.discovery import (
    WORKER_ROLES,
    DiscoveryError,
    DiscoveryURL,
    Record,
    Registration,
    RegistryWatch,
)
from pdserve.router.prefix_index import StoreLookup

if TYPE_CHECKING:
    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.worker_client import WorkerClient

logger = logging.getLogger(__name__)

LEAVE_DRAIN_TIMEOUT_S = 600.0
"""A worker gone from the registry keeps its client at most this long for the requests it
holds (each also bounded by the router's token timeouts)."""
POLL_S = 0.1


class FleetWatch:
    def __init__(self, dispatcher: Dispatcher, url: str, ttl_s: float) -> None:
        self.dispatcher = dispatcher
        self.url = DiscoveryURL.parse(url)
        self.ttl_s = ttl_s
        self.watch = RegistryWatch(self.url, on_change=self._on_change)
        self.num_joined = 0
        self.num_left = 0
        self._leaving: dict[str, WorkerClient] = {}  # address -> client, draining
        self._tasks: set[asyncio.Task] = set()
        self._registration: Registration | None = None
        self._store_master: str | None = None  # the master the prefix lookups ask
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.watch.start()
        self._spawn(asyncio.to_thread(self._register))

    async def close(self) -> None:
        await asyncio.to_thread(self.watch.stop)
        if self._registration is not None:
            await asyncio.to_thread(self._registration.withdraw)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for worker in self._leaving.values():
            await worker.close()
        self._leaving.clear()

    def _register(self) -> None:
        config = self.dispatcher.config
        record = Record("router", reachable(f"http://{config.host}:{config.port}"),
                        name=f"router@{config.host}:{config.port}",
                        model=config.served_model_name or os.path.basename(
                            config.model.rstrip("/")))
        registration = Registration(self.url, record, self.ttl_s)
        try:
            self._registration = registration.start()
        except DiscoveryError as exc:  # it serves anyway; the workers are what matters
            logger.warning("the router could not register itself: %s", exc)

    def _on_change(self, records: dict[str, Record]) -> None:
        """From the watch thread: apply on the event loop, where the pools live."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.apply, records)

    # ---- applying the registry ----------------------------------------------------------
    def apply(self, records: dict[str, Record]) -> None:
        """Make the pools match the registry's workers (static ones stay), and follow the
        store master."""
        dispatcher, config = self.dispatcher, self.dispatcher.config
        registered = {r.address: r for r in records.values() if r.role in WORKER_ROLES}
        static = {*config.prefill_addrs, *config.decode_addrs, *config.colocated_addrs}
        for worker in list(dispatcher.workers):
            if worker.address not in registered and worker.address not in static:
                self._leave(worker)
        known = {w.address: w for w in dispatcher.workers}
        for address, record in sorted(registered.items()):
            worker = known.get(address)
            if worker is None:
                self._join(record)
            elif worker.role != record.role and not worker.draining:
                # flipped by another router's controller (its record follows its role); a
                # worker this router is flipping is draining and moves when flip_one says
                self._move(worker, record.role)
        if config.store_master_addr is None:
            masters = sorted(r.address for r in records.values() if r.role == "store-master")
            self._follow_store_master(masters[0] if masters else None)

    def _join(self, record: Record) -> None:
        worker = self._leaving.pop(record.address, None)
        if worker is not None:  # back before it drained (a restart, a lease renewed late)
            worker.draining = False
        else:
            worker = self.dispatcher.new_worker(record.address, record.role)
            worker.start()
        worker.role = record.role
        self.dispatcher.pool(record.role).append(worker)
        self.num_joined += 1
        logger.info("worker %s (%s, %s) joined from the registry", record.name or
                    record.address, record.role, record.address)

    def _move(self, worker: WorkerClient, role: str) -> None:
        self._remove_from_pools(worker)
        logger.info("worker %s moved from %s to %s (its registry record)", worker.worker_id,
                    worker.role, role)
        worker.role = role
        self.dispatcher.pool(role).append(worker)

    def _remove_from_pools(self, worker: WorkerClient) -> None:
        for pool in (self.dispatcher.prefill, self.dispatcher.decode,
                     self.dispatcher.colocated):
            if worker in pool:
                pool.remove(worker)

    def _leave(self, worker: WorkerClient) -> None:
        self._remove_from_pools(worker)
        worker.draining = True
        self._leaving[worker.address] = worker
        self.num_left += 1
        logger.info("worker %s (%s) left the registry; %d requests still on it",
                    worker.worker_id, worker.address, worker.num_inflight)
        self._spawn(self._retire(worker))

    async def _retire(self, worker: WorkerClient) -> None:
        """Close a departed worker's client once it holds nothing (or the drain runs out)."""
        deadline = time.monotonic() + LEAVE_DRAIN_TIMEOUT_S
        while worker.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self._leaving.get(worker.address) is worker:
            del self._leaving[worker.address]
            await worker.close()

    def _follow_store_master(self, address: str | None) -> None:
        if address == self._store_master:
            return
        dispatcher = self.dispatcher
        if dispatcher.store_lookup is not None:
            dispatcher.store_lookup.close()
            dispatcher.store_lookup = None
        if address is not None:
            dispatcher.store_lookup = StoreLookup(address)
            logger.info("prefix lookups ask the store master at %s", address)
        self._store_master = address

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def snapshot(self) -> dict[str, object]:
        """What /status shows of the registry."""
        return {"url": str(self.url), "synced": self.watch.is_synced,
                "num_joined": self.num_joined, "num_left": self.num_left,
                "leaving": sorted(self._leaving)}
