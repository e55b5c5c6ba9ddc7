"""The master service: the Master (master.py) behind the master socket, one handler per verb.

    join heartbeat leave update    data nodes' membership, usage and placement reports
    lookup_prefix locate nodes     what routers and workers ask: where blocks are cached
    place                          where a client should write new blocks
    lease_group take_lease_group   one id for the node leases pinning a batch
    stats check                    counters (fleet and per node) and the index's integrity

It holds no blocks and pins nothing (a lease group only names node leases). In role `all`
the data node of the same process is joined here directly (`join_local`): its placement
changes arrive by `record_local`, and each loop turn heartbeats it with its usage, since no
reporter thread speaks for it.

Every handler is cheap (in-memory index) and runs on the socket loop, never behind data-plane
work. `record_local` runs on whichever data-service thread changed a placement (inside the
store's lock), so one lock guards the Master; nothing taken under it takes another lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pdserve.kvstore.master import Master, Usage
from pdserve.kvstore.service import Answer, Peer, answer_check
from pdserve.protocol.store.base import (
    BlockHolder,
    CheckRequest,
    LookupPrefixReply,
    LookupPrefixRequest,
    StatsReply,
    StatsRequest,
)
from pdserve.protocol.store.master import (
    BlockCopy,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaseGroupReply,
    LeaseGroupRequest,
    LeaveReply,
    LeaveRequest,
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
    UpdateReply,
    UpdateRequest,
)


def _usage(usage: NodeUsage | None) -> Usage | None:
    if usage is None:
        return None
    return Usage(usage.capacity_blocks, usage.num_blocks, usage.num_bytes)


class MasterService:
    name = "master"

    def __init__(self, master: Master):
        self.master = master
        self.num_rejected = 0
        self.offloaded: frozenset[type] = frozenset()
        self._lock = threading.Lock()  # the Master, against record_local from data threads
        self._local_node_id: str | None = None
        self._local_usage: Callable[[], Usage] | None = None
        self._wire: dict[tuple[str, str], BlockHolder] = {}
        """(node_id, tier) -> its BlockHolder: a reply names the same few holders for every
        block, and a frozen message can be shared rather than built (and checked) per block."""
        self.handlers = {
            JoinRequest: self.join, HeartbeatRequest: self.heartbeat, LeaveRequest: self.leave,
            UpdateRequest: self.update, LookupPrefixRequest: self.lookup_prefix,
            LocateRequest: self.locate, PlaceRequest: self.place,
            LeaseGroupRequest: self.lease_group, TakeLeaseGroupRequest: self.take_lease_group,
            NodesRequest: self.nodes, StatsRequest: self.stats, CheckRequest: self.check,
        }

    # ---- the data node of this process ----------------------------------------------------------
    def join_local(self, node_id: str, address: str,
                   placements: Sequence[tuple[bytes, str | None]],
                   usage: Callable[[], Usage] | None = None) -> None:
        """Join the in-process data node with what it holds already (re-indexed from disk);
        `usage()` is asked each loop turn how full it is."""
        with self._lock:
            self._local_node_id = node_id
            self._local_usage = usage
            self.master.join(node_id, address, None if usage is None else usage())
            self.master.update(node_id, placements)

    def record_local(self, key: bytes, tier: str | None) -> None:
        assert self._local_node_id is not None, "join_local first"
        with self._lock:
            self.master.update(self._local_node_id, [(key, tier)])

    # ---- loop hooks -------------------------------------------------------------------------
    def tick(self) -> None:
        # Outside our lock: usage() takes the store's lock, under which record_local takes
        # ours (the one lock order is store -> master).
        usage = None if self._local_usage is None else self._local_usage()
        with self._lock:
            if self._local_node_id is not None:  # before expiring: it is alive
                self.master.heartbeat(self._local_node_id, usage)
                # (the node in this process copies nothing: its share of re-replication
                # is dropped, and those blocks stay under their replicas)
                self.master.take_copies(self._local_node_id, limit=1 << 30)
            self.master.expire_nodes()

    def check_integrity(self) -> None:
        with self._lock:
            self.master.check_integrity()

    def close(self) -> None:
        pass

    # ---- handlers ---------------------------------------------------------------------------
    def join(self, request: JoinRequest, peer: Peer) -> Answer:
        with self._lock:
            self.master.join(request.node_id, request.address, _usage(request.usage))
        return Answer(JoinReply(request.request_id))

    def heartbeat(self, request: HeartbeatRequest, peer: Peer) -> Answer:
        with self._lock:
            known = self.master.heartbeat(request.node_id, _usage(request.usage))
            copies = self.master.take_copies(request.node_id) if known else []
        return Answer(HeartbeatReply(request.request_id, known,
                                     [BlockCopy(key, target) for key, target in copies]))

    def leave(self, request: LeaveRequest, peer: Peer) -> Answer:
        with self._lock:
            self.master.leave(request.node_id)
        return Answer(LeaveReply(request.request_id))

    def update(self, request: UpdateRequest, peer: Peer) -> Answer:
        changes = [(change.key, change.tier) for change in request.changes]
        with self._lock:
            known = self.master.update(request.node_id, changes)
        return Answer(UpdateReply(request.request_id, known))

    def lookup_prefix(self, request: LookupPrefixRequest, peer: Peer) -> Answer:
        with self._lock:
            found = self.master.lookup_prefix(request.keys)
        return Answer(LookupPrefixReply(request.request_id, found.num_blocks,
                                        self._wire_holders(found.holders), found.addresses))

    def locate(self, request: LocateRequest, peer: Peer) -> Answer:
        with self._lock:
            holders, addresses = self.master.locate(request.keys)
        return Answer(LocateReply(request.request_id, self._wire_holders(holders), addresses))

    def place(self, request: PlaceRequest, peer: Peer) -> Answer:
        with self._lock:
            targets, held, addresses = self.master.place(request.keys)
        return Answer(PlaceReply(request.request_id, targets, held, addresses))

    def lease_group(self, request: LeaseGroupRequest, peer: Peer) -> Answer:
        with self._lock:
            lease_id = self.master.add_lease_group(
                [(lease.node_id, lease.lease_id) for lease in request.node_leases],
                request.ttl_s)
        return Answer(LeaseGroupReply(request.request_id, lease_id))

    def take_lease_group(self, request: TakeLeaseGroupRequest, peer: Peer) -> Answer:
        with self._lock:
            known, leases, addresses = self.master.take_lease_group(request.lease_id)
        return Answer(TakeLeaseGroupReply(
            request.request_id, known, [NodeLease(n, i) for n, i in leases], addresses))

    def nodes(self, request: NodesRequest, peer: Peer) -> Answer:
        with self._lock:
            nodes, usage = self.master.nodes(), self.master.usage()
        return Answer(NodesReply(request.request_id, nodes, {
            node_id: NodeUsage(u.capacity_blocks, u.num_blocks, u.num_bytes)
            for node_id, u in usage.items()}))

    def stats(self, request: StatsRequest, peer: Peer) -> Answer:
        with self._lock:
            stats = self.master.stats()
        stats["num_rejected"] = self.num_rejected
        return Answer(StatsReply(request.request_id, stats))

    def check(self, request: CheckRequest, peer: Peer) -> Answer:
        return answer_check(request, self.check_integrity)

    def _wire_holders(self, holders: list[list[tuple[str, str]]]) -> list[list[BlockHolder]]:
        wire = self._wire
        out = []
        for hs in holders:
            row = []
            for holder in hs:
                message = wire.get(holder)
                if message is None:
                    message = wire[holder] = BlockHolder(*holder)
                row.append(message)
            out.append(row)
        return out
