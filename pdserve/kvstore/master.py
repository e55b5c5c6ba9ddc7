"""The metadata master: which data node holds which block, in which tier, and where new
blocks go.

Data nodes join with their control address and how full they are, report placement changes
(key -> tier, or None when dropped) and heartbeat with their usage; a node silent for
node_ttl_s is treated as gone and its blocks leave the index (a goodbye, `leave`, does the
same at once), so lookups never point at a dead node: its blocks become misses.

    write:  client ──place(keys)──► master: per key, `replicas` distinct live nodes
            client ──put──► those data nodes ──update (their own report)──► master index
    read:   client ──locate / lookup_prefix(keys)──► master: per key, its holders
            client ──get──► a holder (the next one if that fails; none left: a miss)

Placement (Mooncake Store's shape): each new block goes to the live nodes with the lowest
fill, (blocks held + blocks placed there since its last report) / capacity, ties broken by
fewer placements in flight, then by node id. A batch thus spreads evenly over equal nodes
(a, b, a, b, ...) and proportionally to capacity over unequal ones, and it is deterministic:
the same reports give the same placement. The index itself follows only the nodes' reports,
never the clients' intentions, so it never names a block a write did not deliver.

A lease group files the per-node leases that pin one batch under one id, so the process that
reads the blocks (a decode worker) can release pins another process (a prefill worker) took.
Groups expire after their TTL, as the node leases inside them do.

The router and workers ask `lookup_prefix(keys)`: how many leading blocks of a request exist
somewhere, and where.

The index's memory. A block's holders are one tuple of (node_id, tier) pairs, sorted fastest
tier first, and every equal tuple is one shared object (`_intern`): a fleet has few distinct
holder sets (nodes x tiers, per replica), so a block costs its key, its slot in the index and
its slot in its holders' key sets, not a holder map of its own (a dict per block was 184 bytes,
about half of what a block cost). Lookups return the sorted tuples as they are.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

TIER_ORDER = {"device": 0, "dram": 1, "disk": 2}
"""Holders of a block are listed fastest tier first (a read tries them in order)."""

Holders = tuple[tuple[str, str], ...]
"""A block's (node_id, tier) pairs, fastest tier first, then by node id."""


def _holder_order(holder: tuple[str, str]) -> tuple[int, str]:
    return TIER_ORDER.get(holder[1], len(TIER_ORDER)), holder[0]


@dataclass
class NodeInfo:
    node_id: str
    address: str  # the node's data-server control address, tcp://host:port
    last_seen_s: float
    keys: set[bytes] = field(default_factory=set)
    joined_s: float = 0.0
    capacity_blocks: int = 0
    """All tiers together, as last reported (0: not reported yet)."""
    num_blocks: int = 0
    """Blocks it held at its last report."""
    num_bytes: int = 0
    num_placed: int = 0
    """Blocks placed on it since its last report (writes in flight: its load)."""
    is_settled: bool = False
    """Joined at least node_ttl_s ago: its inventory is in, and it may receive copies of the
    blocks that fell under `replicas` before it came (Master.expire_nodes)."""

    def fill(self) -> float:
        return (self.num_blocks + self.num_placed) / max(1, self.capacity_blocks)


@dataclass(frozen=True)
class Usage:
    capacity_blocks: int
    num_blocks: int
    num_bytes: int


@dataclass(frozen=True)
class PrefixLookup:
    num_blocks: int
    """Leading keys that some live node holds."""
    holders: list[list[tuple[str, str]]]
    """For each of those blocks: (node_id, tier) pairs."""
    addresses: dict[str, str] = field(default_factory=dict)
    """node_id -> data-server address of the holders named (known to the master)."""


@dataclass
class LeaseGroup:
    node_leases: list[tuple[str, int]]  # (node_id, that node's lease id)
    expires_at_s: float


class Master:
    """Block index over data nodes, with heartbeat-based membership and placement."""

    def __init__(self, node_ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 replicas: int = 1):
        if node_ttl_s <= 0:
            raise ValueError(f"node_ttl_s must be positive, got {node_ttl_s}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.node_ttl_s = node_ttl_s
        self.replicas = replicas
        self._clock = clock
        self._nodes: dict[str, NodeInfo] = {}
        self._index: dict[bytes, Holders] = {}  # key -> its holders (an interned tuple)
        self._interned: dict[Holders, Holders] = {}
        """Every holders tuple the index uses, by itself. It only grows with new node ids
        and tiers (a few hundred tuples for a fleet), never with blocks."""
        self._with: dict[tuple[Holders, str, str], Holders] = {}
        self._without: dict[tuple[Holders, str], Holders] = {}
        """(holders, node, tier) -> holders with it; (holders, node) -> holders without it:
        an update costs dict lookups, not a sort and an intern."""
        self._lease_groups: dict[int, LeaseGroup] = {}
        self._copies: dict[str, list[tuple[bytes, str]]] = {}
        """Re-replication: source node -> (key, target node) copies it is to make, handed
        out with its heartbeats (take_copies)."""

    # ---- membership -------------------------------------------------------------------------
    def join(self, node_id: str, address: str, usage: Usage | None = None) -> None:
        """Register a node (a re-join after a restart forgets what it held before)."""
        if node_id in self._nodes:
            self.leave(node_id)
        now = self._clock()
        self._nodes[node_id] = NodeInfo(node_id, address, now, joined_s=now)
        if usage is not None:
            self.report_usage(node_id, usage)
        logger.info("master: node %s joined at %s", node_id, address)

    def heartbeat(self, node_id: str, usage: Usage | None = None) -> bool:
        """Refresh a node (and its usage); False if the master does not know it (it must
        join again)."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        node.last_seen_s = self._clock()
        if usage is not None:
            self.report_usage(node_id, usage)
        return True

    def report_usage(self, node_id: str, usage: Usage) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        node.capacity_blocks = usage.capacity_blocks
        node.num_blocks = usage.num_blocks
        node.num_bytes = usage.num_bytes
        node.num_placed = 0  # the report counts what was written so far

    def leave(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        self._copies.pop(node_id, None)
        for key in node.keys:
            self._drop_holder(key, node_id)
        num_copies = self._plan_copies(node.keys)
        logger.info("master: node %s left (%d blocks forgotten; %d copies to make, back to "
                    "%d replicas)", node_id, len(node.keys), num_copies, self.replicas)

    def _plan_copies(self, keys) -> int:
        """Blocks that fell under `replicas` holders (but kept one): a copy from a holder to
        each of the least full live nodes that lack them."""
        if self.replicas == 1:
            return 0
        planned = 0
        for key in keys:
            holders = self._holders(key)
            if not holders or len(holders) >= self.replicas:
                continue
            held = {node_id for node_id, _ in holders}
            targets = sorted((n for n in self._nodes.values() if n.node_id not in held),
                             key=lambda n: (n.fill(), n.num_placed, n.node_id))
            for target in targets[:self.replicas - len(holders)]:
                target.num_placed += 1
                self._copies.setdefault(holders[0][0], []).append((key, target.node_id))
                planned += 1
        return planned

    def take_copies(self, node_id: str, limit: int = 256) -> list[tuple[bytes, str]]:
        """Up to `limit` copies `node_id` is to make now: (key, the target's address), those
        still needed (the target alive and without it, the key still under `replicas`)."""
        queue = self._copies.get(node_id)
        taken: list[tuple[bytes, str]] = []
        while queue and len(taken) < limit:
            key, target = queue.pop(0)
            holders = {holder for holder, _ in self._index.get(key, ())}
            if (target in self._nodes and target not in holders and node_id in holders
                    and len(holders) < self.replicas):
                taken.append((key, self._nodes[target].address))
        if queue is not None and not queue:
            del self._copies[node_id]
        return taken

    @property
    def num_copies_pending(self) -> int:
        return sum(len(queue) for queue in self._copies.values())

    def expire_nodes(self) -> list[str]:
        """Drop nodes whose last heartbeat is older than node_ttl_s, and lease groups past
        their deadline; returns the dropped nodes' ids."""
        now = self._clock()
        gone = [n.node_id for n in self._nodes.values() if now - n.last_seen_s > self.node_ttl_s]
        for node_id in gone:
            logger.warning("master: node %s missed its heartbeats; dropping it", node_id)
            self.leave(node_id)
        for lease_id in [i for i, g in self._lease_groups.items() if g.expires_at_s <= now]:
            del self._lease_groups[lease_id]
        self._settle_joined(now)
        return gone

    def _settle_joined(self, now: float) -> None:
        """A node that joined node_ttl_s ago (a restarted one, a new one) gets copies of the
        blocks still under `replicas`: those whose holder left while it was away. Not at
        join: its inventory (and, after a master restart, the other nodes') is not in yet,
        and a block it already holds would be copied to it again."""
        fresh = [n for n in self._nodes.values()
                 if not n.is_settled and now - n.joined_s >= self.node_ttl_s]
        if not fresh:
            return
        for node in fresh:
            node.is_settled = True
        if self.replicas > 1:
            under = [key for key, holders in self._index.items()
                     if len(holders) < self.replicas]
            planned = self._plan_copies(under)
            if planned:
                logger.info("master: %d copies to make onto %s, back to %d replicas", planned,
                            ", ".join(n.node_id for n in fresh), self.replicas)

    def nodes(self) -> dict[str, str]:
        """node_id -> address of every live node."""
        return {n.node_id: n.address for n in self._nodes.values()}

    def usage(self) -> dict[str, Usage]:
        """node_id -> its usage as last reported, of every live node."""
        return {n.node_id: Usage(n.capacity_blocks, n.num_blocks, n.num_bytes)
                for n in self._nodes.values()}

    def _addresses(self, node_ids: set[str]) -> dict[str, str]:
        return {i: self._nodes[i].address for i in sorted(node_ids) if i in self._nodes}

    # ---- block index ------------------------------------------------------------------------
    def update(self, node_id: str, changes: Sequence[tuple[bytes, str | None]]) -> bool:
        """Apply a node's placement changes in order; False if the node is unknown."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        node.last_seen_s = self._clock()  # a report is a sign of life too
        index, node_keys = self._index, node.keys
        for key, tier in changes:
            if tier is None:
                node_keys.discard(key)
                self._drop_holder(key, node_id)
            else:
                node_keys.add(key)
                holders = index.get(key, ())
                changed = self._with.get((holders, node_id, tier))
                if changed is None:
                    changed = self._with[(holders, node_id, tier)] = self._intern(
                        tuple(sorted([*(h for h in holders if h[0] != node_id),
                                      (node_id, tier)], key=_holder_order)))
                index[key] = changed
        return True

    def _drop_holder(self, key: bytes, node_id: str) -> None:
        holders = self._index.get(key)
        if holders is None:
            return
        changed = self._without.get((holders, node_id))
        if changed is None:
            changed = self._without[(holders, node_id)] = self._intern(
                tuple(h for h in holders if h[0] != node_id))
        if changed:
            self._index[key] = changed
        else:
            del self._index[key]

    def _intern(self, holders: Holders) -> Holders:
        return self._interned.setdefault(holders, holders)

    def _holders(self, key: bytes) -> list[tuple[str, str]]:
        return list(self._index.get(key, ()))

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        holders: list[list[tuple[str, str]]] = []
        for key in keys:
            found = self._holders(key)
            if not found:
                break
            holders.append(found)
        named = {node_id for hs in holders for node_id, _ in hs}
        return PrefixLookup(len(holders), holders, self._addresses(named))

    def locate(self, keys: Sequence[bytes]) -> tuple[list[list[tuple[str, str]]],
                                                     dict[str, str]]:
        """Per key its holders, fastest tier first (empty: nobody); and their addresses."""
        holders = [self._holders(key) for key in keys]
        named = {node_id for hs in holders for node_id, _ in hs}
        return holders, self._addresses(named)

    # ---- placement --------------------------------------------------------------------------
    def place(self, keys: Sequence[bytes]) -> tuple[list[list[str]], list[bool],
                                                    dict[str, str]]:
        """Where to write each key: `replicas` distinct live nodes (fewer when fewer live),
        least full first; nothing for a key some live node holds (`held`) or already
        placed earlier in this batch. Returns (targets, held, addresses)."""
        targets: list[list[str]] = []
        held: list[bool] = []
        seen: set[bytes] = set()
        # The nodes by (fill, placements in flight, id), least full first: a key takes the
        # first `replicas` and puts them back with their new fill (log n a key, not a sort).
        # Ids are unique, so the NodeInfo last in each entry is never compared.
        order = [(n.fill(), n.num_placed, n.node_id, n) for n in self._nodes.values()]
        heapq.heapify(order)
        num_chosen = min(self.replicas, len(order))
        for key in keys:
            is_held = key in self._index
            held.append(is_held)
            if is_held or key in seen or not order:
                targets.append([])
                continue
            seen.add(key)
            chosen = [heapq.heappop(order)[3] for _ in range(num_chosen)]
            for node in chosen:
                node.num_placed += 1
                heapq.heappush(order, (node.fill(), node.num_placed, node.node_id, node))
            targets.append([node.node_id for node in chosen])
        named = {node_id for ts in targets for node_id in ts}
        return targets, held, self._addresses(named)

    # ---- lease groups -----------------------------------------------------------------------
    def add_lease_group(self, node_leases: Sequence[tuple[str, int]], ttl_s: float) -> int:
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._lease_groups:
            lease_id = secrets.randbits(63) or 1
        self._lease_groups[lease_id] = LeaseGroup(list(node_leases), self._clock() + ttl_s)
        return lease_id

    def take_lease_group(self, lease_id: int) -> tuple[bool, list[tuple[str, int]],
                                                       dict[str, str]]:
        """End a group: (known, its leases on nodes still live, their addresses)."""
        group = self._lease_groups.pop(lease_id, None)
        if group is None:
            return False, [], {}
        live = [(node_id, i) for node_id, i in group.node_leases if node_id in self._nodes]
        return True, live, self._addresses({node_id for node_id, _ in live})

    @property
    def num_lease_groups(self) -> int:
        return len(self._lease_groups)

    # ---- introspection ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, int]:
        """Fleet totals, then per node: capacity and what it holds (`<name>.<node_id>`)."""
        nodes = sorted(self._nodes.values(), key=lambda n: n.node_id)
        out = {"num_nodes": len(nodes), "num_master_blocks": len(self._index),
               "replicas": self.replicas, "num_lease_groups": len(self._lease_groups),
               "capacity_blocks": sum(n.capacity_blocks for n in nodes),
               "num_node_blocks": sum(n.num_blocks for n in nodes),
               "num_node_bytes": sum(n.num_bytes for n in nodes)}
        for n in nodes:
            out[f"capacity_blocks.{n.node_id}"] = n.capacity_blocks
            out[f"num_blocks.{n.node_id}"] = n.num_blocks
            out[f"num_bytes.{n.node_id}"] = n.num_bytes
            out[f"num_indexed.{n.node_id}"] = len(n.keys)
        return out

    def check_integrity(self) -> None:
        """The index and the per-node key sets describe the same placements."""
        from_nodes = {(k, n.node_id) for n in self._nodes.values() for k in n.keys}
        from_index = {(k, node_id) for k, holders in self._index.items()
                      for node_id, _ in holders}
        if from_nodes != from_index:
            raise AssertionError(
                f"master index out of sync: {len(from_nodes ^ from_index)} placements differ")
        if any(not holders for holders in self._index.values()):
            raise AssertionError("master index has a key with no holder")
        if any(self._interned.get(holders) is not holders or
               list(holders) != sorted(holders, key=_holder_order)
               for holders in self._index.values()):
            raise AssertionError("master index has holders not interned or out of order")
