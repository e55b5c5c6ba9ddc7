"""Tiered store, disk tier, leases and master, in process (no sockets)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pdserve.kvstore.disk_tier import DiskTier
from pdserve.kvstore.lease import LeaseTable
from pdserve.kvstore.master import Master
from pdserve.kvstore.memory_tier import back_to_back_runs, run_view
from pdserve.kvstore.tiered_store import TieredStore


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, num_bytes: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_store(tmp_path, device=2, dram=2, disk=3) -> TieredStore:
    return TieredStore.build(dram, disk, str(tmp_path / "disk"), device_capacity_blocks=device)


def test_put_get_bit_exact_through_every_tier(tmp_path):
    store = make_store(tmp_path)
    for i in range(7):  # 2 device + 2 dram + 3 disk
        assert store.put(key(i), block(i))
    assert [store.tier_of(key(i)) for i in range(7)] == ["disk"] * 3 + ["dram"] * 2 + [
        "device"] * 2
    store.flush()
    for i in range(7):  # each get promotes; everything still fits, nothing dropped
        got = store.get(key(i))
        assert got is not None and torch.equal(got.cpu(), block(i))
    assert store.stats()["num_dropped"] == 0
    assert store.get(key(99)) is None
    store.check_integrity()
    assert store.num_pinned_blocks == 0
    store.close()


def test_exact_lru_order_and_drop(tmp_path):
    store = make_store(tmp_path, device=0, dram=3, disk=2)
    for i in range(3):
        store.put(key(i), block(i))
    store.get(key(0))  # 0 becomes most recent: LRU order 1, 2, 0
    assert store.keys_in("dram") == [key(1), key(2), key(0)]
    store.put(key(3), block(3))  # demotes 1
    store.put(key(4), block(4))  # demotes 2
    assert store.keys_in("dram") == [key(0), key(3), key(4)]
    assert store.keys_in("disk") == [key(1), key(2)]
    store.put(key(5), block(5))  # demotes 0; disk full -> drops 1 (its LRU)
    assert store.keys_in("disk") == [key(2), key(0)]
    assert not store.exists(key(1))
    got = store.get(key(2))  # disk hit promotes 2, demoting dram's LRU (3)
    assert got is not None and torch.equal(got, block(2))
    assert store.keys_in("dram") == [key(4), key(5), key(2)]
    assert store.keys_in("disk") == [key(0), key(3)]
    store.check_integrity()
    store.close()


def test_pins_block_eviction(tmp_path):
    store = TieredStore.build(dram_capacity_blocks=2)
    store.put(key(0), block(0))
    store.put(key(1), block(1))
    assert store.pin([key(0), key(7)]) == [True, False]
    store.put(key(2), block(2))  # 0 is LRU but pinned: 1 goes
    assert store.exists(key(0)) and not store.exists(key(1))
    assert store.evict([key(0)]) == 0
    store.pin([key(2)])
    assert store.put(key(3), block(3)) is False  # every block pinned, nowhere to go
    store.release([key(0), key(2)])
    with pytest.raises(KeyError):
        store.release([key(0)])
    assert store.put(key(3), block(3)) and not store.exists(key(0))
    assert store.num_pinned_blocks == 0
    store.check_integrity()


def test_prefetch_brings_blocks_up_to_dram(tmp_path):
    store = make_store(tmp_path, device=1, dram=1, disk=4)
    for i in range(4):
        store.put(key(i), block(i))
    assert store.tier_of(key(0)) == "disk"
    assert store.prefetch([key(0), key(3), key(42)]) == 1  # 3 is already above dram
    assert store.tier_of(key(0)) == "dram"
    assert store.lookup_prefix([key(0), key(1), key(42), key(2)]) == 2
    store.check_integrity()
    store.close()


def test_disk_tier_survives_restart_and_detects_corruption(tmp_path):
    directory = str(tmp_path / "disk")
    disk = DiskTier("disk", 4, directory)
    for i in range(3):
        disk.insert(key(i), block(i, 1000))
    disk.close()  # flushes the write-behind queue
    disk = DiskTier("disk", 4, directory)
    assert disk.num_blocks == 3
    assert set(disk.keys_oldest_first()) == {key(0), key(1), key(2)}
    got = disk.read(key(1))
    assert got is not None and torch.equal(got, block(1, 1000))
    path = os.path.join(directory, key(2).hex() + ".kv")
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert disk.read(key(2)) is None
    assert disk.num_corrupted == 1 and not disk.contains(key(2))
    disk.flush()
    assert not os.path.exists(path)
    disk.check_integrity()
    disk.close()


def test_restart_reindexes_into_the_store(tmp_path):
    store = make_store(tmp_path, device=0, dram=1, disk=3)
    for i in range(3):
        store.put(key(i), block(i))
    store.close()
    store = make_store(tmp_path, device=0, dram=1, disk=3)
    assert store.lookup_prefix([key(0), key(1)]) == 2  # both were on disk
    got = store.get(key(0))
    assert got is not None and torch.equal(got, block(0))
    store.check_integrity()
    store.close()


def test_leases_expire():
    clock = FakeClock()
    leases = LeaseTable(clock)
    a = leases.acquire("a", [key(0)], ttl_s=5)
    b = leases.acquire("b", [key(1)], ttl_s=10)
    clock.now_s = 6
    assert [lease.lease_id for lease in leases.expire()] == [a.lease_id]
    assert leases.renew(b.lease_id, ttl_s=10)  # now due at 16
    assert not leases.renew(a.lease_id, ttl_s=10)
    clock.now_s = 15
    assert leases.expire() == []
    clock.now_s = 16
    assert [lease.holder for lease in leases.expire()] == ["b"]
    assert leases.num_leases == 0


def test_master_lookup_prefix_heartbeats_and_leaving():
    clock = FakeClock()
    master = Master(node_ttl_s=10, clock=clock)
    master.join("n1", "tcp://127.0.0.1:1")
    master.join("n2", "tcp://127.0.0.1:2")
    master.update("n1", [(key(0), "dram"), (key(1), "disk"), (key(2), "dram")])
    master.update("n2", [(key(0), "disk"), (key(1), "dram")])
    found = master.lookup_prefix([key(0), key(1), key(5), key(2)])
    assert found.num_blocks == 2
    assert found.holders[0] == [("n1", "dram"), ("n2", "disk")]
    master.update("n1", [(key(1), None)])
    assert master.lookup_prefix([key(1)]).holders == [[("n2", "dram")]]
    clock.now_s = 8
    assert master.heartbeat("n1")
    clock.now_s = 12  # n2 silent for 12 s > 10
    assert master.expire_nodes() == ["n2"]
    assert master.lookup_prefix([key(0), key(1)]).num_blocks == 1
    assert not master.heartbeat("n2") and not master.update("n2", [(key(3), "dram")])
    master.leave("n1")
    assert master.num_blocks == 0 and master.nodes() == {}
    master.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tier_on_cuda_with_pinned_dram(tmp_path):
    store = TieredStore.build(2, 2, str(tmp_path / "disk"), device_capacity_blocks=2,
                              device="cuda")
    for i in range(6):
        assert store.put(key(i), block(i).cuda())
    assert store.tiers[1].read(key(2)).is_pinned()  # DRAM is pinned host memory
    for i in range(6):
        got = store.get(key(i))
        assert got.is_cuda and torch.equal(got.cpu(), block(i))
    store.check_integrity()
    store.close()


def test_put_copies_unless_the_caller_gives_the_buffer_up():
    store = TieredStore.build(dram_capacity_blocks=4)
    mine = block(1).clone()
    store.put(key(1), mine)
    mine.zero_()  # the caller reuses its buffer: the stored block must not change
    assert torch.equal(store.get(key(1)), block(1))
    given = block(2).clone()
    store.put(key(2), given, adopt=True)
    assert store.get(key(2)).data_ptr() == given.data_ptr()  # kept, not copied


def test_disk_write_behind_is_bounded(tmp_path):
    disk = DiskTier("disk", 64, str(tmp_path), max_pending_writes=2)
    for i in range(20):  # waits for the writer whenever two writes are queued
        disk.insert(key(i), block(i))
    assert disk.flush(10)
    assert disk.num_blocks == 20 and len(os.listdir(tmp_path)) == 20
    assert all(torch.equal(disk.read(key(i)), block(i)) for i in range(20))
    disk.close()


def test_blocks_back_to_back_in_one_buffer_are_one_run_and_one_view():
    """A hand-off's blocks are views of one staging tensor: the store sends them as one UCX
    message, and the client's receive buffer joins again without a copy."""
    staging = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)
    views = [staging[i].view(torch.uint8) for i in range(4)]
    assert back_to_back_runs(views) == [(0, 4)]
    joined = run_view(views)
    assert joined.data_ptr() == staging.data_ptr()  # a view, not a copy
    assert torch.equal(joined, staging.view(-1).view(torch.uint8))
    apart = [views[0], views[2], views[3], views[1].clone()]
    assert back_to_back_runs(apart) == [(0, 1), (1, 3), (3, 4)]
    assert torch.equal(run_view(apart[1:3]), staging[2:].reshape(-1).view(torch.uint8))
    received = np.arange(64, dtype=np.uint8)
    blocks = [received[0:16], received[16:32], received[40:48]]
    assert back_to_back_runs(blocks) == [(0, 2), (2, 3)]
    assert run_view(blocks[:2]).tolist() == list(range(32))
    assert back_to_back_runs([b"abcd", b"efgh"]) == [(0, 1), (1, 2)]  # frames: never joined
