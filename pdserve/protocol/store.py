"""Worker/router <-> KV store messages (ZeroMQ DEALER/ROUTER, msgpack; see protocol/codec.py).

Every request and every reply carries `request_id`: the client picks it, the reply echoes it
(a late reply to a request that already timed out is recognised and dropped). Each verb has
one request and one reply type; a refused request is answered with an ErrorReply instead
(request_id 0 when the request could not even be decoded).

    data server:  hello bye put get exists pin renew release evict prefetch stats check
                  lookup_prefix node_info
    master:       join heartbeat leave update lookup_prefix nodes stats check
                  place locate lease_group take_lease_group

The master's `place` and `locate` spread blocks over the data nodes (kvstore/master.py): a
client asks where to write new blocks, writes them to those nodes' data servers, and asks
where to read them from; the data nodes' own reports (`update`) keep the index.

Block payloads never ride inside msgpack: they follow the header as extra ZeroMQ frames (zmq
data path) or move over UCX under the `ucx_tag` named in the message. A header is at most
MAX_HEADER_BYTES; every bound on a field (key and string sizes, integer and TTL ranges) is
checked in `__post_init__`, so a sender's bug raises where it is made and a malformed message
becomes a WireError at the receiver. The batch limit (StoreConfig.max_keys_per_message) is a
server setting: the server checks it after decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.codec import Protocol, WireError

STORE_PROTOCOL = Protocol("store")

MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_KEY_BYTES = 64
MAX_STR_CHARS = 256
MAX_ADDRESS_BYTES = 4096
MAX_UINT = 2**63
"""Integers on the wire (ids, tags, sizes, counts) are in [0, MAX_UINT)."""
MAX_BLOCK_BYTES = 1 << 40
"""No block is larger (a server's own max_block_bytes is far smaller); bounds what a client
allocates for a UCX get on a server's word."""
MAX_TTL_S = 1e7


# ---- field checks: raise ValueError/TypeError, which the codec turns into WireError ----------
def _check_uint(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_UINT:
        raise ValueError(f"{name} must be an integer in [0, 2**63)")


def _check_uints(name: str, values: object) -> None:
    if not isinstance(values, list):
        raise TypeError(f"{name} must be a list")
    for value in values:
        _check_uint(name, value)


def _check_bools(name: str, values: object) -> None:
    if not isinstance(values, list) or not all(isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be a list of bools")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_STR_CHARS:
        raise ValueError(f"{name} must be a string of at most {MAX_STR_CHARS} characters")


def _check_key(key: object) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a block key must be 1..{MAX_KEY_BYTES} bytes")


def _check_keys(keys: object) -> None:
    if not isinstance(keys, list):
        raise TypeError("keys must be a list")
    for key in keys:
        _check_key(key)


def _check_address(address: object) -> None:
    if address is not None and (
            not isinstance(address, bytes) or len(address) > MAX_ADDRESS_BYTES):
        raise ValueError(f"ucx_address must be None or at most {MAX_ADDRESS_BYTES} bytes")


def _check_ttl(ttl_s: object) -> None:
    if (not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool)
            or not 0 < ttl_s < MAX_TTL_S):
        raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g})")


def _check_addresses(addresses: object) -> None:
    if not isinstance(addresses, dict):
        raise TypeError("addresses must be a map")
    for node_id, address in addresses.items():
        _check_str("node_id", node_id)
        _check_str("address", address)


def _check_same_length(what: str, a: list, b: list) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} vs {len(b)} items")


# ---- bases ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreRequest:
    """A client -> store message (never sent bare: only its registered subclasses)."""

    request_id: int

    def __post_init__(self) -> None:
        _check_uint("request_id", self.request_id)


@dataclass(frozen=True)
class StoreReply:
    """A store -> client message answering the request with the same request_id."""

    request_id: int

    def __post_init__(self) -> None:
        _check_uint("request_id", self.request_id)


@STORE_PROTOCOL.message("error")
@dataclass(frozen=True)
class ErrorReply(StoreReply):
    """The request was refused (malformed, not served on this socket) or failed."""

    error: str


# ---- nested values ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlacementChange:
    """A block moved to `tier` on a data node, or left it (tier None)."""

    key: bytes
    tier: str | None

    def __post_init__(self) -> None:
        _check_key(self.key)
        if self.tier is not None:
            _check_str("tier", self.tier)


@dataclass(frozen=True)
class BlockHolder:
    """A data node holding a block, and the tier it is in there."""

    node_id: str
    tier: str

    def __post_init__(self) -> None:
        _check_str("node_id", self.node_id)
        _check_str("tier", self.tier)


@dataclass(frozen=True)
class NodeUsage:
    """How full a data node is (all tiers together), as it reports it to the master."""

    capacity_blocks: int
    num_blocks: int
    num_bytes: int
    """Payload bytes of the blocks it holds."""

    def __post_init__(self) -> None:
        _check_uint("capacity_blocks", self.capacity_blocks)
        _check_uint("num_blocks", self.num_blocks)
        _check_uint("num_bytes", self.num_bytes)


@dataclass(frozen=True)
class NodeLease:
    """A lease one data node handed out (a part of a fleet-wide lease group)."""

    node_id: str
    lease_id: int

    def __post_init__(self) -> None:
        _check_str("node_id", self.node_id)
        _check_uint("lease_id", self.lease_id)


# ---- data server: session ---------------------------------------------------------------------
@dataclass(frozen=True)
class ShmSegment:
    """A data node's shared memory segment (kvstore/shm_segment.py), as a client on the same
    host opens it: /proc/<pid>/fd/<fd>, which must be inode `inode` of `size` bytes."""

    host: str
    """The node's host identity (boot id and PID namespace): a client elsewhere cannot open
    it."""
    pid: int
    fd: int
    inode: int
    size: int

    def __post_init__(self) -> None:
        _check_str("host", self.host)
        for name in ("pid", "fd", "inode", "size"):
            _check_uint(name, getattr(self, name))


@dataclass(frozen=True)
class ShmSpan:
    """Where a block lies in the node's segment: its bytes at `offset`, and the uint64 at
    `header` that holds `serial` while the block's memory is not freed (the client copies,
    then checks it)."""

    offset: int
    header: int
    serial: int

    def __post_init__(self) -> None:
        for name in ("offset", "header", "serial"):
            _check_uint(name, getattr(self, name))


@STORE_PROTOCOL.message("hello")
@dataclass(frozen=True)
class HelloRequest(StoreRequest):
    """Open the client's data paths: its UCX worker address (None: the client has no UCX),
    and its host identity when it can read a segment on this host ("": it cannot)."""

    ucx_address: bytes | None
    shm_host: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_address(self.ucx_address)
        _check_str("shm_host", self.shm_host)


@STORE_PROTOCOL.message("hello_reply")
@dataclass(frozen=True)
class HelloReply(StoreReply):
    ucx_address: bytes | None
    """The server's UCX worker address; None: the server has no UCX (use the zmq path)."""
    client_no: int
    """The top 32 bits of every UCX tag this client uses (0 without UCX)."""
    shm: ShmSegment | None = None
    """The node's shared memory segment, when it has one and the client is on its host."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_address(self.ucx_address)
        _check_uint("client_no", self.client_no)


@STORE_PROTOCOL.message("bye")
@dataclass(frozen=True)
class ByeRequest(StoreRequest):
    """The client is closing: the server frees its UCX endpoint."""


@STORE_PROTOCOL.message("bye_reply")
@dataclass(frozen=True)
class ByeReply(StoreReply):
    pass


# ---- data server: blocks ----------------------------------------------------------------------
@STORE_PROTOCOL.message("put")
@dataclass(frozen=True)
class PutRequest(StoreRequest):
    """Store blocks. Payloads follow as one ZeroMQ frame per key, or over UCX with tags
    ucx_tag + i."""

    keys: list[bytes]
    sizes: list[int]
    """Payload bytes of each block."""
    ucx_tag: int | None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)
        _check_uints("sizes", self.sizes)
        _check_same_length("put: keys and sizes", self.keys, self.sizes)
        if any(size > MAX_BLOCK_BYTES for size in self.sizes):
            raise ValueError(f"a block is at most {MAX_BLOCK_BYTES} bytes")
        if self.ucx_tag is not None:
            _check_uint("ucx_tag", self.ucx_tag)


@STORE_PROTOCOL.message("put_reply")
@dataclass(frozen=True)
class PutReply(StoreReply):
    stored: list[bool]
    """One per key; False: no tier had room (every block pinned)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bools("stored", self.stored)


@STORE_PROTOCOL.message("get")
@dataclass(frozen=True)
class GetRequest(StoreRequest):
    """Fetch blocks. The found ones follow the reply as ZeroMQ frames, or over UCX as the
    reply's `runs` say: message j (tag ucx_tag + j) carries the next runs[j] found blocks back
    to back."""

    keys: list[bytes]
    ucx_tag: int | None
    shm: bool = False
    """The client maps this node's segment: blocks that lie in it are answered with their
    place there (GetReply.shm_spans) instead of being sent."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)
        if self.ucx_tag is not None:
            _check_uint("ucx_tag", self.ucx_tag)
        if not isinstance(self.shm, bool):
            raise TypeError("shm must be a bool")


@STORE_PROTOCOL.message("get_reply")
@dataclass(frozen=True)
class GetReply(StoreReply):
    found: list[bool]
    sizes: list[int]
    """Payload bytes of each block (0 where not found)."""
    runs: list[int] = field(default_factory=list)
    """Over UCX: found blocks per message, in order (blocks that lie back to back in the
    node's memory go as one message); empty over ZeroMQ (a frame per block)."""
    shm_spans: list[ShmSpan] = field(default_factory=list)
    """For a GetRequest with shm: one per found block, where it lies in the node's segment;
    then nothing follows the reply (empty: the blocks come as frames or over UCX)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bools("found", self.found)
        _check_uints("sizes", self.sizes)
        _check_same_length("get: found and sizes", self.found, self.sizes)
        if any(size > MAX_BLOCK_BYTES for size in self.sizes):
            raise ValueError(f"a block is at most {MAX_BLOCK_BYTES} bytes")
        _check_uints("runs", self.runs)
        if self.runs and (min(self.runs) == 0 or sum(self.runs) != sum(self.found)):
            raise ValueError("get: runs must be positive and cover the found blocks")
        if self.shm_spans and (len(self.shm_spans) != sum(self.found) or self.runs):
            raise ValueError("get: one shm span per found block, and no UCX runs with them")


@STORE_PROTOCOL.message("exists")
@dataclass(frozen=True)
class ExistsRequest(StoreRequest):
    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)


@STORE_PROTOCOL.message("exists_reply")
@dataclass(frozen=True)
class ExistsReply(StoreReply):
    found: list[bool]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bools("found", self.found)


@STORE_PROTOCOL.message("evict")
@dataclass(frozen=True)
class EvictRequest(StoreRequest):
    """Drop unpinned blocks outright."""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)


@STORE_PROTOCOL.message("evict_reply")
@dataclass(frozen=True)
class EvictReply(StoreReply):
    num_evicted: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("num_evicted", self.num_evicted)


@STORE_PROTOCOL.message("prefetch")
@dataclass(frozen=True)
class PrefetchRequest(StoreRequest):
    """Bring blocks up to the server's DRAM ahead of a load."""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)


@STORE_PROTOCOL.message("prefetch_reply")
@dataclass(frozen=True)
class PrefetchReply(StoreReply):
    num_moved: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("num_moved", self.num_moved)


# ---- data server: leases ----------------------------------------------------------------------
@STORE_PROTOCOL.message("pin")
@dataclass(frozen=True)
class PinRequest(StoreRequest):
    """Pin the present blocks among `keys` under one lease of ttl_s seconds."""

    keys: list[bytes]
    holder: str
    ttl_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)
        _check_str("holder", self.holder)
        _check_ttl(self.ttl_s)


@STORE_PROTOCOL.message("pin_reply")
@dataclass(frozen=True)
class PinReply(StoreReply):
    lease_id: int
    pinned: list[bool]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("lease_id", self.lease_id)
        _check_bools("pinned", self.pinned)


@STORE_PROTOCOL.message("renew")
@dataclass(frozen=True)
class RenewRequest(StoreRequest):
    lease_id: int
    ttl_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("lease_id", self.lease_id)
        _check_ttl(self.ttl_s)


@STORE_PROTOCOL.message("renew_reply")
@dataclass(frozen=True)
class RenewReply(StoreReply):
    known: bool
    """False: the lease had expired or was released."""


@STORE_PROTOCOL.message("release")
@dataclass(frozen=True)
class ReleaseRequest(StoreRequest):
    lease_id: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("lease_id", self.lease_id)


@STORE_PROTOCOL.message("release_reply")
@dataclass(frozen=True)
class ReleaseReply(StoreReply):
    known: bool


# ---- either service ---------------------------------------------------------------------------
@STORE_PROTOCOL.message("stats")
@dataclass(frozen=True)
class StatsRequest(StoreRequest):
    pass


@STORE_PROTOCOL.message("stats_reply")
@dataclass(frozen=True)
class StatsReply(StoreReply):
    stats: dict[str, int]
    """Counters of the service asked (num_blocks_dram, num_leases, num_nodes, ...)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.stats, dict):
            raise TypeError("stats must be a map")
        for name, value in self.stats.items():
            _check_str("a stats name", name)
            _check_uint(name, value)


@STORE_PROTOCOL.message("check")
@dataclass(frozen=True)
class CheckRequest(StoreRequest):
    """Run the service's integrity check."""


@STORE_PROTOCOL.message("check_reply")
@dataclass(frozen=True)
class CheckReply(StoreReply):
    problem: str | None
    """None: every invariant holds; else what does not."""


@STORE_PROTOCOL.message("lookup_prefix")
@dataclass(frozen=True)
class LookupPrefixRequest(StoreRequest):
    """How many leading keys are stored, and where: fleet-wide at the master, on this node at
    a data server."""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)


@STORE_PROTOCOL.message("lookup_prefix_reply")
@dataclass(frozen=True)
class LookupPrefixReply(StoreReply):
    num_blocks: int
    holders: list[list[BlockHolder]]
    """For each of the num_blocks leading blocks: who holds it."""
    addresses: dict[str, str] = field(default_factory=dict)
    """node_id -> data-server address of every holder named (from the master)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("num_blocks", self.num_blocks)
        if not isinstance(self.holders, list) or len(self.holders) != self.num_blocks:
            raise ValueError("lookup_prefix: one holder list per found block")
        _check_holders(self.holders)
        _check_addresses(self.addresses)


def _check_holders(holders: object) -> None:
    if not isinstance(holders, list) or not all(
            isinstance(hs, list) and all(isinstance(h, BlockHolder) for h in hs)
            for hs in holders):
        raise TypeError("holders must be lists of BlockHolder")


@STORE_PROTOCOL.message("node_info")
@dataclass(frozen=True)
class NodeInfoRequest(StoreRequest):
    """Ask a data server who it is and which master indexes it."""


@STORE_PROTOCOL.message("node_info_reply")
@dataclass(frozen=True)
class NodeInfoReply(StoreReply):
    node_id: str
    master_address: str | None
    """The master this node reports to (None: a node on its own)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_str("node_id", self.node_id)
        if self.master_address is not None:
            _check_str("master_address", self.master_address)


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
        _check_str("node_id", self.node_id)
        _check_str("address", self.address)


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
        _check_str("node_id", self.node_id)


@STORE_PROTOCOL.message("heartbeat_reply")
@dataclass(frozen=True)
class HeartbeatReply(StoreReply):
    known: bool
    """False: the master does not know the node (it must join again)."""


@STORE_PROTOCOL.message("leave")
@dataclass(frozen=True)
class LeaveRequest(StoreRequest):
    node_id: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_str("node_id", self.node_id)


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
        _check_str("node_id", self.node_id)
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
        _check_addresses(self.nodes)
        if not isinstance(self.usage, dict) or not all(
                isinstance(u, NodeUsage) for u in self.usage.values()):
            raise TypeError("usage must map node ids to NodeUsage")
        for node_id in self.usage:
            _check_str("node_id", node_id)


@STORE_PROTOCOL.message("place")
@dataclass(frozen=True)
class PlaceRequest(StoreRequest):
    """Where should these new blocks be written? (The master picks data nodes.)"""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)


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
                _check_str("node_id", node_id)
        _check_bools("held", self.held)
        _check_same_length("place: targets and held", self.targets, self.held)
        _check_addresses(self.addresses)


@STORE_PROTOCOL.message("locate")
@dataclass(frozen=True)
class LocateRequest(StoreRequest):
    """Who holds each of these blocks (every key, not only a leading run)?"""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys(self.keys)


@STORE_PROTOCOL.message("locate_reply")
@dataclass(frozen=True)
class LocateReply(StoreReply):
    holders: list[list[BlockHolder]]
    """Per key: its holders, best first (empty: nobody)."""
    addresses: dict[str, str]
    """node_id -> data-server address of every holder named."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_holders(self.holders)
        _check_addresses(self.addresses)


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
        _check_ttl(self.ttl_s)


@STORE_PROTOCOL.message("lease_group_reply")
@dataclass(frozen=True)
class LeaseGroupReply(StoreReply):
    lease_id: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("lease_id", self.lease_id)


@STORE_PROTOCOL.message("take_lease_group")
@dataclass(frozen=True)
class TakeLeaseGroupRequest(StoreRequest):
    """End a lease group: the master forgets it and answers with its live nodes' leases."""

    lease_id: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_uint("lease_id", self.lease_id)


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
        _check_addresses(self.addresses)


def decode_store_message(raw: bytes) -> StoreRequest | StoreReply:
    """STORE_PROTOCOL.decode behind the header size limit (payloads travel apart, so a
    header is small; a huge one is refused before msgpack reads it)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"a store header is at most {MAX_HEADER_BYTES} bytes, got {len(raw)}")
    return STORE_PROTOCOL.decode(raw)

