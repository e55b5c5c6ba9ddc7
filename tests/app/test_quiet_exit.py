"""A worker stopped by Ctrl-C (as `pdserve up` stops its children) leaves quietly: exit code
0, and none of the "leaked instance" lines Triton's nanobind extension prints at interpreter
teardown (pdserve/app/cli.py, QUIET_EXIT_ROLES)."""

from __future__ import annotations

import signal
import subprocess
import sys

from helpers.cluster_util import free_port_block, wait_until


def test_a_worker_stopped_by_sigint_exits_0_without_teardown_noise(llama_dir, tmp_path) -> None:
    port = free_port_block(1)
    log = tmp_path / "worker.err"
    with log.open("w") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pdserve.app.cli", "colocated", "--model", str(llama_dir),
             "--port", str(port), "--device", "cpu", "--num-kv-blocks", "64",
             "--insecure-plaintext"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        assert wait_until(lambda: "ready on" in log.read_text() or worker.poll() is not None,
                          timeout_s=240), log.read_text()
        assert worker.poll() is None, log.read_text()
        worker.send_signal(signal.SIGINT)
        assert worker.wait(60) == 0, log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    text = log.read_text()
    assert "leaked" not in text and "nanobind" not in text, text
