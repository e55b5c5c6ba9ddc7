"""Configuration of a store node (master, data server, or both): one frozen dataclass.

CLI flags of `pdserve store` take their defaults from here. A port of 0 means "any free port"
(tests); the bound port is reported by the running server, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("master", "data", "all")
TRANSPORTS = ("ucx", "zmq")


@dataclass(frozen=True)
class StoreConfig:
    role: str = "all"
    """master (metadata only), data (DRAM + disk tiers), or all (both in one process)."""
    host: str = "127.0.0.1"
    """Address the control and data sockets bind to (loopback unless told otherwise)."""
    master_port: int = 7600
    """ZeroMQ port of the metadata service (role master or all)."""
    data_port: int = 7601
    """ZeroMQ control port of the data server (role data or all)."""
    master_address: str | None = None
    """tcp://host:port of a remote master a data-only node registers with (role data)."""
    node_id: str = "store-0"
    """Name this data node registers under at the master."""
    replicas: int = 1
    """Data nodes the master places each new block on (distinct nodes; fewer when fewer
    are live)."""
    dram_capacity_blocks: int = 4096
    """Blocks the host-DRAM tier holds before demoting to disk."""
    disk_capacity_blocks: int = 0
    """Blocks the disk tier holds before dropping; 0 disables the disk tier."""
    disk_dir: str | None = None
    """Directory of the disk tier (one file per block); required when disk_capacity_blocks>0."""
    transport: str = "ucx"
    """KV bytes path: ucx (ucxx; falls back to zmq with a WARNING if UCX cannot start) or zmq."""
    ucx_tls: str = "sm,cma,tcp,self"
    """UCX_TLS for the UCX data plane (set before ucxx is imported)."""
    lease_ttl_s: float = 30.0
    """A pin lease not renewed for this long expires and unpins its blocks."""
    node_ttl_s: float = 10.0
    """The master forgets a data node (and its blocks) after this long without a heartbeat."""
    heartbeat_interval_s: float = 2.0
    """How often a data node reports to its master."""
    request_timeout_s: float = 10.0
    """Every wait on a peer (reply, UCX transfer) gives up after this long."""
    num_data_threads: int = 4
    """Worker threads of the data service for the verbs that may block (put, get, prefetch,
    hello, bye): disk reads and UCX transfers run there, off the socket loop."""
    data_thread_nice: int = 0
    """The data threads' nice value (Linux: per thread). A worker's hand-off node runs them
    at 19: they send the layers decode pulls while the prefill computes, and on a busy core
    the forward goes first."""
    max_keys_per_message: int = 4096
    """Largest batch one control message may carry; larger ones are rejected."""
    max_block_bytes: int = 256 * 1024 * 1024
    """Largest single block accepted."""
    drop_released: bool = False
    """Drop a block as soon as no lease pins it any more, instead of keeping it until the LRU
    evicts it: a hand-off node's blocks are read once, by the decode worker holding the
    lease (the fleet store keeps the prefix), and their memory is best reused at once."""
    shm_bytes: int = 0
    """Bytes of a shared memory segment (pdserve/kvstore/shm_segment.py) that blocks put in process
    may live in, for clients on this host to copy them out in one user-space copy (a
    prefill worker's hand-off node stages prompts there); 0: none."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("master_port", "data_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.dram_capacity_blocks <= 0:
            raise ValueError("dram_capacity_blocks must be positive")
        if self.disk_capacity_blocks < 0:
            raise ValueError("disk_capacity_blocks must be >= 0")
        if self.disk_capacity_blocks > 0 and not self.disk_dir:
            raise ValueError("disk_dir is required when disk_capacity_blocks > 0")
        for name in ("lease_ttl_s", "node_ttl_s", "heartbeat_interval_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_interval_s >= self.node_ttl_s:
            raise ValueError("heartbeat_interval_s must be shorter than node_ttl_s")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.num_data_threads <= 0:
            raise ValueError(f"num_data_threads must be positive, got {self.num_data_threads}")
        if self.max_keys_per_message <= 0 or self.max_block_bytes <= 0:
            raise ValueError("max_keys_per_message and max_block_bytes must be positive")
        if self.shm_bytes < 0:
            raise ValueError(f"shm_bytes must be >= 0, got {self.shm_bytes}")
