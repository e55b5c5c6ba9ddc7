"""Emulated hosts (pdserve/benchmarks/hosts.py): two hosts, a shaped link, bytes sent from one
to the other counted on both veths, each host in namespaces of its own, and nothing left
behind. Runs as root where `ip netns` works (a few seconds); skipped otherwise, with why."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.benchmarks.hosts import EmulatedHosts, NeedsRootError, why_unavailable

RATE_MBIT = 100
PAYLOAD_BYTES = 2_500_000  # 0.2 s at 100 Mbit/s: long enough to see the shaping
PORT = 9555

SERVER = f"""
import socket
with socket.create_server(("0.0.0.0", {PORT})) as server:
    conn, _ = server.accept()
    received = 0
    while chunk := conn.recv(1 << 20):
        received += len(chunk)
    print(received, flush=True)
"""

needs_root = pytest.mark.skipif(why_unavailable() is not None,
                                reason=why_unavailable() or "")


def _client(address: str) -> str:
    return f"""
import socket, time
with socket.create_connection(("{address}", {PORT}), timeout=10) as conn:
    time.sleep(0.05)
    start = time.monotonic()
    conn.sendall(b"k" * {PAYLOAD_BYTES})
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    print(time.monotonic() - start)
"""


def _netns_names() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.fixture
def hosts():
    emulated = EmulatedHosts(2, rate_mbit=RATE_MBIT)
    try:
        emulated.start()
    except RuntimeError as exc:
        if "not permitted" in str(exc).lower():
            pytest.skip(f"network namespaces are not permitted here: {exc}")
        raise
    yield emulated
    emulated.close()


@needs_root
def test_bytes_cross_a_shaped_link_and_teardown_leaves_nothing(hosts, tmp_path):
    ours = {h.netns for h in hosts.hosts}
    assert ours <= _netns_names()
    # each host its own name, IPC namespace and /dev/shm
    names = [hosts.run(i, ["hostname"]).stdout.strip() for i in (0, 1)]
    assert names == ["h1", "h2"]
    for kind in ("net", "uts", "ipc", "mnt", "pid"):
        seen = {hosts.run(i, ["readlink", f"/proc/self/ns/{kind}"]).stdout.strip()
                for i in (0, 1)}
        assert len(seen) == 2 and os.readlink(f"/proc/self/ns/{kind}") not in seen, kind
    assert hosts.run(0, ["sh", "-c", "touch /dev/shm/pdserve-test-h1"]).returncode == 0
    assert hosts.run(1, ["ls", "/dev/shm"]).stdout.split() == []

    log = tmp_path / "server.log"
    server = hosts.spawn(1, [sys.executable, "-c", SERVER], cores=[0], log=log)
    deadline = time.monotonic() + 10
    while hosts.run(1, ["sh", "-c", f"cat /proc/net/tcp | grep -qi ':{PORT:04X} '"]
                    ).returncode != 0:
        assert time.monotonic() < deadline, "the server on h2 did not listen"
        time.sleep(0.05)
    before = [hosts.link_bytes(i) for i in (0, 1)]
    sent = hosts.run(0, [sys.executable, "-c", _client(hosts.address(1))])
    assert sent.returncode == 0, sent.stderr
    server.wait(10)
    moved = [hosts.link_bytes(i) - before[i] for i in (0, 1)]
    assert int(log.read_text().split()[0]) == PAYLOAD_BYTES
    # every byte crossed both veths (headers on top), none went another way
    assert moved[0].sent >= PAYLOAD_BYTES and moved[1].received >= PAYLOAD_BYTES
    assert moved[0].sent < 1.1 * PAYLOAD_BYTES
    # and at the link's rate, not loopback speed (a shaped link takes >= 80% of the ideal)
    ideal_s = PAYLOAD_BYTES * 8 / (RATE_MBIT * 1e6)
    assert float(sent.stdout.split()[-1]) >= 0.8 * ideal_s

    # a link down is a cut cable: h2 loses its carrier, and gets it back
    carrier = ["cat", "/sys/class/net/eth0/carrier"]
    hosts.link_down(1)
    assert hosts.run(1, carrier).stdout.strip() != "1"
    hosts.link_up(1)
    assert hosts.run(1, carrier).stdout.strip() == "1"

    hosts.close()
    assert not ours & _netns_names()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert hosts.bridge not in links and not any(h.outer_device in links for h in hosts.hosts)


def test_needs_root_says_so(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(NeedsRootError, match="need root"):
        EmulatedHosts(2).start()
