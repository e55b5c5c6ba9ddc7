"""The master service: the Master (master.py) behind the master socket, one handler per verb.

    join heartbeat leave update    data nodes' membership and placement reports
    lookup_prefix nodes            what routers and workers ask: where a prefix is cached
    stats check                    counters and the index's integrity

It holds no blocks and no leases. In role `all` the data node of the same process is joined
here directly (`join_local`): its placement changes arrive by `record_local`, and each loop
turn heartbeats it, since no reporter thread speaks for it.

Every handler is cheap (in-memory index) and runs on the socket loop, never behind data-plane
work. `record_local` runs on whichever data-service thread changed a placement (inside the
store's lock), so one lock guards the Master; nothing taken under it takes another lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pdserve.kvstore.master import Master
from pdserve.kvstore.service import Answer, Peer, answer_check
from pdserve.protocol.store import (
    BlockHolder,
    CheckRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    LookupPrefixReply,
    LookupPrefixRequest,
    NodesReply,
    NodesRequest,
    StatsReply,
    StatsRequest,
    UpdateReply,
    UpdateRequest,
)


class MasterService:
    name = "master"

    def __init__(self, master: Master):
        self.master = master
        self.num_rejected = 0
        self.offloaded: frozenset[type] = frozenset()
        self._lock = threading.Lock()  # the Master, against record_local from data threads
        self._local_node_id: str | None = None
        self.handlers = {
            JoinRequest: self.join, HeartbeatRequest: self.heartbeat, LeaveRequest: self.leave,
            UpdateRequest: self.update, LookupPrefixRequest: self.lookup_prefix,
            NodesRequest: self.nodes, StatsRequest: self.stats, CheckRequest: self.check,
        }

    # ---- the data node of this process ----------------------------------------------------------
    def join_local(self, node_id: str, address: str,
                   placements: Sequence[tuple[bytes, str | None]]) -> None:
        """Join the in-process data node with what it holds already (re-indexed from disk)."""
        with self._lock:
            self._local_node_id = node_id
            self.master.join(node_id, address)
            self.master.update(node_id, placements)

    def record_local(self, key: bytes, tier: str | None) -> None:
        assert self._local_node_id is not None, "join_local first"
        with self._lock:
            self.master.update(self._local_node_id, [(key, tier)])

    # ---- loop hooks -------------------------------------------------------------------------
    def tick(self) -> None:
        with self._lock:
            if self._local_node_id is not None:
                self.master.heartbeat(self._local_node_id)  # before expiring: it is alive
            self.master.expire_nodes()

    def check_integrity(self) -> None:
        with self._lock:
            self.master.check_integrity()

    def close(self) -> None:
        pass

    # ---- handlers ---------------------------------------------------------------------------
    def join(self, request: JoinRequest, peer: Peer) -> Answer:
        with self._lock:
            self.master.join(request.node_id, request.address)
        return Answer(JoinReply(request.request_id))

    def heartbeat(self, request: HeartbeatRequest, peer: Peer) -> Answer:
        with self._lock:
            known = self.master.heartbeat(request.node_id)
        return Answer(HeartbeatReply(request.request_id, known))

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
        holders = [[BlockHolder(node_id, tier) for node_id, tier in block_holders]
                   for block_holders in found.holders]
        return Answer(LookupPrefixReply(request.request_id, found.num_blocks, holders))

    def nodes(self, request: NodesRequest, peer: Peer) -> Answer:
        with self._lock:
            nodes = self.master.nodes()
        return Answer(NodesReply(request.request_id, nodes))

    def stats(self, request: StatsRequest, peer: Peer) -> Answer:
        with self._lock:
            stats = {"num_nodes": len(self.master.nodes()),
                     "num_master_blocks": self.master.num_blocks,
                     "num_rejected": self.num_rejected}
        return Answer(StatsReply(request.request_id, stats))

    def check(self, request: CheckRequest, peer: Peer) -> Answer:
        return answer_check(request, self.check_integrity)
