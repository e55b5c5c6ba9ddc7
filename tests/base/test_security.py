"""CurveZMQ on the internal ports (pdserve/security.py): a peer with the cluster key is
served; a plaintext peer or one with another key is dropped in the handshake, so not one of
its frames reaches pdserve's decoder and nothing is answered; the key file and the CLI."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import zmq

from pdserve import security
from pdserve.kvstore.channel import StoreUnavailable
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.server import StoreServer
from pdserve.protocol.store.base import STORE_PROTOCOL, StatsRequest, decode_store_message


def block(i: int) -> np.ndarray:
    return np.full(64, i, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


@pytest.fixture
def cluster_key() -> security.ClusterKey:
    return security.ClusterKey.generate()


@pytest.fixture
def secured_store(cluster_key, tmp_path):
    with security.using(cluster_key):
        server = StoreServer(StoreConfig(master_port=0, data_port=0, transport="zmq",
                                         dram_capacity_blocks=8, disk_capacity_blocks=0,
                                         disk_dir=str(tmp_path))).start()
    yield server
    server.stop()


def raw_reply(address: str, frames: list[bytes], key: security.ClusterKey | None,
              foreign: bool = False, wait_ms: int = 1500) -> bytes | None:
    """Send frames from a fresh DEALER (with the cluster key, another key, or plaintext);
    the reply's first frame, or None when nothing came back within wait_ms."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if foreign:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = key.public
    elif key is not None:
        with security.using(key):
            security.secure_client(sock)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        return sock.recv_multipart()[0] if sock.poll(wait_ms) else None
    finally:
        sock.close()
        ctx.term()


def test_key_file_round_trip_is_owner_only(tmp_path, cluster_key) -> None:
    path = cluster_key.save(tmp_path / "cluster.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert security.ClusterKey.load(path) == cluster_key


@pytest.mark.parametrize("content", [b"", b"one-line\n", b"a" * 40 + b"\n" + b"b" * 40 + b"\n"])
def test_malformed_key_files_are_refused(tmp_path, content: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(security.ClusterKeyError):
        security.ClusterKey.load(path)


def test_a_keyed_client_is_served(secured_store, cluster_key) -> None:
    with security.using(cluster_key):
        client = StoreClient(secured_store.data_address, secured_store.master_address,
                             transport="zmq", timeout_s=5)
    try:
        assert client.put_many([key(1)], [block(1)]) == [True]
        assert np.array_equal(client.get_many([key(1)])[0], block(1))
        assert client.lookup_prefix([key(1)]).num_blocks == 1
    finally:
        client.close()


@pytest.mark.parametrize("peer", ["plaintext", "foreign key"])
def test_unauthenticated_peers_get_nothing_and_reach_no_decoder(secured_store, cluster_key,
                                                                peer: str) -> None:
    rng = random.Random(0)
    payloads = [STORE_PROTOCOL.encode(StatsRequest(request_id=1)), b"\xc1garbage",
                msgpack.packb({"type": "evict", "request_id": 2, "keys": [key(1)]}),
                rng.randbytes(512)]
    for address in (secured_store.data_address, secured_store.master_address):
        for payload in payloads:
            if peer == "plaintext":
                assert raw_reply(address, [payload], None, wait_ms=500) is None
            else:
                assert raw_reply(address, [payload], cluster_key, foreign=True,
                                 wait_ms=500) is None
    assert secured_store.num_rejected == 0  # not one frame was decoded
    # and the store still serves its own
    reply = raw_reply(secured_store.data_address,
                      [STORE_PROTOCOL.encode(StatsRequest(request_id=3))], cluster_key)
    assert reply is not None and decode_store_message(reply).request_id == 3


def test_a_plaintext_store_client_times_out_against_a_secured_store(secured_store) -> None:
    client = StoreClient(secured_store.data_address, transport="zmq", timeout_s=0.5)
    try:
        with pytest.raises(StoreUnavailable):
            client.put_many([key(2)], [block(2)])
    finally:
        client.close()


def test_fuzzed_frames_from_a_keyed_peer_are_refused_and_the_store_lives(secured_store,
                                                                         cluster_key) -> None:
    """Random and mutated frames from a peer that holds the key: each is answered with an
    error (or dropped), nothing crashes, and the store keeps serving."""
    rng = random.Random(1)
    valid = [STORE_PROTOCOL.encode(StatsRequest(request_id=9)),
             msgpack.packb({"type": "get", "request_id": 4, "keys": [key(1)], "ucx_tag": None}),
             msgpack.packb({"type": "lookup_prefix", "request_id": 5, "keys": [key(1)]})]
    for address in (secured_store.data_address, secured_store.master_address):
        for i in range(40):
            if i % 2:
                payload = bytearray(rng.choice(valid))
                for _ in range(rng.randint(1, 4)):
                    payload[rng.randrange(len(payload))] = rng.randrange(256)
                frames = [bytes(payload)]
            else:
                frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
            raw_reply(address, frames, cluster_key, wait_ms=200)
        reply = raw_reply(address, [STORE_PROTOCOL.encode(StatsRequest(request_id=10))],
                          cluster_key)
        assert reply is not None and decode_store_message(reply).request_id == 10
    secured_store.check_integrity()


def test_a_role_without_a_key_refuses_to_start(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in (security.KEY_FILE_ENV, security.PLAINTEXT_ENV)}
    done = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "store", "--master-port", "0",
                           "--data-port", "0"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 2
    assert "no cluster key" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "keygen",
                           str(tmp_path / "k")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and security.ClusterKey.load(tmp_path / "k")
    again = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "keygen",
                            str(tmp_path / "k")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stdout
