"""Data node / client <-> master messages: membership, the fleet's block index, placement and
lease groups.

    join heartbeat leave update nodes place locate lease_group take_lease_group
    (and base.py's stats check lookup_prefix, which data servers answer too)

The master's `place` and `locate` spread blocks over the data nodes (pdserve/kvstore/master.py): a
client asks where to write new blocks, writes them to those nodes' data servers, and asks
where to read them from; the data nodes' own reports (`update`) keep the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.store.base import (
    STORE_PROTOCOL,
    BlockHolder,
    StoreReply,
    StoreRequest,
    check_addresses,
    check_bools,
    check_holders,
    check_key,
    check_keys,
    check_same_length,
    check_str,
    check_ttl,
    check_uint,
)


# ---- nested values ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockCopy:
    """Copy block `key` to the data node at `target` (tcp://host:port)."""

    key: bytes
    target: str

    def __post_init__(self) -> None:
        check_key(self.key)
        check_str("target", self.target)


@dataclass(frozen=True)
class PlacementChange:
    """A block moved to `tier` on a data node, or left it (tier None)."""

    key: bytes
    tier: str | None

    def __post_init__(self) -> None:
        check_key(self.key)
        if self.tier is not None:
            check_str("tier", self.tier)


@dataclass(frozen=True)
class NodeUsage:
    """How full a data node is (all tiers together), as it reports it to the master."""

    capacity_blocks: int
    num_blocks: int
    num_bytes: int
    """Payload bytes of the blocks it holds."""

    def __post_init__(self) -> None:
        check_uint("capacity_blocks", self.capacity_blocks)
        check_uint("num_blocks", self.num_blocks)
        check_uint("num_bytes", self.num_bytes)


@dataclass(frozen=True)
class NodeLease:
    """A lease one data node handed out (a part of a fleet-wide lease group)."""

    node_id: str
    lease_id: int

    def __post_init__(self) -> None:
        check_str("node_id", self.node_id)
        check_uint("lease_id", self.lease_id)


# ---- master -----------------------------------------------------------------------------------
@STORE_PROTOCOL.message("join")
@dataclass(frozen=True)
class JoinRequest(StoreRequest):
    """A data node registers (again: the master then forgets what it held before)."""

    node_id: str
    address: str
    """The node's data-server control address, tcp://host:port."""
    usage: NodeUsage | None = None
    """How full it is (placement spreads blocks by it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_str("node_id", self.node_id)
        check_str("address", self.address)


@STORE_PROTOCOL.message("join_reply")
@dataclass(frozen=True)
class JoinReply(StoreReply):
    pass


@STORE_PROTOCOL.message("heartbeat")
@dataclass(frozen=True)
class HeartbeatRequest(StoreRequest):
    node_id: str
    usage: NodeUsage | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_str("node_id", self.node_id)


@STORE_PROTOCOL.message("heartbeat_reply")
@dataclass(frozen=True)
class HeartbeatReply(StoreReply):
    known: bool
    """False: the master does not know the node (it must join again)."""
    copies: list[BlockCopy] = field(default_factory=list)
    """Blocks this node is to copy to other nodes: a holder left and they fell under the
    store's replicas (the targets' own reports then index the copies)."""


@STORE_PROTOCOL.message("leave")
@dataclass(frozen=True)
class LeaveRequest(StoreRequest):
    node_id: str

    def __post_init__(self) -> None:
        super().__post_init__()
        check_str("node_id", self.node_id)


@STORE_PROTOCOL.message("leave_reply")
@dataclass(frozen=True)
class LeaveReply(StoreReply):
    pass


@STORE_PROTOCOL.message("update")
@dataclass(frozen=True)
class UpdateRequest(StoreRequest):
    """A data node's placement changes, applied in order."""

    node_id: str
    changes: list[PlacementChange]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_str("node_id", self.node_id)
        if not isinstance(self.changes, list) or not all(
                isinstance(c, PlacementChange) for c in self.changes):
            raise TypeError("changes must be a list of PlacementChange")


@STORE_PROTOCOL.message("update_reply")
@dataclass(frozen=True)
class UpdateReply(StoreReply):
    known: bool
    """False: the master does not know the node (it must join again)."""


@STORE_PROTOCOL.message("nodes")
@dataclass(frozen=True)
class NodesRequest(StoreRequest):
    pass


@STORE_PROTOCOL.message("nodes_reply")
@dataclass(frozen=True)
class NodesReply(StoreReply):
    nodes: dict[str, str]
    """node_id -> data-server address of every live node."""
    usage: dict[str, NodeUsage] = field(default_factory=dict)
    """node_id -> how full it is, as last reported."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_addresses(self.nodes)
        if not isinstance(self.usage, dict) or not all(
                isinstance(u, NodeUsage) for u in self.usage.values()):
            raise TypeError("usage must map node ids to NodeUsage")
        for node_id in self.usage:
            check_str("node_id", node_id)


@STORE_PROTOCOL.message("place")
@dataclass(frozen=True)
class PlaceRequest(StoreRequest):
    """Where should these new blocks be written? (The master picks data nodes.)"""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keys(self.keys)


@STORE_PROTOCOL.message("place_reply")
@dataclass(frozen=True)
class PlaceReply(StoreReply):
    targets: list[list[str]]
    """Per key: the node ids to write it to (the master's replica count of distinct nodes;
    empty: some live node holds it already, or no node is live)."""
    held: list[bool]
    """Per key: a live node holds it already (nothing to write)."""
    addresses: dict[str, str]
    """node_id -> data-server address of every node named."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.targets, list) or not all(
                isinstance(ts, list) for ts in self.targets):
            raise TypeError("targets must be lists of node ids")
        for ts in self.targets:
            for node_id in ts:
                check_str("node_id", node_id)
        check_bools("held", self.held)
        check_same_length("place: targets and held", self.targets, self.held)
        check_addresses(self.addresses)


@STORE_PROTOCOL.message("locate")
@dataclass(frozen=True)
class LocateRequest(StoreRequest):
    """Who holds each of these blocks (every key, not only a leading run)?"""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keys(self.keys)


@STORE_PROTOCOL.message("locate_reply")
@dataclass(frozen=True)
class LocateReply(StoreReply):
    holders: list[list[BlockHolder]]
    """Per key: its holders, best first (empty: nobody)."""
    addresses: dict[str, str]
    """node_id -> data-server address of every holder named."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_holders(self.holders)
        check_addresses(self.addresses)


@STORE_PROTOCOL.message("lease_group")
@dataclass(frozen=True)
class LeaseGroupRequest(StoreRequest):
    """File the data nodes' leases pinning one batch under one fleet-wide lease id, so a
    reader in another process can release them all by that id."""

    node_leases: list[NodeLease]
    ttl_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.node_leases, list) or not all(
                isinstance(lease, NodeLease) for lease in self.node_leases):
            raise TypeError("node_leases must be a list of NodeLease")
        check_ttl(self.ttl_s)


@STORE_PROTOCOL.message("lease_group_reply")
@dataclass(frozen=True)
class LeaseGroupReply(StoreReply):
    lease_id: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("lease_id", self.lease_id)


@STORE_PROTOCOL.message("take_lease_group")
@dataclass(frozen=True)
class TakeLeaseGroupRequest(StoreRequest):
    """End a lease group: the master forgets it and answers with its live nodes' leases."""

    lease_id: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("lease_id", self.lease_id)


@STORE_PROTOCOL.message("take_lease_group_reply")
@dataclass(frozen=True)
class TakeLeaseGroupReply(StoreReply):
    known: bool
    """False: the group had expired or was taken already."""
    node_leases: list[NodeLease]
    """The group's leases on nodes still live, to release there."""
    addresses: dict[str, str]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.node_leases, list) or not all(
                isinstance(lease, NodeLease) for lease in self.node_leases):
            raise TypeError("node_leases must be a list of NodeLease")
        check_addresses(self.addresses)
