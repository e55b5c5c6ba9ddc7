"""Client <-> data server messages: a session's data paths, the block verbs and the leases.

    hello bye put get get_layers exists evict prefetch pin renew release node_info
    (and base.py's stats check lookup_prefix, which the master answers too)

A data server holds blocks in its tiers (a hand-off node, pdserve/handoff/node_server.py, is one
inside a worker). A client on the node's host may read the blocks that lie in the node's
shared memory segment in place (ShmSegment, ShmSpan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.store.base import (
    MAX_BLOCK_BYTES,
    STORE_PROTOCOL,
    StoreReply,
    StoreRequest,
    check_address,
    check_bools,
    check_keys,
    check_same_length,
    check_str,
    check_ttl,
    check_uint,
    check_uints,
)

MAX_LAYERS = 1 << 12
"""No model has more layers: bounds a GetLayersRequest."""
MAX_LAYER_KEYS = 1 << 16
"""The most blocks a GetLayersRequest names: a staging's, at most (a 1M-token prompt in blocks
of 16 tokens). A pull of a longer prompt is refused at its source and loads the usual way."""
MAX_LAYER_WAIT_S = 1.0
"""The longest a GetLayersRequest waits for a layer (it holds one of the node's threads)."""


# ---- data server: session ---------------------------------------------------------------------
@dataclass(frozen=True)
class ShmSegment:
    """A data node's shared memory segment (pdserve/kvstore/shm_segment.py), as a client on the same
    host opens it: /proc/<pid>/fd/<fd>, which must be inode `inode` of `size` bytes."""

    host: str
    """The node's host identity (boot id and PID namespace): a client elsewhere cannot open
    it."""
    pid: int
    fd: int
    inode: int
    size: int

    def __post_init__(self) -> None:
        check_str("host", self.host)
        for name in ("pid", "fd", "inode", "size"):
            check_uint(name, getattr(self, name))


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
            check_uint(name, getattr(self, name))


@STORE_PROTOCOL.message("hello")
@dataclass(frozen=True)
class HelloRequest(StoreRequest):
    """Open the client's data paths: its UCX worker address (None: the client has no UCX),
    and its host identity when it can read a segment on this host ("": it cannot)."""

    ucx_address: bytes | None
    shm_host: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_address(self.ucx_address)
        check_str("shm_host", self.shm_host)


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
        check_address(self.ucx_address)
        check_uint("client_no", self.client_no)


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
        check_keys(self.keys)
        check_uints("sizes", self.sizes)
        check_same_length("put: keys and sizes", self.keys, self.sizes)
        if any(size > MAX_BLOCK_BYTES for size in self.sizes):
            raise ValueError(f"a block is at most {MAX_BLOCK_BYTES} bytes")
        if self.ucx_tag is not None:
            check_uint("ucx_tag", self.ucx_tag)


@STORE_PROTOCOL.message("put_reply")
@dataclass(frozen=True)
class PutReply(StoreReply):
    stored: list[bool]
    """One per key; False: no tier had room (every block pinned)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bools("stored", self.stored)


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
        check_keys(self.keys)
        if self.ucx_tag is not None:
            check_uint("ucx_tag", self.ucx_tag)
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
        check_bools("found", self.found)
        check_uints("sizes", self.sizes)
        check_same_length("get: found and sizes", self.found, self.sizes)
        if any(size > MAX_BLOCK_BYTES for size in self.sizes):
            raise ValueError(f"a block is at most {MAX_BLOCK_BYTES} bytes")
        check_uints("runs", self.runs)
        if self.runs and (min(self.runs) == 0 or sum(self.runs) != sum(self.found)):
            raise ValueError("get: runs must be positive and cover the found blocks")
        if self.shm_spans and (len(self.shm_spans) != sum(self.found) or self.runs):
            raise ValueError("get: one shm span per found block, and no UCX runs with them")


@STORE_PROTOCOL.message("get_layers")
@dataclass(frozen=True)
class GetLayersRequest(StoreRequest):
    """A decode worker follows a prompt that this node's worker is staging now (a hand-off
    node only; its Output.staging named `staging_id`): the layers of blocks `keys` (the
    staging's blocks from index `first_block` on) from `first_layer` on that are staged,
    waiting at most `wait_s` for the first of them. They follow the reply as one payload,
    [len(keys), layers, one layer of a block] back to back: a ZeroMQ frame, or one UCX
    message with tag ucx_tag. A staging that ended is read from the blocks its save put."""

    staging_id: int
    keys: list[bytes]
    first_block: int
    first_layer: int
    num_layers: int
    """The model's layers: a stored block is that many equal parts, one per layer."""
    wait_s: float
    ucx_tag: int | None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keys(self.keys)
        for name in ("staging_id", "first_block", "first_layer"):
            check_uint(name, getattr(self, name))
        if (not self.keys or isinstance(self.num_layers, bool)
                or not isinstance(self.num_layers, int)
                or not self.first_layer < self.num_layers <= MAX_LAYERS):
            raise ValueError(f"get_layers: keys must not be empty and first_layer < "
                             f"num_layers <= {MAX_LAYERS}")
        if len(self.keys) > MAX_LAYER_KEYS or len(set(self.keys)) != len(self.keys):
            # a staging's keys are chained (pdserve/kvstore/block_key.py), so distinct: a
            # repeated one would only multiply the reply
            raise ValueError(f"get_layers: at most {MAX_LAYER_KEYS} keys, each once")
        if (not isinstance(self.wait_s, (int, float)) or isinstance(self.wait_s, bool)
                or not 0 <= self.wait_s <= MAX_LAYER_WAIT_S):
            raise ValueError(f"wait_s must be in [0, {MAX_LAYER_WAIT_S}]")
        if self.ucx_tag is not None:
            check_uint("ucx_tag", self.ucx_tag)


@STORE_PROTOCOL.message("get_layers_reply")
@dataclass(frozen=True)
class GetLayersReply(StoreReply):
    num_layers: int
    """Layers from first_layer on in the payload (0: none staged within wait_s; no payload)."""
    nbytes: int
    """The payload's size: len(keys) x num_layers x a block's layer bytes."""
    gone: bool = False
    """Neither the staging nor its blocks are here (aborted, or read and dropped): stop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("num_layers", self.num_layers)
        check_uint("nbytes", self.nbytes)
        if not isinstance(self.gone, bool):
            raise TypeError("gone must be a bool")
        if (self.num_layers == 0) != (self.nbytes == 0) or (self.gone and self.num_layers):
            raise ValueError("get_layers: a payload exactly when layers follow, none if gone")


@STORE_PROTOCOL.message("exists")
@dataclass(frozen=True)
class ExistsRequest(StoreRequest):
    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keys(self.keys)


@STORE_PROTOCOL.message("exists_reply")
@dataclass(frozen=True)
class ExistsReply(StoreReply):
    found: list[bool]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bools("found", self.found)


@STORE_PROTOCOL.message("evict")
@dataclass(frozen=True)
class EvictRequest(StoreRequest):
    """Drop unpinned blocks outright."""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keys(self.keys)


@STORE_PROTOCOL.message("evict_reply")
@dataclass(frozen=True)
class EvictReply(StoreReply):
    num_evicted: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("num_evicted", self.num_evicted)


@STORE_PROTOCOL.message("prefetch")
@dataclass(frozen=True)
class PrefetchRequest(StoreRequest):
    """Bring blocks up to the server's DRAM ahead of a load."""

    keys: list[bytes]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_keys(self.keys)


@STORE_PROTOCOL.message("prefetch_reply")
@dataclass(frozen=True)
class PrefetchReply(StoreReply):
    num_moved: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("num_moved", self.num_moved)


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
        check_keys(self.keys)
        check_str("holder", self.holder)
        check_ttl(self.ttl_s)


@STORE_PROTOCOL.message("pin_reply")
@dataclass(frozen=True)
class PinReply(StoreReply):
    lease_id: int
    pinned: list[bool]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("lease_id", self.lease_id)
        check_bools("pinned", self.pinned)


@STORE_PROTOCOL.message("renew")
@dataclass(frozen=True)
class RenewRequest(StoreRequest):
    lease_id: int
    ttl_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        check_uint("lease_id", self.lease_id)
        check_ttl(self.ttl_s)


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
        check_uint("lease_id", self.lease_id)


@STORE_PROTOCOL.message("release_reply")
@dataclass(frozen=True)
class ReleaseReply(StoreReply):
    known: bool


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
        check_str("node_id", self.node_id)
        if self.master_address is not None:
            check_str("master_address", self.master_address)
