"""Where a prefill's saved prompt waits for its decode worker: the hand-off transports.

The connector (pdserve/kvstore/connector.py) needs three verbs of a hand-off, whatever carries it:

    offer(keys, blocks)     prefill: store a prompt's blocks, pinned under a lease, and say
                            where decode reads them (`source`, the lease, shared memory spans)
    fetch(keys, source)     decode: the leading blocks, from the named data node, else the
                            fleet store (each failure logged and passed over)
    pull_layers(pull)       decode, following a prefill elsewhere: the layers its node has
                            staged since the last call (pdserve/kvstore/layer_pull.py)
    release(lease, source)  decode, once loaded (or a prefill whose hand-off was dropped)

Two implementations, by name (TRANSPORTS):

    node   the worker's own data node (pdserve/kvstore/handoff_node.py), in process: decode reads
    the
           blocks from it in one hop (UCX, or ZeroMQ frames where ucxx is missing; straight out
           of its shared memory segment on the same host), and the fleet store gets a
           write-back copy off the critical path
    store  the fleet store (`--handoff-dram-gb 0`): two hops through the store server

Both fetch alike: a hand-off names its source, and decode reads from there whatever this
worker's own transport is. Which one a worker runs, with its same-host options, is chosen in
one place: pdserve/serve/worker/kv_transfer.py, choose_handoff.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.kvstore.master import PrefixLookup
from pdserve.kvstore.memory_tier import BytesLike, as_uint8_tensor
from pdserve.protocol.store.data import ShmSegment, ShmSpan

if TYPE_CHECKING:
    from pdserve.kvstore.handoff_node import HandoffNode
    from pdserve.kvstore.layer_pull import LayerPull

logger = logging.getLogger(__name__)

MAX_FAILED_PEERS = 256  # failed node addresses remembered
FAILED_PEER_HOLD_S = 30.0  # how long a failed node address is not asked again


class BlockBackend(Protocol):
    """What the connector needs of a store: a TieredStore (in process) or a StoreClient."""

    def lookup_prefix(self, keys: Sequence[bytes]) -> int | PrefixLookup: ...
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[bool]: ...
    def get_many(self, keys: Sequence[bytes]) -> Sequence[BytesLike | None]: ...
    def prefetch(self, keys: Sequence[bytes]) -> int: ...


@dataclass(frozen=True)
class Offer:
    """What an offer stored, and where decode finds it."""

    num_stored: int
    """Leading blocks stored."""
    error: str | None = None
    lease_id: int | None = None
    """The lease pinning them until decode has read them (None: no lease TTL, or none stored)."""
    source: str = ""
    """The data node holding them and the lease ("": the fleet store)."""
    shm_segment: ShmSegment | None = None
    """The node's shared memory segment, when every block lies in it..."""
    shm_spans: list[ShmSpan] | None = None
    """...and where each of them does (a decode worker on this host maps them in place)."""
    write_back: Callable[[], None] | None = None
    """Off the critical path, after the offer is announced: copy the blocks to the fleet store."""


class HandoffTransport(Protocol):
    """The verbs a worker's connector needs of a hand-off (see the module docstring)."""

    name: str
    offers_in_process: bool
    """An offer does no I/O (the worker's own node): the connector runs it at once."""
    node: HandoffNode | None
    """The worker's own data node, where offers land (None: the fleet store)."""

    def offer(self, keys: list[bytes], blocks: list[torch.Tensor],
              lease_ttl_s: float | None) -> Offer: ...
    def fetch(self, keys: list[bytes], source: str, block_bytes: int) -> list[BytesLike]: ...
    def release(self, lease_id: int, source: str) -> None: ...
    def pull_layers(self, pull: LayerPull) -> bool: ...
    def allocate_staging(self, nbytes: int) -> torch.Tensor | None: ...
    @property
    def staging_segment(self) -> ShmSegment | None: ...
    def locate(self, blocks: Sequence[torch.Tensor]) -> list[ShmSpan] | None: ...
    def set_progress(self, span: ShmSpan, value: int) -> None: ...
    @property
    def num_leases(self) -> int: ...
    def close_peers(self) -> None: ...


class PeerNodes:
    """Clients of other workers' data nodes (the sources of loads), on the connector's job
    thread. A worker's node dies with it and a restarted worker binds a new port, so for
    FAILED_PEER_HOLD_S a failed address is not asked again (its hand-offs load from the fleet
    store, its leases died with it) instead of costing every later load and release a
    timeout."""

    def __init__(self, connect: Callable[[str], BlockBackend] | None,
                 own: HandoffNode | None = None) -> None:
        self._connect = connect
        self._own = own
        self._peers: dict[str, BlockBackend] = {}  # source address -> client
        self._failed: OrderedDict[str, float] = OrderedDict()  # address -> when, latest last

    def backend_for(self, source: str) -> BlockBackend:
        """The client of the data node at `source` (this worker's own node in process)."""
        if self._own is not None and source == self._own.address:
            return self._own
        peer = self._peers.get(source)
        if peer is None:
            if self._connect is None:
                raise RuntimeError(f"no way to reach data node {source}")
            peer = self._peers[source] = self._connect(source)
        return peer

    def failed(self, source: str) -> None:
        self._drop(source)
        self._failed.pop(source, None)
        self._failed[source] = time.monotonic()
        while len(self._failed) > MAX_FAILED_PEERS:
            self._failed.popitem(last=False)

    def recently_failed(self, source: str) -> bool:
        failed_s = self._failed.get(source)
        return failed_s is not None and time.monotonic() - failed_s < FAILED_PEER_HOLD_S

    def _drop(self, source: str) -> None:
        """Forget a failed peer's client (a later hand-off from it reconnects)."""
        peer = self._peers.pop(source, None)
        close = getattr(peer, "close", None)
        if close is not None:
            try:
                close()
            except Exception as e:  # it failed already; closing is best effort
                logger.debug("kv connector: closing the client of %s: %s", source, e)

    def close(self) -> None:
        for source in list(self._peers):
            self._drop(source)


class StoreHandoff:
    """Offers go to the fleet store (`backend`); loads read the named source, else it."""

    name = "store"
    offers_in_process = False
    node: HandoffNode | None = None

    def __init__(self, backend: BlockBackend | None, peers: PeerNodes) -> None:
        self.backend = backend
        self.peers = peers

    def _target(self) -> Any:
        if self.backend is None:
            raise RuntimeError("no data node and no store to save to")
        return self.backend

    def offer(self, keys: list[bytes], blocks: list[torch.Tensor],
              lease_ttl_s: float | None) -> Offer:
        num_stored, lease_id = 0, None
        try:
            target = self._target()
            stored = target.put_many(keys, blocks)
            num_stored = next((i for i, ok in enumerate(stored) if not ok), len(stored))
            if lease_ttl_s is not None and num_stored:
                lease_id, _ = target.pin(keys[:num_stored], lease_ttl_s)
            spans = self.locate(blocks) if num_stored == len(blocks) else None
        except Exception as e:  # a lost save only costs a future recompute
            return self._offered(num_stored, lease_id, None, repr(e), keys, blocks)
        return self._offered(num_stored, lease_id, spans, None, keys, blocks)

    def _offered(self, num_stored: int, lease_id: int | None, spans: list[ShmSpan] | None,
                 error: str | None, keys: list[bytes], blocks: list[torch.Tensor]) -> Offer:
        return Offer(num_stored, error, lease_id)

    def fetch(self, keys: list[bytes], source: str, block_bytes: int) -> list[BytesLike]:
        """The leading run of present, well-formed blocks, as the backend returned them: from
        `source`, else the fleet store (each failure logged and passed over)."""
        names = ([source] if source else []) + ([""] if self.backend is not None else [])
        best: list[BytesLike] = []
        for name in names:
            if self.peers.recently_failed(name):
                continue
            try:
                backend = self.peers.backend_for(name) if name else self.backend
                assert backend is not None
                blocks = backend.get_many(keys) if keys else []
            except Exception as e:
                logger.warning("kv connector: reading from %s failed (%s)", name or "the store",
                               e)
                if name:
                    self.peers.failed(name)
                continue
            usable = []
            for block in blocks:
                if block is None or as_uint8_tensor(block).numel() != block_bytes:
                    break
                usable.append(block)
            if len(usable) > len(best):
                best = usable
            if len(best) == len(keys):
                break
        return best

    def pull_layers(self, pull: LayerPull) -> bool:
        """One round trip of a layer pull (pdserve/kvstore/layer_pull.py) from its node; whether to
        ask again. A node that does not answer is passed over as fetch passes it over (its
        hand-off then loads from the fleet store)."""
        if self.peers.recently_failed(pull.source):
            pull.failed = True
            return False
        try:
            return pull.step(self.peers.backend_for(pull.source))
        except Exception as e:  # only an early start: the hand-off loads the usual way
            logger.warning("kv connector: pulling staging %d from %s failed (%s)",
                           pull.staging_id, pull.source, e)
            pull.failed = True
            if isinstance(e, TimeoutError):  # (StoreUnavailable is one)
                self.peers.failed(pull.source)
            return False

    def release(self, lease_id: int, source: str) -> None:
        """Give a lease back to the node holding it; a failure leaves it to expire."""
        if self.peers.recently_failed(source):
            return  # the node is gone, and its leases with it
        try:
            backend = self.peers.backend_for(source) if source else self.backend
            if backend is not None:
                backend.release(lease_id)
        except Exception as e:
            logger.warning("kv connector: releasing lease %d failed (%s); it will expire",
                           lease_id, e)
            if source:
                self.peers.failed(source)

    # ---- same-host staging: only a node has a segment -----------------------------------------
    def allocate_staging(self, nbytes: int) -> torch.Tensor | None:
        return None

    @property
    def staging_segment(self) -> ShmSegment | None:
        return None

    def locate(self, blocks: Sequence[torch.Tensor]) -> list[ShmSpan] | None:
        return None

    def set_progress(self, span: ShmSpan, value: int) -> None:
        pass

    @property
    def num_leases(self) -> int:
        """Leases of hand-offs not read yet that this worker holds (the store's are not)."""
        return 0

    def close_peers(self) -> None:
        self.peers.close()


class NodeHandoff(StoreHandoff):
    """Offers land in this worker's own data node (in process, no copy), and a write-back copy
    goes to the fleet store; a node with a shared memory segment stages prompts in it."""

    name = "node"
    offers_in_process = True

    def __init__(self, backend: BlockBackend | None, peers: PeerNodes,
                 node: HandoffNode) -> None:
        super().__init__(backend, peers)
        self.node = node

    def _target(self) -> Any:
        return self.node

    def _offered(self, num_stored: int, lease_id: int | None, spans: list[ShmSpan] | None,
                 error: str | None, keys: list[bytes], blocks: list[torch.Tensor]) -> Offer:
        assert self.node is not None
        backend, write_back = self.backend, None
        if backend is not None and num_stored:
            keys, blocks = keys[:num_stored], blocks[:num_stored]

            def write_back() -> None:
                try:
                    backend.put_many(keys, blocks)
                except Exception as e:  # the store is a cache: the prefix is just not kept
                    logger.warning("kv connector: write-back of %d blocks failed (%s)",
                                   len(keys), e)

        return Offer(num_stored, error, lease_id, self.node.address,
                     self.node.shm_segment if spans else None, spans, write_back)

    def allocate_staging(self, nbytes: int) -> torch.Tensor | None:
        assert self.node is not None
        return self.node.allocate_staging(nbytes)

    @property
    def staging_segment(self) -> ShmSegment | None:
        assert self.node is not None
        return self.node.shm_segment

    def locate(self, blocks: Sequence[torch.Tensor]) -> list[ShmSpan] | None:
        assert self.node is not None
        return self.node.locate(blocks)

    def set_progress(self, span: ShmSpan, value: int) -> None:
        assert self.node is not None
        self.node.set_progress(span, value)

    @property
    def num_leases(self) -> int:
        assert self.node is not None
        return self.node.num_leases


TRANSPORTS: dict[str, type[StoreHandoff]] = {"node": NodeHandoff, "store": StoreHandoff}


def make_handoff_transport(name: str, backend: BlockBackend | None,
                           connect: Callable[[str], BlockBackend] | None = None,
                           node: HandoffNode | None = None) -> HandoffTransport:
    """The transport `name` (TRANSPORTS): "node" needs the worker's own `node`."""
    if name not in TRANSPORTS:
        raise ValueError(f"hand-off transport must be one of {sorted(TRANSPORTS)}, got {name!r}")
    if (name == "node") != (node is not None):
        raise ValueError("the node transport, and only it, takes the worker's own data node")
    peers = PeerNodes(connect, node)
    if name == "node":
        assert node is not None
        return NodeHandoff(backend, peers, node)
    return StoreHandoff(backend, peers)
