"""A data node whose heartbeat or update was in flight when its master died joins the
restarted master after a few heartbeat intervals, not after the store's request timeout
(pdserve/kvstore/master_reporter.py): a master restarted under load is ready once its nodes are
back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers.cluster_util import free_port_block, wait_until

from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.server import StoreServer

REQUEST_TIMEOUT_S = 600.0  # far past the test's waits: only the heartbeat's own bound helps


def start_master(port: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.app.cli", "store", "--role", "master",
         "--master-port", str(port), "--transport", "zmq"],
        stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, PDSERVE_INSECURE_PLAINTEXT="1"))


def num_nodes(address: str) -> int:
    client = StoreClient(None, address, transport="zmq", timeout_s=1.0)
    try:
        return client.stats().get("num_nodes", 0)
    except Exception:  # down, or still starting
        return 0
    finally:
        client.close()


def test_a_node_rejoins_a_restarted_master_though_a_heartbeat_was_unanswered(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_INSECURE_PLAINTEXT", "1")
    port = free_port_block(1)
    address = f"tcp://127.0.0.1:{port}"
    log = open(tmp_path / "master.log", "ab")
    master = start_master(port, log)
    node = StoreServer(StoreConfig(role="data", data_port=0, master_address=address,
                                   node_id="n0", transport="zmq", heartbeat_interval_s=0.2,
                                   request_timeout_s=REQUEST_TIMEOUT_S)).start()
    try:
        assert wait_until(lambda: num_nodes(address) == 1, 60), "the node did not join"
        master.send_signal(signal.SIGSTOP)  # alive but silent: the next heartbeat hangs
        time.sleep(1.0)
        master.kill()
        master.wait(10)
        master = start_master(port, log)
        assert wait_until(lambda: num_nodes(address) == 1, 60), \
            "the node did not join the restarted master"
    finally:
        node.stop()
        master.kill()
        master.wait(10)
        log.close()
