"""LRUIndex: block keys in least-recently-used order, each with a value; the one LRU ordering
both tiers keep (the memory tier maps a key to its tensor, the disk tier to its payload size).

    oldest ──► [k3] [k1] [k7] [k2] ◄── newest        insert(k) / touch(k): k moves to the end

The index only orders; it never evicts on its own. The TieredStore above picks a victim (the
oldest unpinned key) and decides where it goes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUIndex(Generic[V]):
    """key -> value, iterated oldest first. Not thread-safe: its tier's owner serialises."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, V] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def insert(self, key: bytes, value: V) -> None:
        """Set `key` to `value` as the most recently used entry (replacing any old value)."""
        self._entries[key] = value
        self._entries.move_to_end(key)

    def touch(self, key: bytes) -> None:
        """Make `key` the most recently used entry; KeyError if absent."""
        self._entries.move_to_end(key)

    def get(self, key: bytes) -> V | None:
        """The value of `key` or None; does not change the order."""
        return self._entries.get(key)

    def pop(self, key: bytes) -> V:
        """Remove `key` and return its value; KeyError if absent."""
        return self._entries.pop(key)

    def oldest_first(self) -> Iterator[bytes]:
        """A live iterator over the keys, least recently used first: stop iterating before
        changing the index."""
        return iter(self._entries)

    def clear(self) -> None:
        self._entries.clear()
