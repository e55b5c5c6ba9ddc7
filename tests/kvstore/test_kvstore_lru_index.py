"""LRUIndex: exact least-recently-used order, and both tiers ordering blocks by it alike."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvstore.disk_tier import DiskTier
from pdserve.kvstore.lru_index import LRUIndex
from pdserve.kvstore.memory_tier import MemoryTier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_exact_eviction_order():
    index: LRUIndex[int] = LRUIndex()
    for i in range(4):
        index.insert(key(i), 10 * i)
    assert list(index.oldest_first()) == [key(0), key(1), key(2), key(3)]
    index.touch(key(1))  # used: now the newest
    assert index.get(key(0)) == 0  # a read does not count as a use
    index.insert(key(2), 99)  # a re-insert replaces the value and counts as a use
    assert list(index.oldest_first()) == [key(0), key(3), key(1), key(2)]
    assert index.get(key(2)) == 99 and index.get(key(7)) is None

    # Evicting oldest first, as the tiered store does, drains in exactly that order.
    evicted = []
    while len(index):
        victim = next(index.oldest_first())
        evicted.append((victim, index.pop(victim)))
    assert evicted == [(key(0), 0), (key(3), 30), (key(1), 10), (key(2), 99)]
    assert key(0) not in index and len(index) == 0


def test_missing_keys_raise():
    index: LRUIndex[str] = LRUIndex()
    index.insert(key(0), "a")
    with pytest.raises(KeyError):
        index.touch(key(1))
    with pytest.raises(KeyError):
        index.pop(key(1))
    assert key(0) in index and key(1) not in index
    index.clear()
    assert list(index.oldest_first()) == []


def test_memory_and_disk_tiers_keep_the_same_order(tmp_path):
    memory = MemoryTier("dram", 8)
    disk = DiskTier("disk", 8, str(tmp_path))
    for tier in (memory, disk):
        for i in range(5):
            tier.insert(key(i), torch.full((8,), i, dtype=torch.uint8))
        tier.touch(key(0))
        tier.remove(key(2))
        tier.insert(key(3), torch.zeros(8, dtype=torch.uint8))
        assert tier.read(key(1)) is not None  # reads leave the order alone
    expected = [key(1), key(4), key(0), key(3)]
    assert list(memory.keys_oldest_first()) == expected
    assert list(disk.keys_oldest_first()) == expected
    memory.check_integrity()
    disk.check_integrity()
    disk.close()
