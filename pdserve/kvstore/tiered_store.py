"""The tiered store: device pool -> host DRAM -> disk, LRU within each tier, pins, promotion.

A block lives in exactly one tier (exclusive hierarchy, as in Mooncake: a copy in two tiers
would halve what fits). Writes land in the top tier; a full tier demotes its least recently
used *unpinned* block one tier down; the bottom tier drops it. A hit in a lower tier promotes
the block to the top. Pinned blocks (pin counts, usually held through a lease) are never
demoted or dropped.

    put ──► [device] ──LRU──► [DRAM] ──LRU──► [disk] ──LRU──► dropped
    get ◄── promote to top ◄──────────────────────┘

All verbs are thread-safe (one lock, held for bookkeeping only); batch forms take lists. A
block that get or prefetch must read from disk is read *outside* the lock, then its placement
is confirmed under it (`_read_then`), so a slow disk holds up no other verb. `on_change(key,
tier | None)` reports every placement change, under the lock (the master's block index
follows it).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from pdserve.kvstore.disk_tier import DiskTier
from pdserve.kvstore.memory_tier import BytesLike, MemoryTier, as_uint8_tensor

logger = logging.getLogger(__name__)

Tier = MemoryTier | DiskTier
ChangeListener = Callable[[bytes, "str | None"], None]
T = TypeVar("T")

# A disk read outside the lock is retried this often when the block moved meanwhile; then it
# is read under the lock (other verbs wait, but the read is sure to finish).
_MAX_UNLOCKED_READS = 3


class TieredStore:
    """Blocks keyed by bytes across an ordered list of tiers (top = fastest)."""

    def __init__(self, tiers: Sequence[Tier], on_change: ChangeListener | None = None):
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self._on_change = on_change
        self._lock = threading.RLock()
        self._pins: Counter[bytes] = Counter()
        self.num_hits: Counter[str] = Counter()  # tier name -> hits found there
        self.num_misses = 0
        self.num_dropped = 0

    @classmethod
    def build(cls, dram_capacity_blocks: int, disk_capacity_blocks: int = 0,
              disk_dir: str | None = None, device_capacity_blocks: int = 0,
              device: str = "cpu", on_change: ChangeListener | None = None) -> TieredStore:
        """The usual stack: [device pool], DRAM, [disk]; a zero capacity leaves a tier out."""
        tiers: list[Tier] = []
        if device_capacity_blocks > 0:
            tiers.append(MemoryTier("device", device_capacity_blocks, device))
        tiers.append(MemoryTier("dram", dram_capacity_blocks, "cpu"))
        if disk_capacity_blocks > 0:
            if disk_dir is None:
                raise ValueError("disk_dir is required for a disk tier")
            tiers.append(DiskTier("disk", disk_capacity_blocks, disk_dir))
        return cls(tiers, on_change)

    # ---- placement --------------------------------------------------------------------------
    def _tier_index(self, key: bytes) -> int | None:
        for i, tier in enumerate(self.tiers):
            if tier.contains(key):
                return i
        return None

    def _notify(self, key: bytes, tier_name: str | None) -> None:
        if self._on_change is not None:
            self._on_change(key, tier_name)

    def _make_room(self, i: int) -> bool:
        """Free one slot in tier i by demoting its LRU unpinned block; False if all pinned."""
        tier = self.tiers[i]
        while tier.is_full():
            victim = next((k for k in tier.keys_oldest_first() if not self._pins[k]), None)
            if victim is None:
                return False
            # The bottom tier drops its victim: no need to read it (from disk, at that).
            data = tier.read(victim) if i + 1 < len(self.tiers) else None
            tier.remove(victim)
            if data is not None and self._make_room(i + 1):
                self.tiers[i + 1].insert(victim, data, adopt=True)  # tier i let go of it
                self._notify(victim, self.tiers[i + 1].name)
            else:
                self.num_dropped += 1
                self._notify(victim, None)
        return True

    def _insert_from(self, start: int, key: bytes, data: torch.Tensor, adopt: bool) -> bool:
        """Insert into the highest tier at or below `start` that can make room."""
        for i in range(start, len(self.tiers)):
            if self._make_room(i):
                self.tiers[i].insert(key, data, adopt=adopt)
                self._notify(key, self.tiers[i].name)
                return True
        return False

    def _move(self, key: bytes, src: int, dst: int, data: torch.Tensor) -> None:
        """Promote `key` from tier src up to tier dst (dst < src) if dst can make room."""
        self.tiers[src].remove(key)
        if not self._insert_from(dst, key, data, adopt=True):
            self.num_dropped += 1
            self._notify(key, None)

    # ---- verbs ------------------------------------------------------------------------------
    def put(self, key: bytes, data: BytesLike, adopt: bool = False) -> bool:
        """Store a block (a copy of data, or with `adopt` possibly data itself: the caller
        gives the buffer up); an existing key is only refreshed. False if no tier can take it
        (every tier full of pinned blocks)."""
        with self._lock:
            i = self._tier_index(key)
            if i is not None:
                self.tiers[i].touch(key)
                return True
            return self._insert_from(0, key, as_uint8_tensor(data), adopt)

    def put_many(self, keys: Sequence[bytes], blocks: Sequence[BytesLike],
                 adopt: bool = False) -> list[bool]:
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        return [self.put(k, b, adopt) for k, b in zip(keys, blocks, strict=True)]

    def _read_then(self, key: bytes, dst: int,
                   then: Callable[[int | None, torch.Tensor | None], T]) -> T:
        """`then(i, data)` under the lock, with i the tier holding `key` (None: absent) and data
        its block (None: corrupted, or on disk at or above tier `dst`, so not needed).

        A disk block is read without the lock, then the lock is taken again and the block
        must still be in the same tier, else it moved meanwhile and is looked up again. Keys
        name content, so a block that left and came back has the same bytes."""
        for attempt in range(_MAX_UNLOCKED_READS + 1):
            with self._lock:
                i = self._tier_index(key)
                if i is None:
                    return then(None, None)
                tier = self.tiers[i]
                if not isinstance(tier, DiskTier) or attempt == _MAX_UNLOCKED_READS:
                    return then(i, tier.read(key))
                if i <= dst:
                    return then(i, None)
            data = tier.load(key)  # the slow part, lock free
            with self._lock:
                if self._tier_index(key) == i:
                    # A failed load is judged under the lock by read(), which drops a
                    # corrupted file (a concurrent write could also have made it fail).
                    return then(i, data if data is not None else tier.read(key))
        raise AssertionError("unreachable: the last attempt reads under the lock")

    def get(self, key: bytes) -> torch.Tensor | None:
        """The block (read-only: do not modify) or None; a hit promotes it to the top tier."""
        return self._read_then(key, 0, lambda i, data: self._hit(key, i, data))

    def _hit(self, key: bytes, i: int | None, data: torch.Tensor | None) -> torch.Tensor | None:
        """get's bookkeeping, under the lock: count, promote, return the stored block."""
        if i is None or data is None:
            self.num_misses += 1
            if i is not None:
                self._notify(key, None)  # the tier dropped a corrupted block
            return None
        self.num_hits[self.tiers[i].name] += 1
        if i == 0:
            self.tiers[0].touch(key)
            return data
        self._move(key, i, 0, data)
        j = self._tier_index(key)
        return data if j is None else self.tiers[j].read(key)

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        return [self.get(k) for k in keys]

    def exists(self, key: bytes) -> bool:
        with self._lock:
            return self._tier_index(key) is not None

    def tier_of(self, key: bytes) -> str | None:
        with self._lock:
            i = self._tier_index(key)
            return None if i is None else self.tiers[i].name

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (no LRU change)."""
        with self._lock:
            for n, key in enumerate(keys):
                if self._tier_index(key) is None:
                    return n
            return len(keys)

    def prefetch(self, keys: Sequence[bytes], tier: str = "dram") -> int:
        """Bring blocks below `tier` up into it ahead of use; returns how many moved."""
        dst = next((i for i, t in enumerate(self.tiers) if t.name == tier), None)
        if dst is None:
            raise ValueError(f"no tier named {tier!r}")
        return sum(self._read_then(key, dst, lambda i, data, key=key: self._promote(
            key, i, data, dst)) for key in keys)

    def _promote(self, key: bytes, i: int | None, data: torch.Tensor | None, dst: int) -> bool:
        """prefetch's bookkeeping, under the lock: True if the block moved up to tier dst."""
        if i is None or i <= dst:
            return False
        if data is None:
            self._notify(key, None)  # the tier dropped a corrupted block
            return False
        self._move(key, i, dst, data)
        return True

    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        """Pin present blocks (counted); True for each block that is now pinned."""
        with self._lock:
            pinned = []
            for key in keys:
                present = self._tier_index(key) is not None
                if present:
                    self._pins[key] += 1
                pinned.append(present)
            return pinned

    def release(self, keys: Sequence[bytes]) -> None:
        """Undo one pin of each key (keys that were never pinned are an error)."""
        with self._lock:
            for key in keys:
                if self._pins[key] <= 0:
                    raise KeyError(f"release of unpinned block {key.hex()}")
                self._pins[key] -= 1
                if self._pins[key] == 0:
                    del self._pins[key]

    def evict(self, keys: Sequence[bytes]) -> int:
        """Drop unpinned blocks outright; returns how many were dropped."""
        with self._lock:
            num_evicted = 0
            for key in keys:
                i = self._tier_index(key)
                if i is None or self._pins[key]:
                    continue
                self.tiers[i].remove(key)
                self._notify(key, None)
                num_evicted += 1
            return num_evicted

    # ---- introspection ----------------------------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return sum(1 for c in self._pins.values() if c > 0)

    @property
    def num_pins(self) -> int:
        """Pins summed over blocks (a block pinned twice counts twice)."""
        with self._lock:
            return sum(self._pins.values())

    def keys_in(self, tier: str) -> list[bytes]:
        """Keys of one tier, least recently used first (tests check exact LRU order)."""
        with self._lock:
            return list(next(t for t in self.tiers if t.name == tier).keys_oldest_first())

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"num_blocks_{t.name}": t.num_blocks for t in self.tiers}
            out.update({f"num_hits_{t.name}": self.num_hits[t.name] for t in self.tiers})
            out.update(num_misses=self.num_misses, num_dropped=self.num_dropped,
                       num_pinned=self.num_pinned_blocks)
            return out

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for the disk tier's write-behind queue to drain."""
        return all(t.flush(timeout_s) for t in self.tiers if isinstance(t, DiskTier))

    def check_integrity(self) -> None:
        """Every block in exactly one tier, capacities held, every pin on a present block."""
        with self._lock:
            seen: set[bytes] = set()
            for tier in self.tiers:
                tier.check_integrity()
                keys = set(tier.keys_oldest_first())
                if keys & seen:
                    raise AssertionError(f"blocks in two tiers: {len(keys & seen)}")
                seen |= keys
            missing = [k for k, c in self._pins.items() if c > 0 and k not in seen]
            if missing:
                raise AssertionError(f"{len(missing)} pinned blocks are not stored")

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
