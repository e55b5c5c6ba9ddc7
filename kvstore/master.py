"""The metadata master: which data node holds which block, in which tier.

Data nodes join with their control address, report placement changes (key -> tier, or None
when dropped) and heartbeat; a node silent for node_ttl_s is treated as gone and its blocks
leave the index, so lookups never point at a dead node. The router and workers ask
`lookup_prefix(keys)`: how many leading blocks of a request exist somewhere, and where.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class NodeInfo:
    node_id: str
    address: str  # the node's data-server control address, tcp://host:port
    last_seen_s: float
    keys: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class PrefixLookup:
    num_blocks: int
    """Leading keys that some live node holds."""
    holders: list[list[tuple[str, str]]]
    """For each of those blocks: (node_id, tier) pairs."""


class Master:
    """Block index over data nodes, with heartbeat-based membership."""

    def __init__(self, node_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if node_ttl_s <= 0:
            raise ValueError(f"node_ttl_s must be positive, got {node_ttl_s}")
        self.node_ttl_s = node_ttl_s
        self._clock = clock
        self._nodes: dict[str, NodeInfo] = {}
        self._index: dict[bytes, dict[str, str]] = {}  # key -> {node_id: tier}

    # ---- membership -------------------------------------------------------------------------
    def join(self, node_id: str, address: str) -> None:
        """Register a node (a re-join after a restart forgets what it held before)."""
        if node_id in self._nodes:
            self.leave(node_id)
        self._nodes[node_id] = NodeInfo(node_id, address, self._clock())
        logger.info("master: node %s joined at %s", node_id, address)

    def heartbeat(self, node_id: str) -> bool:
        """Refresh a node; False if the master does not know it (it must join again)."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        node.last_seen_s = self._clock()
        return True

    def leave(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        for key in node.keys:
            holders = self._index.get(key)
            if holders is not None:
                holders.pop(node_id, None)
                if not holders:
                    del self._index[key]
        logger.info("master: node %s left (%d blocks forgotten)", node_id, len(node.keys))

    def expire_nodes(self) -> list[str]:
        """Drop nodes whose last heartbeat is older than node_ttl_s; returns their ids."""
        now = self._clock()
        gone = [n.node_id for n in self._nodes.values() if now - n.last_seen_s > self.node_ttl_s]
        for node_id in gone:
            logger.warning("master: node %s missed its heartbeats; dropping it", node_id)
            self.leave(node_id)
        return gone

    def nodes(self) -> dict[str, str]:
        """node_id -> address of every live node."""
        return {n.node_id: n.address for n in self._nodes.values()}

    # ---- block index ------------------------------------------------------------------------
    def update(self, node_id: str, changes: Sequence[tuple[bytes, str | None]]) -> bool:
        """Apply a node's placement changes in order; False if the node is unknown."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        for key, tier in changes:
            if tier is None:
                node.keys.discard(key)
                holders = self._index.get(key)
                if holders is not None:
                    holders.pop(node_id, None)
                    if not holders:
                        del self._index[key]
            else:
                node.keys.add(key)
                self._index.setdefault(key, {})[node_id] = tier
        return True

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        holders: list[list[tuple[str, str]]] = []
        for key in keys:
            found = self._index.get(key)
            if not found:
                break
            holders.append(sorted(found.items()))
        return PrefixLookup(len(holders), holders)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def check_integrity(self) -> None:
        """The index and the per-node key sets describe the same placements."""
        from_nodes = {(k, n.node_id) for n in self._nodes.values() for k in n.keys}
        from_index = {(k, node_id) for k, holders in self._index.items() for node_id in holders}
        if from_nodes != from_index:
            raise AssertionError(
                f"master index out of sync: {len(from_nodes ^ from_index)} placements differ")
        if any(not holders for holders in self._index.values()):
            raise AssertionError("master index has a key with no holder")
