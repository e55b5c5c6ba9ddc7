"""Start a whole pdserve cluster (`pdserve up`) as a subprocess for end-to-end tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port_block(count: int) -> int:
    """A base port with `count` consecutive free ports after it, below the kernel's ephemeral
    range, so a port some process picks with bind(0) meanwhile cannot land inside it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port block")


@dataclass
class Cluster:
    process: subprocess.Popen
    base_url: str
    worker_base_port: int
    store_port: int
    log_path: Path

    def status(self) -> dict:
        return httpx.get(f"{self.base_url}/status", timeout=5).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_cluster(model_dir: Path, log_dir: Path, *extra: str, timeout_s: float = 240.0
                  ) -> Cluster:
    base = free_port_block(40)
    port, store_port, worker_base = base, base + 10, base + 20
    log_path = log_dir / f"pdserve-up-{port}.log"
    argv = [sys.executable, "-m", "pdserve.serve.cli", "up", "--model", str(model_dir),
            "--port", str(port), "--store-port", str(store_port),
            "--worker-base-port", str(worker_base), *extra]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="INFO")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    cluster = Cluster(process, f"http://127.0.0.1:{port}", worker_base, store_port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited early:\n{cluster.log()}")
        if "pdserve is ready" in log_path.read_text(errors="replace"):
            return cluster
        time.sleep(0.5)
    cluster.stop()
    raise RuntimeError(f"pdserve up not ready in {timeout_s}s:\n{cluster.log()}")
