"""The fleet client: the store's batch verbs across every data node its master indexes.

    put_many ──place(keys)──► master: targets per key ──put──► each target node (in parallel)
    get_many ──locate(keys)─► master: holders per key ──get──► the first live holder of each;
                              a block a holder fails to give is asked of its next holder
    lookup_prefix ──────────► master (fleet-wide, as the router asks)
    pin ──locate──► each holder pins its blocks ──lease_group──► master: one fleet lease id
    release(id) ──take_lease_group──► master ──release──► each node's lease

The master picks where new blocks go (pdserve/kvstore/master.py: least full nodes, `--replicas`
distinct ones); the data nodes then report what they stored, as they always do, so the index
never names a block a write did not deliver. Each node is reached with a StoreClient of its
own (UCX where both sides have it, else ZeroMQ frames). A node that fails a request (dead,
unreachable, timed out) is not asked again for `node_hold_s`: its writes count as not stored
and its blocks as missing, and the request recomputes (the KV cache is a cache). A master
that does not answer is not asked again for `master_hold_s`: meanwhile every verb fails at once
with StoreUnavailable (a miss), instead of each waiting out the timeout again on a worker's
engine loop, which would stall its requests and its heartbeats for the whole outage. Reads try
the client's home node first when it holds a block (the data node the worker was pointed
at: the nearest one), then the others, fastest tier first.

`connect_store` picks the client a worker uses: a FleetClient when a master is known (named,
or the master of the data node named, asked with `node_info`), else a plain StoreClient of
the one data node, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import zmq

from pdserve.kvstore.channel import ControlChannel, StoreRequestError, StoreUnavailable
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.master import PrefixLookup
from pdserve.kvstore.memory_tier import BytesLike
from pdserve.protocol.store.base import (
    CheckReply,
    CheckRequest,
    LookupPrefixReply,
    LookupPrefixRequest,
    StatsReply,
    StatsRequest,
)
from pdserve.protocol.store.data import NodeInfoReply, NodeInfoRequest
from pdserve.protocol.store.master import (
    LeaseGroupReply,
    LeaseGroupRequest,
    LocateReply,
    LocateRequest,
    NodeLease,
    NodesReply,
    NodesRequest,
    NodeUsage,
    PlaceReply,
    PlaceRequest,
    TakeLeaseGroupReply,
    TakeLeaseGroupRequest,
)

logger = logging.getLogger(__name__)

NODE_HOLD_S = 10.0
"""A node that failed a request is not asked again for this long (the master drops a dead
node after its node_ttl_s, 10 s by default)."""
MASTER_HOLD_S = 5.0
"""A master that did not answer is not asked again for this long (a restart takes seconds)."""
MAX_PARALLEL_NODES = 8
"""Data nodes written to or read from at once by one batch."""

LOCATE_SETTLE_S = 0.05
"""How long get_many keeps asking the master about keys it did not know at the first ask. The
index follows the data nodes' own reports, which trail a write by the reporter's flush delay
(pdserve/kvstore/master_reporter.py, 5 ms) and a round trip, so a block written just before the read
(a hand-off: prefill puts, decode gets at once) may not be indexed yet."""
LOCATE_RETRY_S = 0.01

T = TypeVar("T")


class FleetClient:
    """Thread-safe: node clients serialise their own requests, the master channel its own."""

    def __init__(self, master_address: str, transport: str = "ucx",
                 ucx_tls: str = "sm,cma,tcp,self", timeout_s: float = 10.0,
                 holder: str | None = None, home_address: str | None = None,
                 max_keys_per_request: int = 1024, node_hold_s: float = NODE_HOLD_S,
                 master_hold_s: float = MASTER_HOLD_S):
        self._ctx = zmq.Context()
        self._master = ControlChannel(self._ctx, master_address, timeout_s)
        self.master_address = master_address
        self.transport = transport
        """What each node's client asks for (one falls back to ZeroMQ, with a warning, where
        a node has no UCX)."""
        self.ucx_tls = ucx_tls
        self.timeout_s = timeout_s
        self.holder = holder
        self.home_address = home_address
        self.max_keys_per_request = max_keys_per_request
        self.node_hold_s = node_hold_s
        self.master_hold_s = master_hold_s
        self._master_failed_s: float | None = None
        self._nodes: dict[str, StoreClient] = {}  # data-server address -> its client
        self._failed_s: dict[str, float] = {}  # address -> when it last failed
        self._lock = threading.Lock()  # the two maps above and _master_failed_s
        self._pool = ThreadPoolExecutor(MAX_PARALLEL_NODES, thread_name_prefix="fleet-client")

    # ---- the master -------------------------------------------------------------------------
    def _ask_master(self, request_type: type, reply_type: type[T], **fields: Any) -> T:
        """The master's reply; StoreUnavailable at once while it is held off."""
        with self._lock:
            failed_s = self._master_failed_s
        if failed_s is not None and time.monotonic() - failed_s < self.master_hold_s:
            raise StoreUnavailable(f"master {self.master_address} did not answer "
                                   f"{time.monotonic() - failed_s:.1f} s ago: not asked again "
                                   f"for {self.master_hold_s:.0f} s")
        try:
            return self._master.request(request_type, reply_type, **fields)
        except StoreUnavailable as e:
            with self._lock:
                self._master_failed_s = time.monotonic()
            logger.warning("fleet store: %s; not asked again for %.0f s", e, self.master_hold_s)
            raise

    # ---- nodes ------------------------------------------------------------------------------
    def _node(self, address: str) -> StoreClient:
        with self._lock:
            client = self._nodes.get(address)
        if client is not None:
            return client
        # Outside the lock: a UCX hello may take a while, and other nodes need not wait.
        client = StoreClient(address, transport=self.transport, ucx_tls=self.ucx_tls,
                             timeout_s=self.timeout_s, holder=self.holder,
                             max_keys_per_request=self.max_keys_per_request)
        with self._lock:
            if address in self._nodes:  # another thread connected meanwhile
                extra, client = client, self._nodes[address]
            else:
                self._nodes[address], extra = client, None
        if extra is not None:
            extra.close()
        return client

    def is_held_off(self, address: str) -> bool:
        """True while a node that failed a request is not asked again."""
        with self._lock:
            failed_s = self._failed_s.get(address)
        return failed_s is not None and time.monotonic() - failed_s < self.node_hold_s

    def _node_failed(self, address: str, error: Exception) -> None:
        logger.warning("fleet store: data node %s failed (%s); not asked again for %.0f s",
                       address, error, self.node_hold_s)
        with self._lock:
            self._failed_s[address] = time.monotonic()
            client = self._nodes.pop(address, None)
        if client is not None:
            try:
                client.close()
            except Exception:  # it failed already; closing is best effort
                logger.debug("fleet store: closing the client of %s failed", address,
                             exc_info=True)

    def _on_nodes(self, groups: dict[str, list[int]],
                  verb: Callable[[StoreClient, list[int]], T]) -> dict[str, T | None]:
        """`verb(client, indices)` on every node of `groups` (in parallel when several);
        None for a node held off or failing."""
        def run(address: str) -> T | None:
            if self.is_held_off(address):
                return None
            try:
                return verb(self._node(address), groups[address])
            except Exception as e:  # a node's failure is a miss, never a failed request
                self._node_failed(address, e)
                return None

        addresses = list(groups)
        if len(addresses) == 1:
            return {addresses[0]: run(addresses[0])}
        return dict(zip(addresses, self._pool.map(run, addresses), strict=True))

    def _chunks(self, num_keys: int) -> range:
        return range(0, num_keys, self.max_keys_per_request)

    def _locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Per key: its holders' addresses, the order to read them in (home node first)."""
        ordered: list[list[str]] = []
        for start in self._chunks(len(keys)):
            chunk = list(keys[start:start + self.max_keys_per_request])
            reply = self._ask_master(LocateRequest, LocateReply, keys=chunk)
            if len(reply.holders) != len(chunk):
                raise ValueError("locate: one holder list per key expected")
            for holders in reply.holders:
                addresses = [reply.addresses[h.node_id] for h in holders
                             if h.node_id in reply.addresses]
                addresses.sort(key=lambda a: a != self.home_address)  # stable: tiers kept
                ordered.append(addresses)
        return ordered

    # ---- data verbs -------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[BytesLike]) -> list[bool]:
        """Write blocks where the master places them; one bool per key (True: some node
        stored it now, or held it already; False: no live node took it)."""
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        stored = [False] * len(keys)
        first: dict[bytes, int] = {}
        for start in self._chunks(len(keys)):
            chunk = list(keys[start:start + self.max_keys_per_request])
            reply = self._ask_master(PlaceRequest, PlaceReply, keys=chunk)
            if len(reply.targets) != len(chunk):
                raise ValueError("place: one target list per key expected")
            groups: dict[str, list[int]] = {}
            for offset, (targets, held) in enumerate(zip(reply.targets, reply.held,
                                                         strict=True)):
                i = start + offset
                first.setdefault(keys[i], i)
                stored[i] = held
                for node_id in targets:
                    address = reply.addresses.get(node_id)
                    if address is not None:
                        groups.setdefault(address, []).append(i)
            results = self._on_nodes(groups, lambda client, indices: client.put_many(
                [keys[i] for i in indices], [blocks[i] for i in indices]))
            for address, oks in results.items():
                for i, ok in zip(groups[address], oks or [], strict=False):
                    stored[i] = stored[i] or ok
        # a key twice in one batch was written once: the later copies share its outcome
        return [stored[first[k]] or ok for k, ok in zip(keys, stored, strict=True)]

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The blocks (uint8 arrays), None for each that no live holder gave."""
        found: list[np.ndarray | None] = [None] * len(keys)
        located = self._locate(keys)
        deadline_s = time.monotonic() + LOCATE_SETTLE_S
        while (unknown := [i for i, holders in enumerate(located) if not holders]) \
                and time.monotonic() < deadline_s:
            time.sleep(LOCATE_RETRY_S)
            for i, holders in zip(unknown, self._locate([keys[i] for i in unknown]),
                                  strict=True):
                located[i] = holders
        candidates = {i: holders for i, holders in enumerate(located) if holders}
        while candidates:  # one round per replica at most
            groups: dict[str, list[int]] = {}
            for i, holders in candidates.items():
                groups.setdefault(holders.pop(0), []).append(i)
            results = self._on_nodes(groups, lambda client, indices: client.get_many(
                [keys[i] for i in indices]))
            for address, blocks in results.items():
                for i, block in zip(groups[address], blocks or [], strict=False):
                    if block is not None:
                        found[i] = block
            candidates = {i: hs for i, hs in candidates.items() if found[i] is None and hs}
        return found

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Some live node holds it (by the master's index)."""
        return [bool(holders) for holders in self._locate(keys)]

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        """Leading blocks some live node holds, and where (the master's index)."""
        reply = self._ask_master(LookupPrefixRequest, LookupPrefixReply, keys=list(keys))
        if reply.num_blocks > len(keys):
            raise ValueError("lookup_prefix: more blocks found than asked for")
        holders = [[(h.node_id, h.tier) for h in hs] for hs in reply.holders]
        return PrefixLookup(reply.num_blocks, holders, dict(reply.addresses))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Bring blocks up to DRAM on the holder a read will ask first."""
        groups: dict[str, list[int]] = {}
        for i, holders in enumerate(self._locate(keys)):
            if holders:
                groups.setdefault(holders[0], []).append(i)
        results = self._on_nodes(groups, lambda client, indices: client.prefetch(
            [keys[i] for i in indices]))
        return sum(n or 0 for n in results.values())

    def evict(self, keys: Sequence[bytes]) -> int:
        """Drop unpinned blocks from every holder; the number of copies dropped."""
        groups = self._by_holder(keys)
        results = self._on_nodes(groups, lambda client, indices: client.evict(
            [keys[i] for i in indices]))
        return sum(n or 0 for n in results.values())

    def _by_holder(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, holders in enumerate(self._locate(keys)):
            for address in holders:
                groups.setdefault(address, []).append(i)
        return groups

    # ---- leases -----------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bool]]:
        """Pin every copy of the blocks under node leases, filed at the master as one
        fleet lease: (its id, pinned per key: some holder pinned it)."""
        groups = self._by_holder(keys)
        results = self._on_nodes(groups, lambda client, indices: client.pin(
            [keys[i] for i in indices], ttl_s))
        pinned = [False] * len(keys)
        node_leases: list[NodeLease] = []
        node_ids = self._node_ids()
        for address, result in results.items():
            if result is None:
                continue
            lease_id, oks = result
            for i, ok in zip(groups[address], oks, strict=False):
                pinned[i] = pinned[i] or ok
            if address in node_ids and any(oks):
                node_leases.append(NodeLease(node_ids[address], lease_id))
            else:  # nothing pinned there (or the node left): give the empty lease back
                self._release_on(address, lease_id)
        reply = self._ask_master(LeaseGroupRequest, LeaseGroupReply,
                                     node_leases=node_leases, ttl_s=float(ttl_s))
        return reply.lease_id, pinned

    def release(self, lease_id: int) -> bool:
        """End a fleet lease: every node lease in it is released (those of nodes gone died
        with them); False if the master no longer knew it (expired or released)."""
        reply = self._ask_master(TakeLeaseGroupRequest, TakeLeaseGroupReply,
                                     lease_id=lease_id)
        for lease in reply.node_leases:
            address = reply.addresses.get(lease.node_id)
            if address is not None:
                self._release_on(address, lease.lease_id)
        return reply.known

    def _release_on(self, address: str, lease_id: int) -> None:
        self._on_nodes({address: []}, lambda client, _: client.release(lease_id))

    def _node_ids(self) -> dict[str, str]:
        """address -> node id of every live node."""
        return {address: node_id for node_id, address in self.nodes().items()}

    # ---- introspection ----------------------------------------------------------------------
    def nodes(self) -> dict[str, str]:
        """node_id -> data-server address of every live node."""
        return dict(self._ask_master(NodesRequest, NodesReply).nodes)

    def usage(self) -> dict[str, NodeUsage]:
        """node_id -> capacity, blocks and bytes as each node last reported them."""
        return dict(self._ask_master(NodesRequest, NodesReply).usage)

    def stats(self) -> dict[str, int]:
        """The master's counters: fleet totals and per node (`num_bytes.<node_id>`, ...)."""
        return dict(self._ask_master(StatsRequest, StatsReply).stats)

    def check_integrity(self) -> None:
        """AssertionError naming the first server (master, then each live node) whose
        invariants do not hold."""
        reply = self._ask_master(CheckRequest, CheckReply)
        if reply.problem is not None:
            raise AssertionError(f"{self.master_address}: {reply.problem}")
        for address in sorted(self.nodes().values()):
            self._node(address).check_integrity()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._nodes = list(self._nodes.values()), {}
        for client in clients:
            client.close()
        self._master.close()
        self._ctx.term()


def master_of(data_address: str, timeout_s: float) -> str | None:
    """The master the data node at `data_address` reports to; None when it has none, or
    cannot say (unreachable: the caller then treats it as a node on its own)."""
    ctx = zmq.Context()
    channel = ControlChannel(ctx, data_address, timeout_s)
    try:
        return channel.request(NodeInfoRequest, NodeInfoReply).master_address
    except (StoreUnavailable, StoreRequestError) as e:
        logger.warning("store: data node %s did not name its master (%s); using it alone",
                       data_address, e)
        return None
    finally:
        channel.close()
        ctx.term()


def connect_store(data_address: str | None, master_address: str | None = None,
                  **client_args: Any) -> StoreClient | FleetClient:
    """A worker's fleet store: every data node the master indexes when a master is known
    (given, or the one `data_address` reports to), reading from `data_address` first; else
    the one data node at `data_address`. `client_args`: transport, ucx_tls, timeout_s,
    holder."""
    if master_address is None and data_address is not None:
        master_address = master_of(data_address, client_args.get("timeout_s", 10.0))
    if master_address is not None:
        return FleetClient(master_address, home_address=data_address, **client_args)
    return StoreClient(data_address, **client_args)
