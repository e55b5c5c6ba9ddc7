"""A fleet found through a real etcd: every role started with --discovery, routers with no
worker list. Workers join and leave while requests stream, a SIGKILLed worker leaves when
its lease expires, two routers serve one fleet, a restarted router finds every worker."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers.cluster_util import NUM_BLOCKS, Roles, complete, free_port_block, wait_until
from helpers.etcd_util import start_etcd

TTL_S = 3.0
SLACK_S = 5.0  # etcd checks leases about every 0.5 s; the watch and the router poll
START_S = 300.0  # a worker process (torch import, tiny model) on a busy 2-core box
BODY = {"prompt": "def main():", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Fleet(Roles):
    """Store, workers and routers, each `pdserve <role> --discovery URL`."""

    def __init__(self, model_dir, log_dir, url: str) -> None:
        super().__init__(model_dir, log_dir, num_decode=2, num_prefill=1)
        self.url = url
        self.second_router_port = free_port_block(1)

    def discovery_args(self) -> list[str]:
        return ["--discovery", self.url, "--discovery-ttl-s", str(TTL_S)]

    def start_store(self) -> None:
        self.start("store", "store", "--role", "all", "--master-port", str(self.master_port),
                   "--data-port", str(self.data_port), "--transport", "zmq",
                   *self.discovery_args())

    def start_worker(self, role: str, index: int = 0) -> None:
        port = (self.prefill_ports if role == "prefill" else self.decode_ports)[index]
        name = role if index == 0 else f"{role}-{index}"
        self.start(name, role, "--model", self.model_dir, "--port", str(port),
                   "--num-kv-blocks", str(NUM_BLOCKS), "--worker-id", name,
                   "--store-timeout-s", "2", "--kv-lease-ttl-s", "5",
                   "--drain-timeout-s", "30", *self.discovery_args())

    def start_router(self, name: str = "router") -> None:
        port = self.router_port if name == "router" else self.second_router_port
        self.start(name, "router", "--model", self.model_dir, "--port", str(port),
                   "--heartbeat-timeout-s", "5", *self.discovery_args())

    def log(self, name: str) -> str:
        """Everything process `name` logged, over its restarts."""
        return "".join(path.read_text(errors="replace") for path in
                       sorted(self.log_dir.glob(f"{name}-*.log"))
                       if re.fullmatch(rf"{re.escape(name)}-\d+\.log", path.name))

    def url_of(self, router: str) -> str:
        port = self.router_port if router == "router" else self.second_router_port
        return f"http://127.0.0.1:{port}"

    def workers(self, router: str = "router") -> dict[str, dict]:
        """address -> the router's view of that worker."""
        reply = httpx.get(f"{self.url_of(router)}/status", timeout=5).json()
        return {w["address"]: w for w in reply["workers"]}

    def wait_for_workers(self, names: set[str], router: str = "router") -> None:
        """Until the router holds exactly these workers, all ready."""
        wanted = {self.worker_address(name) for name in names}

        def holds() -> bool:
            try:
                workers = self.workers(router)
            except httpx.HTTPError:
                return False
            return set(workers) == wanted and all(w["is_ready"] for w in workers.values())

        assert wait_until(holds, START_S), (router, self._view(router), {
            name: (self.processes[name].poll(), self.log(name)[-1500:]) for name in names})

    def _view(self, router: str) -> object:
        try:
            return self.workers(router)
        except httpx.HTTPError as exc:
            return str(exc)


class Load:
    """`num_clients` threads streaming completions back to back through the routers given
    (in turn), until stopped; every request's (start, end, status, text, error) is kept."""

    def __init__(self, base_urls: list[str], num_clients: int = 2) -> None:
        self.base_urls = base_urls
        self.results: list[tuple[float, float, int, str, str | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(num_clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def wait_for(self, num_results: int, timeout_s: float = 120.0) -> None:
        assert wait_until(lambda: len(self.results) >= num_results, timeout_s), self.results

    def _client(self, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            base_url = self.base_urls[turn % len(self.base_urls)]
            turn += 1
            started, pieces, error, status = time.monotonic(), [], None, 0
            try:
                with httpx.stream("POST", f"{base_url}/v1/completions",
                                  json={**BODY, "stream": True}, timeout=60) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                error = str(chunk["error"])
                            else:
                                pieces.append(chunk["choices"][0]["text"])
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            self.results.append((started, time.monotonic(), status, "".join(pieces), error))

    def check(self, reference: str, events: dict[str, float]) -> None:
        """Every request succeeded with the reference text, and each event happened while
        some request was streaming."""
        failed = [r for r in self.results if r[2] != 200 or r[4] is not None
                  or r[3] != reference]
        assert not failed, failed
        for name, at in events.items():
            assert any(start < at < end for start, end, *_ in self.results), \
                f"no request was streaming at {name}"


@pytest.fixture(scope="module")
def fleet(llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fleet-logs")
    etcd = start_etcd(log_dir)
    fleet = Fleet(llama_dir, log_dir, etcd.url("fleet"))
    try:
        fleet.start_store()
        fleet.start_worker("prefill")
        fleet.start_worker("decode")
        fleet.start_router()
        fleet.wait_for_workers({"prefill", "decode"})
        yield fleet
    finally:
        fleet.stop()
        etcd.stop()


@pytest.fixture(scope="module")
def reference(fleet) -> str:
    return complete(fleet.base_url, **BODY)["choices"][0]["text"]


def test_workers_find_the_store_and_register_what_they_are(fleet, reference):
    """No --store, no worker list: the workers found the store through the registry (the
    decode worker loaded the prompt's KV rather than recomputing it) and the router found
    the workers and the store master."""
    status = httpx.get(f"{fleet.base_url}/status", timeout=5).json()
    assert status["discovery"]["synced"] and status["discovery"]["url"] == fleet.url
    store_address = f"tcp://127.0.0.1:{fleet.data_port}"
    master_address = f"tcp://127.0.0.1:{fleet.master_port}"
    for name in ("prefill", "decode"):
        assert (f"store from the registry: data node {store_address}, master "
                f"{master_address}") in fleet.log(name)
    assert f"prefix lookups ask the store master at {master_address}" in fleet.log("router")


def test_two_routers_serve_the_same_fleet(fleet, reference):
    fleet.start_router("router-2")
    fleet.wait_for_workers({"prefill", "decode"}, "router-2")
    assert set(fleet.workers("router")) == set(fleet.workers("router-2"))
    assert complete(fleet.url_of("router-2"), **BODY)["choices"][0]["text"] == reference
    assert complete(fleet.url_of("router"), **BODY)["choices"][0]["text"] == reference


def test_a_router_restarted_mid_load_finds_every_worker(fleet, reference):
    """Load streams through the second router while the first is SIGKILLed and started
    again: the load never notices, and the new router holds every worker."""
    with Load([fleet.url_of("router-2")]) as load:
        load.wait_for(2)
        fleet.kill("router")
        killed_at = time.monotonic()
        fleet.processes["router"].wait(10)
        fleet.start_router("router")
        fleet.wait_for_workers({"prefill", "decode"}, "router")
        assert complete(fleet.base_url, **BODY)["choices"][0]["text"] == reference
        load.wait_for(len(load.results) + 2)
    load.check(reference, {"the router's kill": killed_at})


def test_workers_join_and_leave_while_requests_stream(fleet, reference):
    """decode-1 joins; then decode leaves gracefully (SIGTERM: withdraw, drain, exit 0):
    requests through both routers stream all the while and none fails; after the leave,
    the joined worker serves them all."""
    with Load([fleet.url_of("router"), fleet.url_of("router-2")]) as load:
        load.wait_for(2)
        fleet.start_worker("decode", 1)
        for router in ("router", "router-2"):
            fleet.wait_for_workers({"prefill", "decode", "decode-1"}, router)
        joined_at = time.monotonic()
        load.wait_for(len(load.results) + 4)
        left_at = time.monotonic()
        fleet.processes["decode"].send_signal(signal.SIGTERM)
        assert fleet.processes["decode"].wait(60) == 0
        for router in ("router", "router-2"):
            fleet.wait_for_workers({"prefill", "decode-1"}, router)
        load.wait_for(len(load.results) + 4)
    load.check(reference, {"the join": joined_at, "the leave": left_at})
    fleet.killed.add("decode")  # gone on purpose (for the leak check)
    log = fleet.log("decode")
    assert "withdrew" in log and "decode drained" in log


def test_a_killed_worker_leaves_every_router_within_its_lease_ttl(fleet, reference):
    """SIGKILL decode-1 with load running: its requests move to decode (started again),
    and both routers drop it once its lease expires."""
    fleet.start_worker("decode")
    fleet.wait_for_workers({"prefill", "decode", "decode-1"})
    with Load([fleet.url_of("router"), fleet.url_of("router-2")]) as load:
        load.wait_for(len(load.results) + 2)
        gone = fleet.worker_address("decode-1")
        fleet.kill("decode-1")
        killed_at = time.monotonic()
        for router in ("router", "router-2"):
            assert wait_until(lambda r=router: gone not in fleet.workers(r),
                              TTL_S + SLACK_S), fleet.workers(router)
        load.wait_for(len(load.results) + 4)
    load.check(reference, {"the kill": killed_at})
    # dropped because its record left the registry (its lease expired), not by a router's
    # own connection or heartbeat failure
    for router in ("router", "router-2"):
        assert f"({gone}) left the registry" in fleet.log(router), fleet.log(router)[-2000:]
    fleet.assert_nothing_leaked()


def test_a_worker_without_a_reachable_registry_exits_with_a_clear_error(llama_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.app.cli", "decode", "--model", str(llama_dir),
         "--port", "1", "--discovery", "etcd://127.0.0.1:1", "--insecure-plaintext"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "etcd at http://127.0.0.1:1 unreachable" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.app.cli", "router", "--model", str(llama_dir),
         "--discovery", "etcd:/nope", "--insecure-plaintext"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "etcd://HOST:PORT[/CLUSTER]" in done.stderr
