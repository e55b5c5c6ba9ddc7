"""A real etcd for the fleet tests: one single-member cluster on free loopback ports, in a
temporary data directory, stopped (and its directory removed) after."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.cluster_util import free_port_block

ETCD = shutil.which("etcd")
START_TIMEOUT_S = 30.0


@dataclass
class Etcd:
    process: subprocess.Popen
    client_port: int
    data_dir: Path
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def url(self, cluster: str = "default") -> str:
        """The --discovery URL of a fleet in this etcd."""
        return f"etcd://127.0.0.1:{self.client_port}/{cluster}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_etcd(tmp_dir: Path) -> Etcd:
    """Start etcd (pytest.skip when the binary is missing) and wait until it serves."""
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server; .ci/run does)")
    base = free_port_block(2)
    client, peer = base, base + 1
    data_dir, log_path = tmp_dir / f"etcd-{base}", tmp_dir / f"etcd-{base}.log"
    argv = [ETCD, "--name", "default", "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    etcd = Etcd(process, client, data_dir, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"etcd exited early:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{etcd.endpoint}/health", timeout=1).status_code == 200:
                return etcd
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    etcd.stop()
    raise RuntimeError(f"etcd not serving in {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")
