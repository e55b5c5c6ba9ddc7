"""What every store message shares: the protocol, the bounds on fields and their checks, the
request and reply bases, the error reply, the verbs both services answer, and the decoder.

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
def check_uint(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_UINT:
        raise ValueError(f"{name} must be an integer in [0, 2**63)")


def check_uints(name: str, values: object) -> None:
    if not isinstance(values, list):
        raise TypeError(f"{name} must be a list")
    for value in values:
        check_uint(name, value)


def check_bools(name: str, values: object) -> None:
    if not isinstance(values, list) or not all(isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be a list of bools")


def check_str(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_STR_CHARS:
        raise ValueError(f"{name} must be a string of at most {MAX_STR_CHARS} characters")


def check_key(key: object) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a block key must be 1..{MAX_KEY_BYTES} bytes")


def check_keys(keys: object) -> None:
    if not isinstance(keys, list):
        raise TypeError("keys must be a list")
    for key in keys:
        check_key(key)


def check_address(address: object) -> None:
    if address is not None and (
            not isinstance(address, bytes) or len(address) > MAX_ADDRESS_BYTES):
        raise ValueError(f"ucx_address must be None or at most {MAX_ADDRESS_BYTES} bytes")


def check_ttl(ttl_s: object) -> None:
    if (not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool)
            or not 0 < ttl_s < MAX_TTL_S):
        raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g})")


def check_addresses(addresses: object) -> None:
    if not isinstance(addresses, dict):
        raise TypeError("addresses must be a map")
    for node_id, address in addresses.items():
        check_str("node_id", node_id)
        check_str("address", address)


def check_same_length(what: str, a: list, b: list) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} vs {len(b)} items")



def check_holders(holders: object) -> None:
    if not isinstance(holders, list) or not all(
            isinstance(hs, list) and all(isinstance(h, BlockHolder) for h in hs)
            for hs in holders):
        raise TypeError("holders must be lists of BlockHolder")


# ---- bases ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreRequest:
    """A client -> store message (never sent bare: only its registered subclasses)."""

    request_id: int

    def __post_init__(self) -> None:
        check_uint("request_id", self.request_id)


@dataclass(frozen=True)
class StoreReply:
    """A store -> client message answering the request with the same request_id."""

    request_id: int

    def __post_init__(self) -> None:
        check_uint("request_id", self.request_id)


@STORE_PROTOCOL.message("error")
@dataclass(frozen=True)
class ErrorReply(StoreReply):
    """The request was refused (malformed, not served on this socket) or failed."""

    error: str



# ---- nested values ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockHolder:
    """A data node holding a block, and the tier it is in there."""

    node_id: str
    tier: str

    def __post_init__(self) -> None:
        check_str("node_id", self.node_id)
        check_str("tier", self.tier)


# ---- either service (this node at a data server, the fleet at the master) -----------------------
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
            check_str("a stats name", name)
            check_uint(name, value)


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
        check_keys(self.keys)


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
        check_uint("num_blocks", self.num_blocks)
        if not isinstance(self.holders, list) or len(self.holders) != self.num_blocks:
            raise ValueError("lookup_prefix: one holder list per found block")
        check_holders(self.holders)
        check_addresses(self.addresses)


def decode_store_message(raw: bytes) -> StoreRequest | StoreReply:
    """STORE_PROTOCOL.decode behind the header size limit (payloads travel apart, so a
    header is small; a huge one is refused before msgpack reads it)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"a store header is at most {MAX_HEADER_BYTES} bytes, got {len(raw)}")
    return STORE_PROTOCOL.decode(raw)
