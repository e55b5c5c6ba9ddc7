"""A store asked to stop while it starts stops cleanly (pdserve/kvstore/server.py run()): its
signal handlers are in before it binds anything, so a supervisor's SIGTERM in that window
(stopping a standby, a rolling restart) never kills it with the default action."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers.cluster_util import free_port_block

# SIGTERM arrives at the worst moment: inside StoreServer.start, before it binds.
CHILD = """
import os, signal, sys
from pdserve.kvstore import server
real_start = server.StoreServer.start
def start(self):
    os.kill(os.getpid(), signal.SIGTERM)
    return real_start(self)
server.StoreServer.start = start
from pdserve.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("role", ["all", "master"])
def test_a_sigterm_while_the_store_starts_stops_it_cleanly(role):
    port = free_port_block(2)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "store", "--role", role, "--master-port", str(port),
         "--data-port", str(port + 1), "--insecure-plaintext", "--transport", "zmq"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, -signal.SIGTERM, done.stderr[-2000:])
    assert "shutting down" in done.stderr
    assert "stopped" in done.stderr
