"""Clients of other workers' hand-off nodes, shared by the transports that read from them."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.handoff.node_server import HandoffNode
    from pdserve.kvstore.connector import BlockBackend

logger = logging.getLogger(__name__)

MAX_FAILED_PEERS = 256  # failed node addresses remembered
FAILED_PEER_HOLD_S = 30.0  # how long a failed node address is not asked again


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
