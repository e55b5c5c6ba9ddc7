"""Start a whole pdserve cluster (`pdserve up`) as a subprocess for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve import security
from pdserve.kvstore.client import StoreClient


def free_port_block(count: int) -> int:
    """A base port with `count` consecutive free ports after it, below the kernel's ephemeral
    range, so a port some process picks with bind(0) meanwhile cannot land inside it. Under
    pytest-xdist each worker picks from a range of its own (PYTEST_XDIST_WORKER gw0, gw1, ...),
    so two tests running at once never pick the same block between its check and its use."""
    rng = random.Random()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    span = 12000 // max(num_workers, 1)
    low = 20000 + span * (index % max(num_workers, 1))
    for _ in range(200):
        base = rng.randrange(low, low + span - count)
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
    key_path: Path  # the cluster key `pdserve up` gave its children

    def status(self) -> dict:
        return httpx.get(f"{self.base_url}/status", timeout=5).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def store_client(self) -> StoreClient:
        """A client of the cluster's store (`pdserve up`: master at store_port, data next),
        holding the cluster key."""
        with security.using(security.ClusterKey.load(self.key_path)):
            return StoreClient(f"tcp://127.0.0.1:{self.store_port + 1}",
                               f"tcp://127.0.0.1:{self.store_port}", transport="zmq",
                               timeout_s=5)

    def assert_nothing_leaked(self, with_store: bool = True, timeout_s: float = 30.0) -> None:
        """assert_nothing_leaked for this cluster; with_store=False where it runs no store
        (colocated mode)."""
        store = self.store_client() if with_store else None
        try:
            assert_nothing_leaked(self.base_url, store, timeout_s)
        finally:
            if store is not None:
                store.close()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


# A hand-off lease's life on the test clusters: short, so a lease whose decode never came
# expires within a leak check's 30 s wait; long enough that a loaded CI host still sees one
# before it expires (at 5 s a hand-off's lease once expired before a test could look).
LEASE_TTL_S = 10


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    """Poll `predicate` every 0.25 s; whether it held within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def workers_idle(base_url: str) -> bool:
    """Every worker behind the router is alive, holds no request and has all its KV blocks
    free."""
    return surviving_workers_idle(base_url, killed_addresses=())


def surviving_workers_idle(base_url: str, killed_addresses: Collection[str],
                           since_s: float | None = None) -> bool:
    """Every worker but those a test killed on purpose (by address: a worker's id is known only
    from its status) is alive and idle as it last reported (no request owned, running, saving
    or loading; all its KV blocks free; no hand-off lease on its node), and nothing of it is
    in flight at the router. `since_s` (time.monotonic()): only a status that came after it
    counts, so a heartbeat answered before the test's last request reached the worker does not
    pass for idle. A killed worker is left out: the router keeps its last status, or none once
    the connection dropped, so it reads neither idle nor busy."""
    workers = httpx.get(f"{base_url}/status", timeout=5).json()["workers"]
    fresh_s = None if since_s is None else time.monotonic() - since_s
    return all(w["is_alive"] and w.get("is_idle", False) and w["num_inflight"] == 0
               and w["num_free_blocks"] == w["num_total_blocks"]
               and (fresh_s is None or w["status_age_s"] < fresh_s)
               for w in workers if w["address"] not in killed_addresses)


def assert_nothing_leaked(base_url: str, store: StoreClient | None = None,
                          timeout_s: float = 30.0,
                          killed_addresses: Collection[str] = ()) -> None:
    """The end of every end-to-end test: every worker (but those at killed_addresses) alive
    and idle with all its blocks free, and the store (when given) holding no lease and no
    pinned block. Waits up to timeout_s, since a finished request's last release may still be
    on its way, and a killed worker's leases only go when their TTL runs out."""
    since_s = time.monotonic()
    assert wait_until(lambda: surviving_workers_idle(base_url, killed_addresses, since_s),
                      timeout_s), \
        httpx.get(f"{base_url}/status", timeout=5).json()["workers"]
    if store is None:
        return

    def released() -> bool:
        stats = store.stats()
        return stats["num_leases"] == 0 and stats["num_pinned"] == 0

    assert wait_until(released, timeout_s), store.stats()
    store.check_integrity()


def start_cluster(model_dir: Path, log_dir: Path, *extra: str, timeout_s: float = 240.0
                  ) -> Cluster:
    base = free_port_block(40)
    port, store_port, worker_base = base, base + 10, base + 20
    log_path = log_dir / f"pdserve-up-{port}.log"
    key_path = log_dir / f"cluster-{port}.key"  # written by `pdserve up`
    argv = [sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(model_dir),
            "--port", str(port), "--store-port", str(store_port),
            "--worker-base-port", str(worker_base), "--cluster-key-file", str(key_path),
            *extra]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="INFO")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    cluster = Cluster(process, f"http://127.0.0.1:{port}", worker_base, store_port, log_path,
                      key_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited early:\n{cluster.log()}")
        if "pdserve is ready" in log_path.read_text(errors="replace"):
            return cluster
        time.sleep(0.2)
    cluster.stop()
    raise RuntimeError(f"pdserve up not ready in {timeout_s}s:\n{cluster.log()}")


NUM_BLOCKS = 256


class Roles:
    """Store, `num_prefill` prefill workers, `num_decode` decode workers and a router, each its
    own `pdserve <role>` process, as in a real cluster (names: store, prefill, prefill-1, ...,
    decode, decode-1, ..., router). With `num_data_nodes` the store is a master process
    ("master", placing each block on `replicas` nodes) and that many data nodes ("data-0",
    "data-1", ...; the workers' --store is data-0) instead of one process of both."""

    def __init__(self, model_dir, log_dir, num_decode: int = 1,
                 router_args: tuple[str, ...] = (), num_prefill: int = 1,
                 num_data_nodes: int = 0, replicas: int = 1,
                 worker_args: tuple[str, ...] = ()) -> None:
        """`worker_args`: flags every worker (restarted ones too) is started with."""
        self.model_dir, self.log_dir = str(model_dir), log_dir
        self.worker_args = worker_args
        base = free_port_block(12 + num_data_nodes)
        self.router_port, self.master_port, self.data_port = base, base + 1, base + 2
        self.prefill_ports = [base + 3 + i for i in range(num_prefill)]
        self.decode_ports = [base + 3 + num_prefill + i for i in range(num_decode)]
        self.data_ports = [self.data_port] + [base + 12 + i for i in range(num_data_nodes - 1)]
        self.num_data_nodes, self.replicas = num_data_nodes, replicas
        self.router_args = router_args
        self.key_path = security.ClusterKey.generate().save(log_dir / f"cluster-{base}.key")
        self.processes: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()  # names killed on purpose and not started again

    @property
    def decode_port(self) -> int:
        return self.decode_ports[0]

    @property
    def prefill_port(self) -> int:
        return self.prefill_ports[0]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start(self, name: str, *argv: str) -> None:
        self.killed.discard(name)
        log = open(self.log_dir / f"{name}-{len(self.processes)}.log", "ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "pdserve.app.cli", *argv], stdout=log,
            stderr=subprocess.STDOUT, env=dict(os.environ, PDSERVE_LOG_LEVEL="INFO",
                                               PDSERVE_CLUSTER_KEY_FILE=str(self.key_path)))

    def worker_address(self, name: str) -> str:
        """The address the router reaches worker `name` (prefill, decode, decode-1, ...) at."""
        role, _, index = name.partition("-")
        ports = self.prefill_ports if role == "prefill" else self.decode_ports
        return f"tcp://127.0.0.1:{ports[int(index or 0)]}"

    def start_worker(self, role: str, index: int = 0) -> None:
        port = (self.prefill_ports if role == "prefill" else self.decode_ports)[index]
        name = role if index == 0 else f"{role}-{index}"
        self.start(name, role, "--model", self.model_dir, "--port", str(port),
                   "--num-kv-blocks", str(NUM_BLOCKS), "--worker-id", name,
                   "--store", f"tcp://127.0.0.1:{self.data_port}",
                   "--store-master", f"tcp://127.0.0.1:{self.master_port}",
                   "--store-timeout-s", "2", "--kv-lease-ttl-s", str(LEASE_TTL_S),
                   *self.worker_args)

    def start_store(self, name: str) -> None:
        """Start (again) the store process `name`: store, master, or data-i."""
        if name == "store":
            self.start("store", "store", "--role", "all", "--master-port",
                       str(self.master_port), "--data-port", str(self.data_port),
                       "--transport", "zmq")
        elif name == "master":
            self.start("master", "store", "--role", "master", "--master-port",
                       str(self.master_port), "--replicas", str(self.replicas),
                       "--node-ttl-s", "4", "--transport", "zmq")
        else:
            index = int(name.partition("-")[2])
            self.start(name, "store", "--role", "data", "--data-port",
                       str(self.data_ports[index]), "--node-id", f"store-{index}",
                       "--master-address", f"tcp://127.0.0.1:{self.master_port}",
                       "--heartbeat-interval-s", "0.5", "--transport", "zmq")

    def start_all(self) -> None:
        if self.num_data_nodes:
            self.start_store("master")
            for i in range(self.num_data_nodes):
                self.start_store(f"data-{i}")
        else:
            self.start_store("store")
        worker_args = []
        for role, ports in (("prefill", self.prefill_ports), ("decode", self.decode_ports)):
            for i, port in enumerate(ports):
                self.start_worker(role, i)
                worker_args += [f"--{role}", f"tcp://127.0.0.1:{port}"]
        self.start("router", "router", "--model", self.model_dir, "--port",
                   str(self.router_port), *worker_args, *self.router_args)

    def kill(self, name: str) -> None:
        """SIGKILL one process, as a crash would, and remember it for the leak check."""
        self.killed.add(name)
        self.processes[name].kill()

    def assert_nothing_leaked(self, timeout_s: float = 30.0) -> None:
        """assert_nothing_leaked for this cluster. Workers killed on purpose are left out and
        every other must be alive and idle; the store is checked unless it was killed, as
        nothing is then left to ask (the workers alone are checked)."""
        store_names = {"store", "master"} | {f"data-{i}" for i in range(self.num_data_nodes)}
        store = None if self.killed & {"store", "master", "data-0"} else self.store_client()
        try:
            killed_addresses = [self.worker_address(name) for name in self.killed
                                if name not in store_names]
            assert_nothing_leaked(self.base_url, store, timeout_s, killed_addresses)
        finally:
            if store is not None:
                store.close()

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("cluster not ready")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a test may have stopped one
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def store_client(self) -> StoreClient:
        with security.using(security.ClusterKey.load(self.key_path)):
            return StoreClient(f"tcp://127.0.0.1:{self.data_port}",
                               f"tcp://127.0.0.1:{self.master_port}", transport="zmq")


def complete(base_url: str, **body) -> dict:
    """POST /v1/completions and return its JSON body (the 200 asserted)."""
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(base_url: str, path: str, body: dict) -> list[dict]:
    """POST `body` with stream on and return its SSE chunks, parsed (the 200 asserted)."""
    chunks = []
    with httpx.stream("POST", f"{base_url}{path}", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks
