"""The KV connector against the engine's pool layout, in process and over a store server."""

from __future__ import annotations

import pytest
import torch

from pdserve.handoff.connector import HandoffConnector, make_in_process_connector
from pdserve.kvstore.block_key import KVLayout, block_keys, root_key
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.connector import block_runs
from pdserve.kvstore.server import StoreServer

LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=3, num_kv_heads=4, head_dim=8)


def make_pool(num_blocks: int, num_heads: int = 4, seed: int | None = None) -> list[torch.Tensor]:
    """kv_caches[l]: [2, num_blocks, block_size, num_heads, head_dim] like
    pdserve/serve/executor/kv_cache.py."""
    shape = (2, num_blocks, LAYOUT.block_size, num_heads, LAYOUT.head_dim)
    if seed is None:
        return [torch.zeros(shape) for _ in range(LAYOUT.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]


def request_keys(num_blocks: int, salt: str | None = None) -> list[bytes]:
    tokens = list(range(100, 100 + num_blocks * LAYOUT.block_size))
    return block_keys(tokens, LAYOUT.block_size, root_key("tiny", LAYOUT, salt))


def save_all_layers(connector: HandoffConnector, rid: str, keys, block_ids, pool) -> None:
    for layer in range(LAYOUT.num_layers):
        connector.save_layer(rid, layer, keys, block_ids, pool[layer])


def wait_results(connector: HandoffConnector, n: int):
    assert connector.drain(10)
    results = connector.poll()
    assert len(results) == n
    return results


def test_save_then_load_round_trips_into_other_block_ids():
    connector = make_in_process_connector(LAYOUT, dram_capacity_blocks=16)
    prefill = make_pool(8, seed=0)
    keys = request_keys(3)
    save_all_layers(connector, "r1", keys, [5, 1, 6], prefill)
    assert wait_results(connector, 1)[0].num_blocks == 3
    assert connector.lookup(keys + request_keys(4, salt="other")) == 3
    decode = make_pool(8)
    connector.start_load("r1", keys[:2], [0, 7], decode)
    for layer in range(LAYOUT.num_layers):
        assert connector.wait_for_layer_load("r1", layer, timeout_s=10) == 2
    (result,) = wait_results(connector, 1)
    assert (result.kind, result.num_blocks, result.error) == ("load", 2, None)
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(decode[layer][:, 0], prefill[layer][:, 5])
        assert torch.equal(decode[layer][:, 7], prefill[layer][:, 1])
        assert decode[layer][:, 1:7].abs().sum() == 0  # nothing else touched
    assert connector.num_in_flight == 0
    connector.backend.check_integrity()
    assert connector.backend.num_pinned_blocks == 0
    connector.close()


def test_runs_of_consecutive_blocks_are_staged_in_request_order():
    """save_layer copies each run of consecutive pool blocks in one slice."""
    assert block_runs([5, 6, 7, 2, 3, 9]) == [(0, 3, 5), (3, 5, 2), (5, 6, 9)]
    assert block_runs([]) == []
    connector = make_in_process_connector(LAYOUT, dram_capacity_blocks=16)
    prefill = make_pool(8, seed=1)
    keys = request_keys(4)
    save_all_layers(connector, "r", keys, [2, 3, 4, 0], prefill)
    assert wait_results(connector, 1)[0].num_blocks == 4
    decode = make_pool(8)
    connector.start_load("r", keys, [4, 5, 6, 7], decode)
    (result,) = wait_results(connector, 1)
    assert (result.kind, result.num_blocks, result.error) == ("load", 4, None)
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(decode[layer][:, 4:7], prefill[layer][:, 2:5])
        assert torch.equal(decode[layer][:, 7], prefill[layer][:, 0])
    connector.backend.check_integrity()
    connector.close()


def test_a_load_without_a_pool_hands_over_the_blocks_per_layer():
    """kv_caches None (a decode worker allocates pool blocks once the KV arrived): nothing is
    written anywhere, and the result carries each layer's blocks, this rank's heads only."""
    connector = make_in_process_connector(LAYOUT, dram_capacity_blocks=16)
    prefill = make_pool(8, seed=3)
    keys = request_keys(3)
    save_all_layers(connector, "r1", keys, [4, 0, 2], prefill)
    wait_results(connector, 1)
    connector.start_load("r1", keys, [0, 1, 2], None)
    (result,) = wait_results(connector, 1)
    assert (result.kind, result.num_blocks, result.error) == ("load", 3, None)
    assert len(result.layers) == LAYOUT.num_layers
    for layer, blocks in enumerate(result.layers):
        assert torch.equal(blocks, prefill[layer][:, [4, 0, 2]])
    rank1 = HandoffConnector(connector.backend, LAYOUT, tp_rank=1, tp_size=2)
    rank1.start_load("r2", keys[:2], [0, 1], None)
    (result,) = wait_results(rank1, 1)
    assert torch.equal(result.layers[1], prefill[1][:, [4, 0], :, 2:])
    missing = request_keys(2, salt="never saved")
    connector.start_load("r3", missing, [0, 1], None)
    (result,) = wait_results(connector, 1)
    assert (result.num_blocks, result.layers) == (0, None)
    rank1.close()
    connector.close()


def test_wakeup_fd_is_readable_while_a_completion_waits():
    """A serving loop sleeps on wakeup_fd while transfers run: it must turn readable when a
    save or load finishes, and quiet again once poll() took the results."""
    import os
    import select

    connector = make_in_process_connector(LAYOUT, dram_capacity_blocks=16)
    fd = connector.wakeup_fd
    assert select.select([fd], [], [], 0)[0] == []
    keys = request_keys(2)
    save_all_layers(connector, "r1", keys, [0, 1], make_pool(4, seed=1))
    assert select.select([fd], [], [], 10)[0] == [fd]
    assert [r.kind for r in connector.poll()] == ["save"]
    assert select.select([fd], [], [], 0)[0] == []
    connector.start_load("r2", keys, [2, 3], make_pool(4))
    assert select.select([fd], [], [], 10)[0] == [fd]
    assert [r.kind for r in connector.poll()] == ["load"]
    assert select.select([fd], [], [], 0)[0] == []
    connector.close()
    with pytest.raises(OSError):  # closed with the connector: no descriptor leaks
        os.fstat(fd)


def test_store_fills_run_beside_the_jobs_at_the_lowest_priority():
    """A write-back (connector.fill) runs on its own thread at nice 19, so a job queued
    behind it (a load, a pull, a release) does not wait for it; drain waits for both."""
    import os
    import threading

    connector = make_in_process_connector(LAYOUT, 8)
    try:
        in_fill, release_fill, seen = threading.Event(), threading.Event(), {}

        def fill() -> None:
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            in_fill.set()
            release_fill.wait(10)

        connector.fill(fill)
        assert in_fill.wait(10) and seen["nice"] == 19
        job_ran = threading.Event()
        connector.run_job(job_ran.set)
        assert job_ran.wait(10)  # not behind the fill
        assert not connector.drain(0.2)  # the fill is still running
        release_fill.set()
        assert connector.drain(10) and connector.num_in_flight == 0
    finally:
        connector.close()


def test_tp2_reader_takes_its_heads():
    store_side = make_in_process_connector(LAYOUT, dram_capacity_blocks=4)
    pool = make_pool(2, seed=1)
    keys = request_keys(2)
    save_all_layers(store_side, "w", keys, [0, 1], pool)
    wait_results(store_side, 1)
    rank1 = HandoffConnector(store_side.backend, LAYOUT, tp_rank=1, tp_size=2)
    half = make_pool(2, num_heads=2)
    rank1.start_load("r", keys, [1, 0], half)
    assert wait_results(rank1, 1)[0].num_blocks == 2
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(half[layer][:, 1], pool[layer][:, 0, :, 2:4])
        assert torch.equal(half[layer][:, 0], pool[layer][:, 1, :, 2:4])
    with pytest.raises(NotImplementedError):
        rank1.save_layer("s", 0, keys, [0, 1], half[0])
    rank1.close()
    store_side.close()


def test_mla_latent_blocks_round_trip_whole_into_every_tp_rank():
    """An MLA pool has one plane and one "head": any TP rank saves it and every rank loads
    all of it (the latent is replicated, not split by heads)."""
    layout = KVLayout(dtype="float32", block_size=4, num_layers=3, num_kv_heads=1,
                      head_dim=24, kind="mla")
    g = torch.Generator().manual_seed(4)
    shape = (1, 3, layout.block_size, 1, layout.head_dim)
    pool = [torch.randn(shape, generator=g) for _ in range(layout.num_layers)]
    writer = make_in_process_connector(layout, dram_capacity_blocks=4)
    assert writer.block_bytes == 3 * 4 * 24 * 4  # no V plane
    keys = block_keys(list(range(8)), layout.block_size, root_key("tiny-mla", layout))
    for layer in range(layout.num_layers):
        writer.save_layer("w", layer, keys, [2, 0], pool[layer])
    assert wait_results(writer, 1)[0].num_blocks == 2
    rank1 = HandoffConnector(writer.backend, layout, tp_rank=1, tp_size=2)
    dst = [torch.zeros(shape) for _ in range(layout.num_layers)]
    rank1.start_load("r", keys, [0, 1], dst)
    assert wait_results(rank1, 1)[0].num_blocks == 2
    for layer in range(layout.num_layers):
        assert torch.equal(dst[layer][:, 0], pool[layer][:, 2])
        assert torch.equal(dst[layer][:, 1], pool[layer][:, 0])
    rank1.close()
    writer.close()


def test_missing_and_corrupt_blocks_load_as_a_miss():
    connector = make_in_process_connector(LAYOUT, dram_capacity_blocks=8)
    pool = make_pool(4, seed=2)
    keys = request_keys(3)
    save_all_layers(connector, "w", keys[:1], [0], pool)
    wait_results(connector, 1)
    connector.backend.put(keys[2], b"short")  # the wrong size: never copied into a pool
    dst = make_pool(4)
    connector.start_load("r", keys, [1, 2, 3], dst)
    (result,) = wait_results(connector, 1)
    assert result.num_blocks == 1 and "missing" in result.error
    assert torch.equal(dst[0][:, 1], pool[0][:, 0]) and dst[0][:, 2:].abs().sum() == 0
    connector.close()


class BrokenBackend:
    def lookup_prefix(self, keys):
        raise ConnectionError("store down")

    def put_many(self, keys, blocks):
        raise ConnectionError("store down")

    def get_many(self, keys):
        raise ConnectionError("store down")

    def prefetch(self, keys):
        raise ConnectionError("store down")


def test_a_failing_store_is_a_miss_not_an_error():
    connector = HandoffConnector(BrokenBackend(), LAYOUT)
    keys = request_keys(2)
    assert connector.lookup(keys) == 0
    connector.prefetch(keys)  # swallowed: a hint
    pool = make_pool(2)
    connector.start_load("r", keys, [0, 1], pool)
    assert connector.wait_for_layer_load("r", 2, timeout_s=10) == 0
    save_all_layers(connector, "s", keys, [0, 1], make_pool(2, seed=3))
    results = {r.kind: r for r in wait_results(connector, 2)}
    assert results["load"].num_blocks == 0 and results["save"].num_blocks == 0
    assert results["load"].error and results["save"].error
    connector.close()


def test_connector_over_the_store_server(tmp_path):
    config = StoreConfig(master_port=0, data_port=0, transport="zmq", dram_capacity_blocks=2,
                         disk_capacity_blocks=4, disk_dir=str(tmp_path))
    server = StoreServer(config).start()
    client = StoreClient(server.data_address, server.master_address, transport="zmq")
    try:
        connector = HandoffConnector(client, LAYOUT)
        pool = make_pool(6, seed=4)
        keys = request_keys(5)
        save_all_layers(connector, "p", keys, [0, 1, 2, 3, 4], pool)  # spills 3 to disk
        assert wait_results(connector, 1)[0].num_blocks == 5
        assert connector.lookup(keys) == 5
        assert client.stats()["num_blocks_disk"] == 3
        connector.prefetch(keys[:2])  # a queued request: bring its head up to DRAM
        assert connector.drain(10)
        assert client.stats()["num_hits_disk"] == 0  # moved by prefetch, not by a get
        assert [server.store.tier_of(k) for k in keys[:2]] == ["dram", "dram"]
        dst = make_pool(6)
        connector.start_load("d", keys, [5, 4, 3, 2, 1], dst)
        assert wait_results(connector, 1)[0].num_blocks == 5
        for layer in range(LAYOUT.num_layers):
            for src, dst_id in zip(range(5), [5, 4, 3, 2, 1], strict=True):
                assert torch.equal(dst[layer][:, dst_id], pool[layer][:, src])
        connector.close()
        client.check_integrity()
        assert client.stats()["num_pinned"] == 0
    finally:
        client.close()
        server.stop()


def test_saves_pin_their_blocks_under_a_lease_until_released(tmp_path):
    """A hand-off: the saved blocks stay pinned (DRAM holds only 2, so without the pin the
    next save would demote them) until the reader releases the lease."""
    config = StoreConfig(master_port=0, data_port=0, transport="zmq", dram_capacity_blocks=2,
                         disk_capacity_blocks=8, disk_dir=str(tmp_path))
    server = StoreServer(config).start()
    client = StoreClient(server.data_address, server.master_address, transport="zmq")
    try:
        connector = HandoffConnector(client, LAYOUT, lease_ttl_s=30.0)
        pool = make_pool(4, seed=5)
        keys = request_keys(2)
        save_all_layers(connector, "p", keys, [0, 1], pool)
        [saved] = wait_results(connector, 1)
        assert saved.num_blocks == 2 and saved.lease_id is not None
        assert client.stats()["num_leases"] == 1 and client.stats()["num_pinned"] == 2
        other = request_keys(2, salt="other")
        save_all_layers(connector, "q", other, [2, 3], pool)
        [second] = wait_results(connector, 1)
        assert [server.store.tier_of(k) for k in keys] == ["dram", "dram"]  # pinned stay
        for result in (saved, second):
            connector.release(result.lease_id)
        assert connector.drain(10)
        assert client.stats()["num_leases"] == 0 and client.stats()["num_pinned"] == 0
        connector.close()
        client.check_integrity()
    finally:
        client.close()
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_with_a_cuda_pool():
    connector = make_in_process_connector(LAYOUT, dram_capacity_blocks=8)
    prefill = [t.cuda() for t in make_pool(4, seed=5)]
    keys = request_keys(2)
    save_all_layers(connector, "p", keys, [3, 0], prefill)
    assert wait_results(connector, 1)[0].num_blocks == 2
    decode = [t.cuda() for t in make_pool(4)]
    connector.start_load("d", keys, [1, 2], decode)
    assert wait_results(connector, 1)[0].num_blocks == 2
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(decode[layer][:, 1], prefill[layer][:, 3])
        assert torch.equal(decode[layer][:, 2], prefill[layer][:, 0])
    connector.close()


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_direct_handoff_from_the_prefill_node_then_fallback_to_the_store(transport):
    """Prefill saves into its own hand-off node (pinned, one hop for decode) and writes a copy
    back to the fleet store when told (after the hand-off is out); decode reads from the node
    named by the result's `source` and releases the lease there. With the node gone, decode
    loads the write-back copy."""
    from pdserve.handoff.node_server import HandoffNode

    if transport == "ucx":
        pytest.importorskip("ucxx")
    fleet = StoreServer(StoreConfig(master_port=0, data_port=0, transport="zmq",
                                    dram_capacity_blocks=16)).start()
    fleet_client = StoreClient(fleet.data_address, fleet.master_address, transport="zmq")
    node = HandoffNode("prefill-0", "127.0.0.1", capacity_blocks=8, lease_ttl_s=30.0,
                       timeout_s=10.0, transport=transport)
    peers: list[StoreClient] = []

    def connect(address: str) -> StoreClient:
        peers.append(StoreClient(address, timeout_s=2.0, transport=transport))
        return peers[-1]

    prefill = HandoffConnector(fleet_client, LAYOUT, lease_ttl_s=30.0, handoff_node=node)
    decode = HandoffConnector(None, LAYOUT, connect=connect)
    try:
        pool = make_pool(6, seed=6)
        keys = request_keys(3)
        save_all_layers(prefill, "h", keys, [4, 0, 2], pool)
        [saved] = wait_results(prefill, 1)
        assert (saved.num_blocks, saved.source) == (3, node.address) and saved.lease_id
        assert node.num_leases == 1 and node.num_pinned_blocks == 3
        # the write-back waits for the caller (a worker: once the hand-off is sent)
        assert not any(fleet_client.exists(keys)) and saved.write_back is not None
        prefill.run_job(saved.write_back)
        assert wait_until_true(lambda: all(fleet_client.exists(keys)))
        dst = make_pool(6)
        decode.start_load("h", keys, [1, 3, 5], dst, source=saved.source)
        [loaded] = wait_results(decode, 1)
        assert (loaded.num_blocks, loaded.error) == (3, None)
        for layer in range(LAYOUT.num_layers):
            for src, dst_id in zip([4, 0, 2], [1, 3, 5], strict=True):
                assert torch.equal(dst[layer][:, dst_id], pool[layer][:, src])
        decode.release(saved.lease_id, saved.source)
        assert decode.drain(10)
        assert node.num_leases == 0 and node.num_pinned_blocks == 0
        node.check_integrity()

        node.close()  # the prefill worker is gone: decode falls back to the fleet store
        fallback = HandoffConnector(fleet_client, LAYOUT, timeout_s=2.0, connect=connect)
        again = make_pool(6)
        fallback.start_load("h2", keys, [0, 1, 2], again, source=saved.source)
        [loaded] = wait_results(fallback, 1)
        assert (loaded.num_blocks, loaded.error) == (3, None)
        assert torch.equal(again[0][:, 0], pool[0][:, 4])
        # the dead node is not asked again for a while: the next load from it and the
        # release of its lease cost no timeout (no new client is even made)
        num_clients = len(peers)
        fallback.start_load("h3", keys, [3, 4, 5], again, source=saved.source)
        fallback.release(saved.lease_id, saved.source)
        [loaded] = wait_results(fallback, 1)
        assert (loaded.num_blocks, loaded.error) == (3, None)
        assert fallback.drain(10) and len(peers) == num_clients
        fallback.close()
    finally:
        prefill.close()
        decode.close()
        node.close()
        fleet_client.close()
        fleet.stop()


def wait_until_true(predicate, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_wildcard_bind_is_advertised_by_this_hosts_address():
    from pdserve.addresses import advertised, routable_host

    assert advertised("tcp://10.1.2.3:7000") == "tcp://10.1.2.3:7000"
    assert advertised("tcp://0.0.0.0:7000") == f"tcp://{routable_host()}:7000"
