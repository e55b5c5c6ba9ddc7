"""A decode worker that stops answering before its first token: the router moves the request
to another decode worker and the client never sees the failure."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from cluster_util import Roles


@pytest.fixture(scope="module")
def roles(llama_dir, tmp_path_factory):
    roles = Roles(llama_dir, tmp_path_factory.mktemp("failover-logs"), num_decode=2,
                  router_args=("--heartbeat-timeout-s", "3"))
    roles.start_all()
    try:
        roles.wait_ready()
        deadline = time.monotonic() + 120  # /health needs one decode worker; wait for both
        while time.monotonic() < deadline:
            workers = httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]
            if sum(w["is_ready"] for w in workers if w["role"] == "decode") == 2:
                break
            time.sleep(0.5)
        yield roles
    finally:
        roles.stop()


def test_request_moves_off_a_hung_decode_worker(roles):
    url = f"{roles.base_url}/v1/completions"
    body = {"prompt": "def main():", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reference = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    # Hang the decode worker the router will pick (router/policies.py MostFreeKVDecode: most
    # free blocks, then fewest in flight, then the higher address), judged once the statuses
    # stopped changing: the reference request's cached blocks may have left the two unequal.
    previous, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        decode = sorted((w["num_free_blocks"], -w["num_inflight"], w["address"])
                         for w in httpx.get(f"{roles.base_url}/status", timeout=5)
                         .json()["workers"] if w["role"] == "decode")
        if decode == previous:
            break
        previous = decode
        time.sleep(1.0)
    address = decode[-1][2]
    index = [f"tcp://127.0.0.1:{port}" for port in roles.decode_ports].index(address)
    hung = "decode-1" if index else "decode"
    os.kill(roles.processes[hung].pid, signal.SIGSTOP)
    try:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
        workers = httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]
        assert [w["is_alive"] for w in workers if w["address"] == address] == [False]
        router_log = "".join(p.read_text() for p in roles.log_dir.glob("router-*.log"))
        assert f"decode worker {address} died before its first token" in router_log
    finally:
        os.kill(roles.processes[hung].pid, signal.SIGCONT)
    # The hung worker was only stopped: resumed, it must come back alive and idle like the
    # other, and whatever lease it held be released or expire (--kv-lease-ttl-s 5).
    roles.assert_nothing_leaked()
