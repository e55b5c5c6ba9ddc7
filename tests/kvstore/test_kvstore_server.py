"""The store server over real sockets on 127.0.0.1: clients, concurrency, hostile input, and
the UCX address prober the server checks peers' addresses with."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from helpers.cluster_util import free_port_block

from pdserve import security
from pdserve.kvstore import data_service as data_service_module
from pdserve.kvstore import ucx_prober
from pdserve.kvstore.channel import ControlChannel, StoreRequestError, StoreUnavailable
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.server import StoreServer
from pdserve.kvstore.ucx_prober import UcxAddressProber
from pdserve.kvstore.ucx_transport import UcxDataPlane, UcxUnavailable
from pdserve.protocol.store.base import (
    STORE_PROTOCOL,
    ErrorReply,
    StatsReply,
    StatsRequest,
    decode_store_message,
)
from pdserve.protocol.store.data import ExistsReply, ExistsRequest, HelloRequest
from pdserve.protocol.store.master import JoinReply, JoinRequest


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, num_bytes: int = 256) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, num_bytes, dtype=np.uint8)


@pytest.fixture
def make_server():
    servers: list[StoreServer] = []

    def make(**overrides) -> StoreServer:
        config = StoreConfig(**{"master_port": 0, "data_port": 0, "transport": "zmq",
                                "request_timeout_s": 5.0, **overrides})
        servers.append(StoreServer(config).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def finish(server: StoreServer, *clients: StoreClient) -> None:
    """Every test ends here: invariants hold, nothing pinned, no lease left."""
    clients[0].check_integrity()
    stats = clients[0].stats()
    assert stats["num_pinned"] == 0 and stats["num_leases"] == 0
    for c in clients:
        c.close()
    server.check_integrity()


def test_put_get_pin_evict_over_zmq(make_server):
    server = make_server(dram_capacity_blocks=4)
    client = StoreClient(server.data_address, server.master_address, transport="zmq")
    keys = [key(i) for i in range(6)]
    assert client.put_many(keys, [block(i) for i in range(6)]) == [True] * 6
    got = client.get_many(keys)
    assert [g is None for g in got] == [True, True, False, False, False, False]
    assert all(np.array_equal(got[i], block(i)) for i in range(2, 6))
    assert client.lookup_prefix(keys[2:] + keys[:2]).num_blocks == 4
    lease_id, pinned = client.pin(keys[2:4], ttl_s=30)
    assert pinned == [True, True]
    assert client.evict(keys[2:]) == 2  # pinned 2 and 3 stay
    assert client.exists(keys[2:]) == [True, True, False, False]
    assert client.renew(lease_id, ttl_s=60)
    assert client.release(lease_id) and not client.release(lease_id)
    assert not client.renew(lease_id, ttl_s=60)
    assert client.nodes() == {"store-0": server.data_address}
    finish(server, client)


def test_lease_expires_on_the_server(make_server):
    server = make_server(dram_capacity_blocks=2)
    client = StoreClient(server.data_address, transport="zmq")
    client.put_many([key(0), key(1)], [block(0), block(1)])
    client.pin([key(0)], ttl_s=0.2)  # the client "crashes": never releases
    deadline = time.monotonic() + 5
    while client.stats()["num_pinned"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats()["num_leases"] == 0
    client.put_many([key(2), key(3)], [block(2), block(3)])  # 0 is evictable again
    assert client.exists([key(0)]) == [False]
    finish(server, client)


def test_disk_tier_behind_the_server_survives_restart(make_server, tmp_path):
    kwargs = dict(dram_capacity_blocks=1, disk_capacity_blocks=8, disk_dir=str(tmp_path))
    server = make_server(**kwargs)
    client = StoreClient(server.data_address, transport="zmq")
    client.put_many([key(i) for i in range(4)], [block(i) for i in range(4)])
    client.close()
    server.stop()
    server = make_server(**kwargs)
    client = StoreClient(server.data_address, server.master_address, transport="zmq")
    assert client.lookup_prefix([key(i) for i in range(4)]).num_blocks == 3  # dram was lost
    got = client.get_many([key(0), key(2)])
    assert np.array_equal(got[0], block(0)) and np.array_equal(got[1], block(2))
    finish(server, client)


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_two_clients_concurrently_lose_nothing(make_server, transport):
    if transport == "ucx":
        pytest.importorskip("ucxx")
    server = make_server(dram_capacity_blocks=4096, transport=transport)
    clients = [StoreClient(server.data_address, transport=transport, max_keys_per_request=64)
               for _ in range(2)]  # batches of 100 go out as 64 + 36
    assert all(c.transport == transport for c in clients)
    errors: list[BaseException] = []

    def work(c: int) -> None:
        try:
            ids = range(c * 1000, (c + 1) * 1000)
            for start in range(0, 1000, 100):
                batch = list(ids)[start:start + 100]
                assert clients[c].put_many([key(i) for i in batch],
                                           [block(i, 64) for i in batch]) == [True] * 100
                got = clients[c].get_many([key(i) for i in batch])
                assert all(np.array_equal(g, block(i, 64)) for g, i in zip(got, batch, strict=True))
        except BaseException as e:  # noqa: BLE001 - surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c,)) for c in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    all_keys = [key(i) for i in range(2000)]
    assert clients[0].exists(all_keys) == [True] * 2000
    assert clients[1].stats()["num_blocks_dram"] == 2000
    finish(server, *clients)


class _Exploit:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling this would create the file


def test_garbage_and_pickle_are_rejected_and_server_keeps_serving(make_server, tmp_path,
                                                                  caplog):
    server = make_server(dram_capacity_blocks=8)
    client = StoreClient(server.data_address, server.master_address, transport="zmq")
    client.put_many([key(0)], [block(0)])
    marker = tmp_path / "pwned"
    hostile = [
        b"",
        os.urandom(64),
        pickle.dumps(_Exploit(str(marker))),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"type": "get", "request_id": 7}),  # missing fields
        msgpack.packb({"type": "get", "request_id": 7, "keys": [b"k"], "ucx_tag": None,
                       "extra": 1}),
        msgpack.packb({"type": "get", "request_id": 7, "keys": ["not-bytes"], "ucx_tag": None}),
        msgpack.packb({"type": "put", "request_id": 7, "keys": [key(1)], "sizes": [5],
                       "ucx_tag": None}),  # no payload frame
        msgpack.packb({"type": "__import__", "request_id": 1}),
        msgpack.packb({"type": "pin", "request_id": 1, "keys": [key(0)] * 5000,
                       "holder": "x", "ttl_s": 1.0}),  # more than max_keys_per_message
        STORE_PROTOCOL.encode(StatsReply(7, {"n": 1})),  # a reply is not a request
    ]
    ctx = zmq.Context()
    for address in (server.data_address, server.master_address):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        for payload in hostile:
            sock.send_multipart([payload])
            assert sock.poll(5000), "the server stopped answering"
            reply = decode_store_message(sock.recv_multipart()[0])
            assert isinstance(reply, ErrorReply) and reply.error
        sock.close()
    ctx.term()
    assert not marker.exists()
    # all but the put without its payload (a valid message whose handler fails), per socket
    assert server.num_rejected == 2 * (len(hostile) - 1)
    got = client.get_many([key(0)])  # still serving
    assert np.array_equal(got[0], block(0))
    with pytest.raises(StoreRequestError, match="not served by the data service"):
        client._data_channel().request(JoinRequest, JoinReply, node_id="x", address="y")
    with pytest.raises(StoreRequestError, match="not served by the master service"):
        client._master.request(ExistsRequest, ExistsReply, keys=[key(0)])
    finish(server, client)


def test_channel_checks_the_reply_type():
    """A reply of the wrong type raises; a malformed one is dropped (then the request times
    out); a late reply to an earlier request is skipped."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    answers = [
        [STORE_PROTOCOL.encode(StatsReply(999, {"late": 1})),  # skipped: not our request
         STORE_PROTOCOL.encode(StatsReply(1, {"num_leases": 0}))],
        [STORE_PROTOCOL.encode(ExistsReply(2, [True]))],  # wrong type
        [b"\xc1not msgpack"],  # dropped
    ]

    def serve() -> None:
        for replies in answers:
            identity, _ = router.recv_multipart()
            for reply in replies:
                router.send_multipart([identity, reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = ControlChannel(ctx, f"tcp://127.0.0.1:{port}", timeout_s=1.0)
    assert channel.request(StatsRequest, StatsReply).stats == {"num_leases": 0}
    with pytest.raises(StoreRequestError, match="expected a StatsReply, got a ExistsReply"):
        channel.request(StatsRequest, StatsReply)
    with pytest.raises(StoreUnavailable):
        channel.request(StatsRequest, StatsReply)
    with pytest.raises(ValueError):  # built locally, never sent
        channel.request(ExistsRequest, ExistsReply, keys=[b"x" * 65])
    thread.join(timeout=5)
    channel.close()
    router.close()
    ctx.term()


def test_data_node_reports_to_a_separate_master(make_server):
    master = make_server(role="master", node_ttl_s=1.0, heartbeat_interval_s=0.1)
    data = make_server(role="data", master_address=master.master_address, node_id="d1",
                       node_ttl_s=1.0, heartbeat_interval_s=0.1)
    client = StoreClient(data.data_address, master.master_address, transport="zmq")
    client.put_many([key(0), key(1)], [block(0), block(1)])
    deadline = time.monotonic() + 5
    while client.lookup_prefix([key(0), key(1)]).num_blocks < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    found = client.lookup_prefix([key(0), key(1), key(2)])
    assert found.num_blocks == 2 and found.holders[0] == [("d1", "dram")]
    assert client.nodes() == {"d1": data.data_address}
    client.close()
    data.stop()  # leaves the master
    deadline = time.monotonic() + 5
    while master.master.nodes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert master.master.nodes() == {} and master.master.num_blocks == 0
    master.check_integrity()


def test_ucx_data_path(make_server):
    pytest.importorskip("ucxx")
    server = make_server(transport="ucx", dram_capacity_blocks=16)
    client = StoreClient(server.data_address, transport="ucx")
    assert client.transport == "ucx"
    prober_pid = server.data_service._prober.child_pid  # it checked the client's address
    assert prober_pid is not None
    blocks = [block(i, 70_000) for i in range(5)]  # above UCX's eager threshold too
    assert client.put_many([key(i) for i in range(5)], blocks) == [True] * 5
    got = client.get_many([key(i) for i in [0, 9, 4]])
    assert np.array_equal(got[0], blocks[0]) and got[1] is None
    assert np.array_equal(got[2], blocks[4])
    # UCX aborts a process on a malformed worker address: the server must refuse it unharmed
    hostile = STORE_PROTOCOL.encode(HelloRequest(3, ucx_address=os.urandom(217)))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.data_address)
    sock.send_multipart([hostile])
    assert sock.poll(30_000)
    reply = decode_store_message(sock.recv_multipart()[0])
    assert isinstance(reply, ErrorReply) and reply.request_id == 3 and "UCX" in reply.error
    sock.close()
    ctx.term()
    assert np.array_equal(client.get_many([key(1)])[0], blocks[1])
    assert not _is_running(prober_pid)  # that address ended the prober's child
    second = StoreClient(server.data_address, transport="ucx")
    assert second.transport == "ucx"  # in a new child
    prober_pid = server.data_service._prober.child_pid
    assert prober_pid is not None
    assert np.array_equal(second.get_many([key(4)])[0], blocks[4])
    finish(server, client, second)
    server.stop()
    assert not _is_running(prober_pid)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_slow_disk_get_does_not_hold_up_other_clients(make_server, tmp_path, monkeypatch):
    """A get parked inside a disk read: lookups (master socket), cheap data verbs and a DRAM
    get from another client are all answered while it is still in flight."""
    server = make_server(dram_capacity_blocks=1, disk_capacity_blocks=8, disk_dir=str(tmp_path))
    slow = StoreClient(server.data_address, transport="zmq")
    fast = StoreClient(server.data_address, server.master_address, transport="zmq",
                       timeout_s=5)
    keys = [key(i) for i in range(3)]
    assert slow.put_many(keys, [block(i) for i in range(3)]) == [True] * 3
    assert server.store.flush()  # 0 and 1 are in their files now, 2 in DRAM
    disk = server.store.tiers[-1]
    read_file = disk._read_file
    in_read, may_finish = threading.Event(), threading.Event()

    def parked_read(k: bytes):
        in_read.set()
        assert may_finish.wait(30)
        return read_file(k)

    monkeypatch.setattr(disk, "_read_file", parked_read)
    got: list[np.ndarray | None] = []
    getter = threading.Thread(target=lambda: got.extend(slow.get_many([key(0)])))
    getter.start()
    try:
        assert in_read.wait(10)
        assert fast.lookup_prefix(keys).num_blocks == 3
        assert fast.exists(keys) == [True] * 3
        lease_id, pinned = fast.pin([key(1)], ttl_s=30)
        assert pinned == [True] and fast.release(lease_id)
        assert np.array_equal(fast.get_many([key(2)])[0], block(2))
        assert getter.is_alive() and not got  # all of that while the get was in flight
    finally:
        may_finish.set()
        getter.join(timeout=30)
    assert len(got) == 1 and np.array_equal(got[0], block(0))
    assert server.store.tier_of(key(0)) == "dram"  # the hit was promoted as usual
    finish(server, slow, fast)


# Stands in for the prober's child: answers like it, and dies as UCX makes it die.
_FAKE_PROBER_CHILD = """
import sys
print("ready", flush=True)
for line in sys.stdin:
    address = bytes.fromhex(line.strip())
    if address.startswith(b"good"):
        print("ok", flush=True)
    elif address.startswith(b"fail"):
        print("fail", flush=True)
    elif address.startswith(b"hang"):
        sys.stdin.readline()
    else:
        sys.exit(134)  # what UCX's abort looks like from outside
"""


def test_prober_reuses_one_child_and_replaces_it_after_a_bad_address(monkeypatch):
    monkeypatch.setattr(ucx_prober, "_CHILD", _FAKE_PROBER_CHILD)
    prober = UcxAddressProber("tcp", timeout_s=10)
    assert prober.is_connectable(b"good-1") and prober.is_connectable(b"good-2")
    first_pid = prober.child_pid
    assert prober.is_connectable(b"good-1")  # cached
    assert (prober.num_probes, prober.num_child_starts) == (2, 1)
    assert not prober.is_connectable(b"abort")  # the child dies on it
    assert prober.child_pid is None and not _is_running(first_pid)
    assert prober.is_connectable(b"good-3")  # in a new child
    assert not prober.is_connectable(b"fail")  # answered, but the child is replaced too
    assert prober.is_connectable(b"good-4")
    assert not prober.is_connectable(b"abort")  # cached: no child dies for it again
    assert (prober.num_probes, prober.num_child_starts) == (6, 3)
    last_pid = prober.child_pid
    prober.close()
    assert prober.child_pid is None and not _is_running(last_pid)
    with pytest.raises(RuntimeError, match="closed"):
        prober.is_connectable(b"good-5")


def test_prober_kills_a_child_that_does_not_answer(monkeypatch):
    monkeypatch.setattr(ucx_prober, "_CHILD", _FAKE_PROBER_CHILD)
    prober = UcxAddressProber("tcp", timeout_s=2)
    assert prober.is_connectable(b"good-1")
    hung_pid = prober.child_pid
    assert not prober.is_connectable(b"hang")
    assert prober.child_pid is None and not _is_running(hung_pid)
    assert prober.is_connectable(b"good-2")
    prober.close()


def test_prober_with_real_ucx_addresses():
    pytest.importorskip("ucxx")
    plane, other = UcxDataPlane(), UcxDataPlane()  # live workers: their addresses connect
    prober = UcxAddressProber(plane.tls, timeout_s=30)
    try:
        assert prober.is_connectable(plane.address)
        assert not prober.is_connectable(b"x")  # UCX aborts the child on this one
        assert not prober.is_connectable(plane.address[:8] + bytes(209))
        assert prober.is_connectable(other.address)  # the prober lives on
        pid = prober.child_pid
        assert pid is not None
    finally:
        prober.close()
    assert not _is_running(pid)
    plane.close()
    other.close()


def test_ucx_unavailable_falls_back_to_zmq_loudly(make_server, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise UcxUnavailable("no transports")

    monkeypatch.setattr(data_service_module, "UcxDataPlane", broken)
    with caplog.at_level(logging.WARNING):
        server = make_server(transport="ucx")
    assert any("fall back to ZeroMQ" in r.getMessage() for r in caplog.records)
    client = StoreClient(server.data_address, transport="ucx")
    assert client.transport == "zmq"  # the server said it has no UCX
    assert client.put_many([key(0)], [block(0)]) == [True]
    assert np.array_equal(client.get_many([key(0)])[0], block(0))
    finish(server, client)


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    master_port = free_port_block(2)
    data_port = master_port + 1
    cluster_key = security.ClusterKey.generate()
    key_path = cluster_key.save(tmp_path / "cluster.key")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.app.cli", "store", "--transport", "zmq",
         "--master-port", str(master_port), "--data-port", str(data_port),
         "--dram-blocks", "8", "--disk-blocks", "8", "--disk-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, PDSERVE_CLUSTER_KEY_FILE=str(key_path)))
    try:
        with security.using(cluster_key):
            client = StoreClient(f"tcp://127.0.0.1:{data_port}",
                                 f"tcp://127.0.0.1:{master_port}", transport="zmq",
                                 timeout_s=30)
        assert client.put_many([key(0)], [block(0)]) == [True]
        assert client.lookup_prefix([key(0)]).num_blocks == 1
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / (key(0).hex() + ".kv")).exists() is False  # still in DRAM, not spilled


def _start_store_cli(tmp_path, disk_dir, key_path, master_port: int, data_port: int):
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.app.cli", "store", "--transport", "zmq",
         "--master-port", str(master_port), "--data-port", str(data_port),
         "--dram-blocks", "4", "--disk-blocks", "1000", "--disk-dir", str(disk_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, PDSERVE_CLUSTER_KEY_FILE=str(key_path)))


def test_store_killed_mid_write_restarts_with_whole_blocks_only(tmp_path):
    """SIGKILL a store while its disk tier still writes behind; damage one finished file and
    leave a half-written one: the restarted store serves every block it kept exactly as put,
    and everything else (DRAM, unfinished, torn) is a miss, never wrong bytes."""
    cluster_key = security.ClusterKey.generate()
    key_path = cluster_key.save(tmp_path / "cluster.key")
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    keys, blocks = [key(i) for i in range(400)], [block(i, 16384) for i in range(400)]
    ports = (base := free_port_block(2), base + 1)
    proc = _start_store_cli(tmp_path, disk_dir, key_path, *ports)
    try:
        with security.using(cluster_key):
            client = StoreClient(f"tcp://127.0.0.1:{ports[1]}", transport="zmq", timeout_s=30)
        for i in range(0, len(keys), 40):  # each put demotes older blocks to the disk tier
            assert client.put_many(keys[i:i + 40], blocks[i:i + 40]) == [True] * 40
        client.close()
        proc.kill()  # mid write-behind: the last blocks' files are queued or half-written
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    written = sorted(disk_dir.glob("*.kv"))
    assert written, "nothing reached the disk before the kill"
    torn = written[0]
    torn.write_bytes(torn.read_bytes()[:-100])  # a block cut short
    (disk_dir / (key(999).hex() + ".kv.tmp")).write_bytes(b"PDKV half")
    ports = (base := free_port_block(2), base + 1)
    proc = _start_store_cli(tmp_path, disk_dir, key_path, *ports)
    try:
        with security.using(cluster_key):
            client = StoreClient(f"tcp://127.0.0.1:{ports[1]}", transport="zmq", timeout_s=30)
        got = client.get_many(keys)
        kept = [i for i, g in enumerate(got) if g is not None]
        assert all(np.array_equal(got[i], blocks[i]) for i in kept)
        assert len(kept) >= len(written) - 1
        assert keys.index(bytes.fromhex(torn.name.removesuffix(".kv"))) not in kept
        # the restart swept the unfinished write (later .tmp files are its own write-behind)
        assert not (disk_dir / (key(999).hex() + ".kv.tmp")).exists()
        client.check_integrity()
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
