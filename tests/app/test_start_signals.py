"""A role asked to stop while it starts stops cleanly: its SIGTERM/SIGINT handlers are in
before it binds or serves anything, so a supervisor's SIGTERM in that window (stopping a
standby, a rolling restart) never kills it with the default action (exit -15). The signal is
sent from inside the role's start (a `python -c` child that patches it, then runs the CLI),
at the worst moment: before the engine, the worker's socket or the router's listener exist.
(The store's own: tests/kvstore/test_store_signals.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers.cluster_util import free_port_block

# {target}: "module:function" or "module:Class.method" that sends the SIGTERM, then runs as
# it would
CHILD = """
import importlib, os, signal, sys
module, attribute = {target!r}.split(":")
owner = importlib.import_module(module)
*path, method = attribute.split(".")
for name in path:
    owner = getattr(owner, name)
real = getattr(owner, method)
def patched(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
setattr(owner, method, patched)
from pdserve.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(target: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(target=target), *argv],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("target", [
    "pdserve.serve.engine.engine:Engine.__init__",  # before the engine's model is loaded
    "pdserve.serve.worker.server:Worker.__init__",  # before the worker's socket binds
])
def test_a_sigterm_while_the_worker_starts_stops_it_cleanly(llama_dir, target):
    port = free_port_block(1)
    done = _run(target, ["colocated", "--model", str(llama_dir), "--port", str(port),
                         "--device", "cpu", "--num-kv-blocks", "64", "--insecure-plaintext"])
    assert done.returncode == 0, (done.returncode, -signal.SIGTERM, done.stderr[-2000:])
    assert "signal 15, shutting down" in done.stderr


@pytest.mark.parametrize("target", [
    "pdserve.router.app:build_app",  # before the router binds
    "uvicorn.server:Server.startup",  # as uvicorn binds: its handler, then ours again
])
def test_a_sigterm_while_the_router_starts_stops_it_cleanly(llama_dir, target):
    port = free_port_block(1)
    done = _run(target, ["router", "--model", str(llama_dir), "--port", str(port),
                         "--prefill", "tcp://127.0.0.1:1", "--decode", "tcp://127.0.0.1:2",
                         "--insecure-plaintext"])
    assert done.returncode == 0, (done.returncode, -signal.SIGTERM, done.stderr[-2000:])
    assert "signal 15, shutting down" in done.stderr
