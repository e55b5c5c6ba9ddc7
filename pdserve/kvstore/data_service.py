"""The data service: a TieredStore, its leases and its UCX clients behind the data socket.

    hello bye                        open / close a client's UCX data path
    put get exists evict prefetch    blocks (bytes as ZeroMQ frames, over UCX by tag, or,
                                     for a client on this host, where they lie in the
                                     node's shared memory segment: pdserve/kvstore/shm_segment.py)
    get_layers                       a hand-off node's prompt being staged, layer by layer
                                     as it lands (pdserve/kvstore/live_staging.py)
    pin renew release                pins held by leases with deadlines
    lookup_prefix                    how much of a prefix this node holds
    node_info                        its name and its master (a client pointed at a data
                                     node finds the fleet's master this way)
    stats check                      counters, and store + leases integrity

Every pin is held by exactly one lease: a lease that is released or expires (`tick`) unpins
its blocks, so a crashed client never pins forever. A UCX get replies first and sends the
blocks after the reply is handed on (its Answer's `after_reply`): the client posts its
receives only once it knows their sizes.

Threads: put, get, get_layers, prefetch, hello and bye (`offloaded`) run on the server's
worker threads, since they may wait on the disk, on UCX transfers, on a staging's next layer
or on the address prober; every other verb runs on the socket loop. Three locks, each held
briefly:

    _lease_lock                  the LeaseTable, with the pins its leases hold (taken before
                                 the store's lock: a lease and its pins change together)
    TieredStore's own lock       blocks and pins (disk reads happen outside it)
    _ucx_lock                    the UCX data plane (not thread-safe) and the UCX clients;
                                 held through a transfer, so one transfer at a time; no other
                                 lock is taken under it

A peer's UCX address is checked by a UcxAddressProber child before `connect`: UCX aborts the
process that parses a malformed one.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.lease import Lease, LeaseTable
from pdserve.kvstore.live_staging import LiveStagings, read_layers
from pdserve.kvstore.master import Usage
from pdserve.kvstore.memory_tier import back_to_back_runs, run_view
from pdserve.kvstore.service import Answer, Peer, answer_check
from pdserve.kvstore.shm_segment import ShmArena
from pdserve.kvstore.tiered_store import ChangeListener, TieredStore
from pdserve.kvstore.ucx_prober import UcxAddressProber
from pdserve.kvstore.ucx_transport import UcxDataPlane, UcxUnavailable
from pdserve.protocol.store.base import (
    BlockHolder,
    CheckRequest,
    LookupPrefixReply,
    LookupPrefixRequest,
    StatsReply,
    StatsRequest,
)
from pdserve.protocol.store.data import (
    ByeReply,
    ByeRequest,
    EvictReply,
    EvictRequest,
    ExistsReply,
    ExistsRequest,
    GetLayersReply,
    GetLayersRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    NodeInfoReply,
    NodeInfoRequest,
    PinReply,
    PinRequest,
    PrefetchReply,
    PrefetchRequest,
    PutReply,
    PutRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)

logger = logging.getLogger(__name__)


class DataService:
    name = "data"

    def __init__(self, config: StoreConfig, on_change: ChangeListener | None = None):
        """`on_change(key, tier | None)` hears every placement change (the master's index
        follows it, in process or through a MasterReporter)."""
        self.config = config
        self.store = TieredStore.build(
            config.dram_capacity_blocks, config.disk_capacity_blocks, config.disk_dir,
            on_change=on_change)
        self.leases = LeaseTable()
        self.num_rejected = 0
        self.master_address: str | None = config.master_address
        """The master indexing this node (the server sets it in role all), told to clients
        that ask (node_info)."""
        self.offloaded = frozenset({PutRequest, GetRequest, GetLayersRequest, PrefetchRequest,
                                    HelloRequest, ByeRequest})
        self._lease_lock = threading.Lock()
        self._ucx_lock = threading.Lock()
        self._ucx: UcxDataPlane | None = None
        self._prober: UcxAddressProber | None = None
        if config.transport == "ucx":
            try:
                self._ucx = UcxDataPlane(config.ucx_tls)
                logger.info("store: UCX data plane up (UCX_TLS=%s)", self._ucx.tls)
            except UcxUnavailable as e:
                logger.warning("store: UCX cannot start (%s); KV bytes fall back to "
                               "ZeroMQ over TCP", e)
            else:
                self._prober = UcxAddressProber(self._ucx.tls, config.request_timeout_s)
        self.shm: ShmArena | None = None
        """Where blocks put in process may live, for clients on this host (hand-offs)."""
        if config.shm_bytes:
            try:
                self.shm = ShmArena(config.shm_bytes, f"pdserve-{config.node_id}")
            except OSError as e:
                logger.warning("store: no shared memory segment (%s); clients on this host "
                               "read over UCX", e)
        self.stagings = LiveStagings()
        """Prompts this process is staging now (a hand-off node's worker: get_layers)."""
        self._ucx_clients: dict[bytes, tuple[int, int]] = {}  # zmq identity -> (client_no, ep)
        self._next_client_no = 1
        self.handlers = {
            HelloRequest: self.hello, ByeRequest: self.bye, PutRequest: self.put,
            GetRequest: self.get, GetLayersRequest: self.get_layers, ExistsRequest: self.exists,
            PinRequest: self.pin,
            RenewRequest: self.renew, ReleaseRequest: self.release, EvictRequest: self.evict,
            PrefetchRequest: self.prefetch, StatsRequest: self.stats, CheckRequest: self.check,
            LookupPrefixRequest: self.lookup_prefix, NodeInfoRequest: self.node_info,
        }

    def placements(self) -> list[tuple[bytes, str | None]]:
        """Every block this node holds, with its tier (what the master must learn on join)."""
        return [(key, tier.name) for tier in self.store.tiers
                for key in self.store.keys_in(tier.name)]

    def usage(self) -> Usage:
        """How full this node is, over every tier. Read without the store's lock (counters
        that another thread may be moving: a report a block off is harmless), so that the
        master may ask from under its own lock or from the socket loop."""
        tiers = self.store.tiers
        return Usage(sum(t.capacity_blocks for t in tiers), sum(t.num_blocks for t in tiers),
                     sum(t.num_bytes for t in tiers))

    # ---- loop hooks -------------------------------------------------------------------------
    def tick(self) -> None:
        with self._lease_lock:
            for lease in self.leases.expire():
                logger.info("store: lease %d of %s expired; unpinning %d blocks",
                            lease.lease_id, lease.holder, len(lease.keys))
                self._unpin(lease)

    def start_prober_early(self) -> None:
        """A node whose first clients wait briefly (a worker's hand-off node: decode workers
        give it PEER_TIMEOUT_S) starts its UCX address prober now."""
        if self._prober is not None:
            self._prober.start_early()

    def check_integrity(self) -> None:
        """Store invariants hold and every pin is held by exactly one live lease."""
        self.store.check_integrity()
        if self.shm is not None:
            self.shm.check_integrity()
        with self._lease_lock:
            held, pins = self.leases.num_leased_keys, self.store.num_pins
        if held != pins:
            raise AssertionError(f"{pins} pins but leases hold {held}")

    def close(self) -> None:
        """After the server's threads stopped (or gave up waiting for them)."""
        with self._lease_lock:
            for lease in self.leases.release_all():
                self._unpin(lease)
        self.store.close()
        if self.shm is not None:
            self.shm.close()
        if self._prober is not None:
            self._prober.close()
        if self._ucx is not None:
            with self._ucx_lock:
                self._ucx.close()

    def _unpin(self, lease: Lease) -> None:
        if lease.keys:
            self.store.release(list(lease.keys))
            if self.config.drop_released:
                self.store.evict(list(lease.keys))  # those no other lease pins

    # ---- session ----------------------------------------------------------------------------
    def hello(self, request: HelloRequest, peer: Peer) -> Answer:
        shm = (self.shm.segment if self.shm is not None and request.shm_host
               and request.shm_host == self.shm.segment.host else None)
        if self._ucx is None or request.ucx_address is None:
            return Answer(HelloReply(request.request_id, ucx_address=None, client_no=0, shm=shm))
        assert self._prober is not None
        # UCX aborts the process on a malformed worker address: a child parses it first.
        if not self._prober.is_connectable(request.ucx_address):
            raise ValueError("hello: not a usable UCX worker address")
        with self._ucx_lock:
            if peer.identity in self._ucx_clients:
                self._ucx.disconnect(self._ucx_clients.pop(peer.identity)[1])
            client_no = self._next_client_no
            self._next_client_no += 1
            self._ucx_clients[peer.identity] = (client_no, self._ucx.connect(request.ucx_address))
        return Answer(HelloReply(request.request_id, self._ucx.address, client_no, shm))

    def bye(self, request: ByeRequest, peer: Peer) -> Answer:
        with self._ucx_lock:
            if self._ucx is not None and peer.identity in self._ucx_clients:
                self._ucx.disconnect(self._ucx_clients.pop(peer.identity)[1])
        return Answer(ByeReply(request.request_id))

    def _ucx_endpoint(self, peer: Peer, tag: int) -> int:
        """The endpoint of a client that said hello, if `tag` is one of its tags (call with
        _ucx_lock held)."""
        client = self._ucx_clients.get(peer.identity)
        if self._ucx is None or client is None or tag >> 32 != client[0]:
            raise ValueError("ucx_tag without a UCX hello, or not this client's tag")
        return client[1]

    # ---- blocks -----------------------------------------------------------------------------
    def put(self, request: PutRequest, peer: Peer) -> Answer:
        keys, sizes = request.keys, request.sizes
        if any(size > self.config.max_block_bytes for size in sizes):
            raise ValueError("put: a block is larger than max_block_bytes")
        if request.ucx_tag is not None:
            blocks = [np.empty(size, dtype=np.uint8) for size in sizes]
            with self._ucx_lock:
                self._ucx_endpoint(peer, request.ucx_tag)
                assert self._ucx is not None
                receives = [self._ucx.recv(b, request.ucx_tag + i) for i, b in enumerate(blocks)]
                self._ucx.wait(receives, self.config.request_timeout_s)
            # Fresh buffers nobody else holds: the store keeps them instead of copying.
            stored = self.store.put_many(keys, blocks, adopt=True)
            return Answer(PutReply(request.request_id, stored))
        if len(peer.payloads) != len(keys) or any(
                len(p.buffer) != size for p, size in zip(peer.payloads, sizes, strict=True)):
            raise ValueError("put: one payload frame of the stated size per key")
        # ZeroMQ owns the frames' memory (read-only): the store copies them.
        stored = self.store.put_many(keys, [p.buffer for p in peer.payloads])
        return Answer(PutReply(request.request_id, stored))

    def get(self, request: GetRequest, peer: Peer) -> Answer:
        if request.ucx_tag is not None:
            with self._ucx_lock:  # refuse a stranger's tag before reading anything
                self._ucx_endpoint(peer, request.ucx_tag)
        blocks = self.store.get_many(request.keys)
        present = [b for b in blocks if b is not None]
        found = [b is not None for b in blocks]
        sizes = [b.nbytes if b is not None else 0 for b in blocks]
        if request.shm and self.shm is not None and present:
            # where each block lies in the segment, if they all do (a hand-off's do): the
            # client copies them out itself, once, and checks they were not freed meanwhile
            spans = self.shm.locate_blocks(present)
            if spans is not None:
                return Answer(GetReply(request.request_id, found, sizes, shm_spans=spans))
        if request.ucx_tag is None:
            return Answer(GetReply(request.request_id, found, sizes),
                          [b.numpy() for b in present])
        # one message per run of blocks that lie back to back (a hand-off's staged blocks
        # do): each message costs a rendezvous, whatever its size
        runs = back_to_back_runs(present)
        arrays = [run_view(present[start:stop]).numpy() for start, stop in runs]
        reply = GetReply(request.request_id, found, sizes,
                         runs=[stop - start for start, stop in runs])
        tag = request.ucx_tag
        return Answer(reply, after_reply=lambda: self._send_over_ucx(peer, tag, arrays))

    def get_layers(self, request: GetLayersRequest, peer: Peer) -> Answer:
        if request.ucx_tag is not None:
            with self._ucx_lock:  # refuse a stranger's tag before reading anything
                self._ucx_endpoint(peer, request.ucx_tag)
        num_layers, payload, gone = read_layers(self.stagings, self.store.get_many, request)
        reply = GetLayersReply(request.request_id, num_layers,
                               0 if payload is None else payload.nbytes, gone)
        if payload is None:
            return Answer(reply)
        arrays = [payload.reshape(-1)]
        if request.ucx_tag is None:
            return Answer(reply, arrays)
        tag = request.ucx_tag
        return Answer(reply, after_reply=lambda: self._send_over_ucx(peer, tag, arrays))

    def _send_over_ucx(self, peer: Peer, tag: int, arrays: list[np.ndarray]) -> None:
        """A UCX get's blocks, once its reply is on the way (tags match in any order)."""
        with self._ucx_lock:
            try:
                endpoint = self._ucx_endpoint(peer, tag)
            except ValueError:
                logger.warning("store: a client said bye before taking its UCX get")
                return
            assert self._ucx is not None
            sends = [self._ucx.send(endpoint, a, tag + i) for i, a in enumerate(arrays)]
            try:
                self._ucx.wait(sends, self.config.request_timeout_s)
            except TimeoutError:
                logger.warning("store: a client did not take its UCX get within %.1f s",
                               self.config.request_timeout_s)

    def exists(self, request: ExistsRequest, peer: Peer) -> Answer:
        return Answer(ExistsReply(request.request_id,
                                  [self.store.exists(k) for k in request.keys]))

    def evict(self, request: EvictRequest, peer: Peer) -> Answer:
        return Answer(EvictReply(request.request_id, self.store.evict(request.keys)))

    def prefetch(self, request: PrefetchRequest, peer: Peer) -> Answer:
        return Answer(PrefetchReply(request.request_id, self.store.prefetch(request.keys)))

    def lookup_prefix(self, request: LookupPrefixRequest, peer: Peer) -> Answer:
        """This node's view only (the master has the fleet's). A block that leaves between
        the count and its tier ends the prefix there (other threads move blocks)."""
        num_blocks = self.store.lookup_prefix(request.keys)
        holders = []
        for key in request.keys[:num_blocks]:
            tier = self.store.tier_of(key)
            if tier is None:
                break
            holders.append([BlockHolder(self.config.node_id, tier)])
        return Answer(LookupPrefixReply(request.request_id, len(holders), holders))

    def node_info(self, request: NodeInfoRequest, peer: Peer) -> Answer:
        return Answer(NodeInfoReply(request.request_id, self.config.node_id,
                                    self.master_address))

    # ---- leases -----------------------------------------------------------------------------
    def pin(self, request: PinRequest, peer: Peer) -> Answer:
        with self._lease_lock:
            pinned = self.store.pin(request.keys)
            keys = [k for k, ok in zip(request.keys, pinned, strict=True) if ok]
            lease = self.leases.acquire(request.holder, keys, request.ttl_s)
        return Answer(PinReply(request.request_id, lease.lease_id, pinned))

    def renew(self, request: RenewRequest, peer: Peer) -> Answer:
        with self._lease_lock:
            known = self.leases.renew(request.lease_id, request.ttl_s)
        return Answer(RenewReply(request.request_id, known))

    def release(self, request: ReleaseRequest, peer: Peer) -> Answer:
        with self._lease_lock:
            lease = self.leases.release(request.lease_id)
            if lease is not None:
                self._unpin(lease)
        return Answer(ReleaseReply(request.request_id, lease is not None))

    # ---- introspection ----------------------------------------------------------------------
    def stats(self, request: StatsRequest, peer: Peer) -> Answer:
        stats = dict(self.store.stats())
        with self._lease_lock:
            num_leases = self.leases.num_leases
        usage = self.usage()
        stats.update(num_leases=num_leases, num_rejected=self.num_rejected,
                     capacity_blocks=usage.capacity_blocks, num_bytes=usage.num_bytes)
        return Answer(StatsReply(request.request_id, stats))

    def check(self, request: CheckRequest, peer: Peer) -> Answer:
        return answer_check(request, self.check_integrity)
