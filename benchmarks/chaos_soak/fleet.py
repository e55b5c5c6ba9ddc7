"""The fleet under test: every role its own `pdserve <role>` process on loopback, as on hosts
of their own, and the benchmark as their supervisor:

    master ── data-0, data-1          the store: each block on both nodes (--replicas 2)
    prefill-0, prefill-1              home data node: data-0, data-1 (reads try it first)
    decode-0, decode-1
    router-0, router-1                each knows every worker; clients try router-0 first

Each process logs to LOG_DIR/<name>.log (appended across its restarts) and talks CurveZMQ
under one cluster key; as `pdserve up` does, the fleet keeps a standby of each ready process
(pdserve/app/standby.py), and a restart runs it (unless use_standbys is off: then a restart is
a fresh process); on a host of few cores every worker takes one thread, waiting passively.

Ready means what a client of the role needs, checked from outside, never a count that the dead
process could still satisfy:
  router     answers /health, and its /status shows all four workers ready;
  worker     a live router's /status shows it ready, from a status it sent after its restart
             (status_age_s younger than the restart: the killed process sent nothing since);
  data node  a block put through it shows up in the master's index as held by it (a
             registration of the dead process cannot report a new block);
  master     both data nodes pass that round trip through it (its index is rebuilt).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve import security
from pdserve.app.launcher import spawn, start_from, stop_standby
from pdserve.app.launcher.supervision import STANDBY_STAGGER_S
from pdserve.benchmarks import server_process

DATA_NODES = ("data-0", "data-1")
STORE = ("master", *DATA_NODES)
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
ROUTERS = ("router-0", "router-1")
NAMES = STORE + WORKERS + ROUTERS
PROBE_KEY_BYTES = 16  # a block key's length (pdserve.protocol.worker.BLOCK_KEY_BYTES)


class Fleet:
    def __init__(self, model: str, run_dir: Path, base_port: int, num_kv_blocks: int = 256,
                 use_standbys: bool = True, log_dir: Path | None = None) -> None:
        self.model, self.run_dir, self.num_kv_blocks = model, run_dir, num_kv_blocks
        self.log_dir = log_dir or run_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.use_standbys = use_standbys
        self.ports = {name: base_port + i for i, name in enumerate(NAMES)}
        self.key_path = security.ClusterKey.generate().save(run_dir / "cluster.key")
        self.processes: dict[str, subprocess.Popen] = {}
        self.standbys: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}
        """time.monotonic() of each process's (re)start."""

    def address(self, name: str) -> str:
        scheme = "http" if name.startswith("router") else "tcp"
        return f"{scheme}://127.0.0.1:{self.ports[name]}"

    @property
    def router_urls(self) -> list[str]:
        return [self.address(name) for name in ROUTERS]

    def argv(self, name: str) -> list[str]:
        role, _, index = name.partition("-")
        if name == "master":
            return ["store", "--role", "master", "--master-port", str(self.ports[name]),
                    "--replicas", "2", "--node-ttl-s", "4", "--transport", "zmq"]
        if role == "data":
            return ["store", "--role", "data", "--data-port", str(self.ports[name]),
                    "--node-id", name, "--master-address", self.address("master"),
                    "--heartbeat-interval-s", "0.5", "--transport", "zmq"]
        if role in ("prefill", "decode"):
            return [role, "--model", self.model, "--port", str(self.ports[name]),
                    "--worker-id", name, "--num-kv-blocks", str(self.num_kv_blocks),
                    "--cpu-threads", "1", "--store", self.address(f"data-{index}"),
                    "--store-master", self.address("master"), "--store-timeout-s", "2"]
        workers = [arg for worker in WORKERS for arg in
                   (f"--{worker.partition('-')[0]}", self.address(worker))]
        return ["router", "--model", self.model, "--port", str(self.ports[name]), *workers,
                "--heartbeat-timeout-s", "3"]

    def start(self, name: str) -> None:
        """Run `name`'s standby if one waits, else start a fresh process."""
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.processes[name] = start_from(self.standbys.pop(name, None), self.argv(name),
                                              self._env(), stdout=log.fileno())
        self.started_at[name] = time.monotonic()

    def prepare_standby(self, name: str) -> None:
        if not self.use_standbys:
            return
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.standbys[name] = spawn(self.argv(name), self._env(), standby=True,
                                        stdout=log.fileno())

    def _env(self) -> dict[str, str]:
        return dict(os.environ, PDSERVE_CLUSTER_KEY_FILE=str(self.key_path),
                    PDSERVE_LOG_LEVEL="INFO", OMP_WAIT_POLICY="PASSIVE")

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        process = self.processes[name]
        process.kill()
        process.wait(10)

    def is_ready(self, name: str) -> bool:
        """Ready as a client of `name` needs it (the module's docstring)."""
        if self.processes[name].poll() is not None:
            return False
        if name in ROUTERS:
            return self.router_sees_every_worker(name)
        if name in WORKERS:
            return any(self.worker_ready_at(router, name) for router in ROUTERS
                       if self.processes[router].poll() is None)
        if name == "master":
            return all(self.store_round_trip(node) for node in DATA_NODES)
        return self.store_round_trip(name)

    def store_client(self, name: str, timeout_s: float, with_master: bool = False) -> Any:
        """A StoreClient of the store process `name` (the master's verbs, or a data node's,
        with the master's too where with_master)."""
        from pdserve.kvstore.client import StoreClient

        master = self.address("master")
        with security.using(security.ClusterKey.load(self.key_path)):
            if name == "master":
                return StoreClient(None, master, transport="zmq", timeout_s=timeout_s)
            return StoreClient(self.address(name), master if with_master else None,
                               transport="zmq", timeout_s=timeout_s)

    def store_round_trip(self, node: str, timeout_s: float = 2.0) -> bool:
        """A fresh block put through data node `node` is in the master's index as held by
        it within timeout_s (the node reports what it holds with its heartbeats)."""
        key = os.urandom(PROBE_KEY_BYTES)
        try:
            client = self.store_client(node, timeout_s=timeout_s, with_master=True)
        except Exception:  # down or starting: not ready, whatever the error
            return False
        try:
            if not client.put_many([key], [np.zeros(64, np.uint8)])[0]:
                return False
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                lookup = client.lookup_prefix([key])
                if lookup.num_blocks and any(n == node for n, _ in lookup.holders[0]):
                    return True
                time.sleep(0.05)
            return False
        except Exception:  # down, starting, or the master gone: not ready
            return False
        finally:
            client.close()

    def router_status(self, router: str) -> list[dict] | None:
        try:
            if httpx.get(f"{self.address(router)}/health", timeout=2).status_code != 200:
                return None
            return httpx.get(f"{self.address(router)}/status", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def worker_ready_at(self, router: str, worker: str) -> bool:
        """`router` shows `worker` alive and ready by a status received after its start."""
        if worker not in self.started_at:
            return False  # never started
        since_start_s = time.monotonic() - self.started_at[worker]  # before the query
        workers = self.router_status(router) or []
        port = f":{self.ports[worker]}"
        return any(w["address"].endswith(port) and w["is_alive"] and w["is_ready"]
                   and w.get("status_age_s", float("inf")) < since_start_s for w in workers)

    def router_sees_every_worker(self, name: str) -> bool:
        workers = self.router_status(name)
        return workers is not None and len(workers) == len(WORKERS) and all(
            w["is_ready"] for w in workers)

    def wait_ready(self, names: tuple[str, ...] | list[str], timeout_s: float
                   ) -> dict[str, float]:
        """Seconds until each of `names` was ready (TimeoutError past timeout_s)."""
        start = time.monotonic()
        ready_after_s: dict[str, float] = {}
        while len(ready_after_s) < len(names):
            for name in names:
                if name not in ready_after_s and self.is_ready(name):
                    ready_after_s[name] = time.monotonic() - start
            waiting = [name for name in names if name not in ready_after_s]
            if waiting and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not ready within {timeout_s:.0f} s: {waiting}")
            if waiting:
                time.sleep(0.1)
        return ready_after_s

    def start_all(self, timeout_s: float = 600.0) -> None:
        """Start every process, wait until all are ready, then their standbys (one at a
        time, STANDBY_STAGGER_S apart, as the launcher does)."""
        for name in NAMES:
            self.start(name)
        self.wait_ready(NAMES, timeout_s)
        for name in NAMES:
            self.prepare_standby(name)
            time.sleep(STANDBY_STAGGER_S)

    def stop(self) -> None:
        for standby in self.standbys.values():
            stop_standby(standby)
        self.standbys.clear()
        server_process.stop_all(list(self.processes.values()), timeout_s=20)
