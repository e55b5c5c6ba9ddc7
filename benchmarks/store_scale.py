"""The store master at fleet scale: lookup and placement rate, latency, and index memory.

A real store master and --num-nodes real data nodes (`pdserve store --role master|data`,
separate processes, ZeroMQ under a fresh CurveZMQ cluster key, as `pdserve up` runs them) are
driven by --num-clients worker identities, each a FleetClient as a worker's connector holds one
(`connect_store`), spread over --num-client-procs processes so that no one interpreter's GIL
is the load generator's limit. The Mooncake conversation trace is replayed in arrival order,
request i by identity i mod --num-clients, its timestamps scaled to each offered rate:

    lookup_prefix(keys)           the request's prefix blocks: how many are cached (master)
    put_many(keys[n:], blocks)    its new blocks: place (master), then the writes (data nodes),
                                  whose reports (`update`) index them at the master

Each rate step replays the next slice of the trace (the trace wraps with fresh keys), so
the hit mix stays the trace's. Per step: lookups/s and placements/s completed, p50/p99 of
the client's call (lookup_prefix, put_many) and of the master round trip itself (lookup_prefix,
place), how late requests started against their schedule, and each process group's CPU.
Blocks carry --block-bytes scaled bytes: the master's work does not depend on them.

Then the index's memory: --index-blocks fresh blocks are put through the same path and the
master's RSS is read as they are indexed (bytes per block = the slope), beside an in-process
account of where the bytes go (keys, the index's table, holder entries, per-node key sets).

    python -m benchmarks.store_scale --rates 100,200,400,800 --step-s 8
    python -m benchmarks.store_scale --profile-master --rates 800 --index-blocks 0

--profile-master runs the master under a sampler of its own (a thread reading the socket
loop's stack every --sample-interval-ms): where its CPU goes, by function. Results (JSON and a
plot) go to --output-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.benchmarks.output import add_output_dir, output_path

TRACE = "../shared/traces/mooncake_conversation_trace.jsonl"
WRAP_SALT = 1 << 40  # each pass over the trace gets fresh keys: hash_id + pass * WRAP_SALT


# ---- the trace -----------------------------------------------------------------------------------
def load_trace(path: str) -> list[tuple[float, list[int]]]:
    """(arrival s, hash_ids) per request, in arrival order."""
    requests = []
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                requests.append((record["timestamp"] / 1000.0, record["hash_ids"]))
    return requests


def block_key(hash_id: int) -> bytes:
    return hash_id.to_bytes(16, "little")  # blake2b-128 keys are 16 bytes too


class TraceCursor:
    """Consecutive slices of the trace, its timestamps scaled to a rate; wraps with fresh keys."""

    def __init__(self, requests: list[tuple[float, list[int]]]):
        self.requests = requests
        self.mean_rate = len(requests) / max(1e-9, requests[-1][0] - requests[0][0])
        self.span_s = requests[-1][0] - requests[0][0] + 1 / self.mean_rate
        self.position = 0
        self.num_passes = 0

    def take(self, rate: float, duration_s: float) -> list[tuple[float, list[int]]]:
        """Requests arriving in `duration_s` at `rate` req/s on average: (offset s, ids)."""
        speedup = rate / self.mean_rate
        out: list[tuple[float, list[int]]] = []
        origin_s = None
        while True:
            if self.position == len(self.requests):
                self.position, self.num_passes = 0, self.num_passes + 1
            arrival_s, ids = self.requests[self.position]
            arrival_s += self.num_passes * self.span_s  # the clock runs on across a wrap
            origin_s = arrival_s if origin_s is None else origin_s
            offset_s = (arrival_s - origin_s) / speedup
            if offset_s >= duration_s:
                return out
            salt = self.num_passes * WRAP_SALT
            out.append((offset_s, [h + salt for h in ids]))
            self.position += 1


# ---- processes -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


class Cluster:
    """A master and data nodes as `pdserve store` processes, plus the client processes."""

    def __init__(self, args: argparse.Namespace, work_dir: Path, env: dict[str, str]):
        self.args, self.work_dir, self.env = args, work_dir, env
        self.master_port = _free_port()
        self.master_address = f"tcp://127.0.0.1:{self.master_port}"
        self.master: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.clients: list[subprocess.Popen] = []
        self.profile_path = work_dir / "master_profile.json"

    def _spawn(self, argv: list[str], log_name: str, **kwargs) -> subprocess.Popen:
        log = open(self.work_dir / log_name, "wb")
        return subprocess.Popen(argv, stdout=kwargs.pop("stdout", log), stderr=log,
                                env=self.env, **kwargs)

    def start(self) -> None:
        args = self.args
        store = ["store", "--role", "master", "--master-port", str(self.master_port)]
        if args.profile_master:
            argv = [sys.executable, "-m", "benchmarks.store_scale", "--serve-master",
                    "--profile-out", str(self.profile_path),
                    "--sample-interval-ms", str(args.sample_interval_ms), "--", *store[1:]]
        else:
            argv = [sys.executable, "-m", "pdserve.app.cli", *store]
        self.master = self._spawn(argv, "master.log")
        capacity = args.node_dram_blocks
        for i in range(args.num_nodes):
            self.nodes.append(self._spawn(
                [sys.executable, "-m", "pdserve.app.cli", "store", "--role", "data",
                 "--master-address", self.master_address, "--data-port", str(_free_port()),
                 "--node-id", f"node-{i}", "--transport", "zmq", "--dram-blocks",
                 str(capacity), "--heartbeat-interval-s", "1.0"], f"node-{i}.log"))
        self._wait_for_nodes()
        per_proc = math.ceil(args.num_clients / args.num_client_procs)
        for p in range(args.num_client_procs if args.num_clients else 0):
            identities = list(range(p * per_proc, min(args.num_clients, (p + 1) * per_proc)))
            client = self._spawn(
                [sys.executable, "-m", "benchmarks.store_scale", "--client-process"],
                f"client-{p}.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            client.stdin.write(json.dumps({
                "master": self.master_address, "identities": identities,
                "block_bytes": args.block_bytes, "num_nodes": args.num_nodes}) + "\n")
            client.stdin.flush()
            self.clients.append(client)
        for client in self.clients:  # each says "ready" once its clients see every node
            line = client.stdout.readline()
            if json.loads(line or "{}").get("num_nodes") != args.num_nodes:
                raise RuntimeError(f"a client process did not start: {line!r} "
                                   f"(logs in {self.work_dir})")

    def _wait_for_nodes(self) -> None:
        """Until every data node has joined (8 stores importing at once on 2 cores: a while)."""
        from pdserve.kvstore.channel import StoreUnavailable
        from pdserve.kvstore.fleet_client import FleetClient

        probe = FleetClient(self.master_address, transport="zmq", timeout_s=5.0)
        deadline = time.monotonic() + 180
        try:
            while time.monotonic() < deadline:
                try:
                    if len(probe.nodes()) == self.args.num_nodes:
                        return
                except StoreUnavailable:
                    pass
                time.sleep(0.5)
            raise TimeoutError(f"data nodes did not join (logs in {self.work_dir})")
        finally:
            probe.close()

    def ask(self, command: dict) -> list[dict]:
        """One command to every client process; their answers."""
        for client in self.clients:
            client.stdin.write(json.dumps(command) + "\n")
            client.stdin.flush()
        return [json.loads(client.stdout.readline()) for client in self.clients]

    def pids(self) -> dict[str, list[int]]:
        return {"master": [self.master.pid], "nodes": [n.pid for n in self.nodes],
                "clients": [c.pid for c in self.clients]}

    def stop(self) -> None:
        for client in self.clients:
            try:
                client.stdin.close()
            except OSError:
                pass
        everyone = [*self.clients, *self.nodes, *([self.master] if self.master else [])]
        for process in everyone:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in everyone:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


# ---- the client process --------------------------------------------------------------------------
class TimedChannel:
    """A FleetClient's master channel, timing each round trip by verb (the master's latency
    as a client sees it, apart from the data nodes' writes that put_many adds)."""

    def __init__(self, inner, sink: list):
        self._inner, self._sink = inner, sink

    def request(self, request_type, reply_type, **fields):
        start = time.perf_counter()
        try:
            return self._inner.request(request_type, reply_type, **fields)
        finally:
            self._sink.append((request_type.TAG, time.perf_counter() - start))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def client_process() -> int:
    """Serve the driver's commands on stdin (one JSON line each), answer on stdout."""
    from pdserve import security
    from pdserve.kvstore.fleet_client import FleetClient

    security.configure_from_env(role="store_scale client")
    config = json.loads(sys.stdin.readline())
    payload = np.zeros(config["block_bytes"], dtype=np.uint8)
    clients, sinks = {}, {}
    for identity in config["identities"]:
        sinks[identity] = []
        client = FleetClient(config["master"], transport="zmq", timeout_s=30.0,
                             holder=f"worker-{identity}")
        client._master = TimedChannel(client._master, sinks[identity])  # noqa: SLF001
        clients[identity] = client
    first = clients[config["identities"][0]]
    _wait(lambda: len(first.nodes()) >= config["num_nodes"], 120, "data nodes did not join")
    print(json.dumps({"num_nodes": len(first.nodes())}), flush=True)

    for line in sys.stdin:
        command = json.loads(line)
        if command["verb"] == "replay":
            print(json.dumps(_replay(command, clients, sinks, payload)), flush=True)
        elif command["verb"] == "fill":
            print(json.dumps(_fill(command, clients, payload)), flush=True)
    for client in clients.values():
        client.close()
    return 0


def _replay(command: dict, clients: dict, sinks: dict, payload: np.ndarray) -> dict:
    """Each identity replays its requests at their scheduled times, one after another."""
    start_at = command["start_at"]
    records: dict[int, list] = {i: [] for i in clients}
    for sink in sinks.values():
        sink.clear()

    def run(identity: int) -> None:
        client, out = clients[identity], records[identity]
        for offset_s, ids in command["requests"].get(str(identity), []):
            scheduled = start_at + offset_s
            now = time.time()
            if scheduled > now:
                time.sleep(scheduled - now)
            late_s = time.time() - scheduled
            keys = [block_key(h) for h in ids]
            t0 = time.perf_counter()
            try:
                found = client.lookup_prefix(keys)
                t1 = time.perf_counter()
                num_new = len(keys) - found.num_blocks
                if num_new:
                    client.put_many(keys[found.num_blocks:], [payload] * num_new)
                t2 = time.perf_counter()
                out.append((late_s, t1 - t0, t2 - t1 if num_new else None, found.num_blocks,
                            num_new, time.time() - start_at, None))
            except Exception as e:  # counted, never fatal: a miss in a real worker
                out.append((late_s, None, None, 0, 0, time.time() - start_at, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    master_rtt: dict[str, list[float]] = {}
    for sink in sinks.values():
        for verb, seconds in sink:
            master_rtt.setdefault(verb, []).append(seconds)
    return {"records": [r for rs in records.values() for r in rs], "master_rtt": master_rtt}


def _fill(command: dict, clients: dict, payload: np.ndarray) -> dict:
    """Put `count` fresh blocks from key `first` on, in batches, from every identity at once."""
    identities = sorted(clients)
    first, count, batch = command["first"], command["count"], command["batch"]
    bounds = [first + count * j // len(identities) for j in range(len(identities) + 1)]
    stored = [0] * len(identities)

    def run(j: int) -> None:
        client = clients[identities[j]]
        for start in range(bounds[j], bounds[j + 1], batch):
            keys = [block_key(h) for h in range(start, min(start + batch, bounds[j + 1]))]
            stored[j] += sum(client.put_many(keys, [payload] * len(keys)))

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(identities))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"stored": sum(stored)}


# ---- the master under a sampler ------------------------------------------------------------------
def serve_master(profile_out: str, interval_ms: float, store_argv: list[str]) -> int:
    """`pdserve store` (the same parser, key and run()), with a thread sampling the socket
    loop's stack: by function, samples at the top (self) and anywhere on it (inclusive)."""
    import logging

    from pdserve import security
    from pdserve.kvstore import server

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    store_args = parser.parse_args(store_argv)
    logging.basicConfig(level=logging.INFO)
    security.configure_from_env(role="store master")
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    stop = threading.Event()
    num_samples = [0, 0]  # [all, idle]

    def name(code) -> str:
        path = code.co_filename
        for marker in ("/pdserve/", "/site-packages/", "/lib/python3"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        return f"{path}:{code.co_name}"

    def sample() -> None:
        while not stop.wait(interval_ms / 1000):
            loop = next((t for t in threading.enumerate() if t.name == "store-server"), None)
            frame = None if loop is None else sys._current_frames().get(loop.ident)
            if frame is None:
                continue
            num_samples[0] += 1
            top = name(frame.f_code)
            if top.endswith("poll.py:poll"):  # waiting in zmq_poll: idle
                num_samples[1] += 1
                continue
            own[top] += 1
            seen = set()
            while frame is not None:
                seen.add(name(frame.f_code))
                frame = frame.f_back
            inclusive.update(seen)

    def write(*_: object) -> None:  # SIGUSR1 (the sweep is over) or the end: once
        if stop.is_set():
            return
        stop.set()
        busy = max(1, num_samples[0] - num_samples[1])
        Path(profile_out).write_text(json.dumps({
            "interval_ms": interval_ms, "num_samples": num_samples[0],
            "idle_fraction": num_samples[1] / max(1, num_samples[0]),
            "self": [(f, round(n / busy, 4)) for f, n in own.most_common(40)],
            "inclusive": [(f, round(n / busy, 4)) for f, n in inclusive.most_common(40)]},
            indent=1))

    signal.signal(signal.SIGUSR1, write)
    threading.Thread(target=sample, name="sampler", daemon=True).start()
    try:
        return server.run(store_args)
    finally:
        write()


# ---- the driver ----------------------------------------------------------------------------------
def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if len(values) else None


def run_step(cluster: Cluster, cursor: TraceCursor, rate: float, args: argparse.Namespace
             ) -> dict:
    requests = cursor.take(rate, args.step_s)
    by_identity: dict[str, list] = {}
    for i, request in enumerate(requests):
        by_identity.setdefault(str(i % args.num_clients), []).append(request)
    pids = cluster.pids()
    cpu_before = {g: sum(cpu_seconds(p) for p in ps) for g, ps in pids.items()}
    wall_start = time.monotonic()
    answers = cluster.ask({"verb": "replay", "start_at": time.time() + 0.5,
                           "requests": by_identity})
    wall_s = time.monotonic() - wall_start - 0.5
    cpu = {g: round((sum(cpu_seconds(p) for p in ps) - cpu_before[g]) / wall_s, 3)
           for g, ps in pids.items()}
    records = [r for a in answers for r in a["records"]]
    master_rtt: dict[str, list[float]] = {}
    for a in answers:
        for verb, values in a["master_rtt"].items():
            master_rtt.setdefault(verb, []).extend(values)
    ok = [r for r in records if r[6] is None]
    end_s = max((r[5] for r in records), default=args.step_s)
    span_s = max(args.step_s, end_s)  # until the last request finished
    lookups = [r[1] for r in ok]
    puts = [r[2] for r in ok if r[2] is not None]
    num_blocks = sum(len(ids) for _, ids in requests)
    return {
        "offered_req_s": round(len(requests) / args.step_s, 1),
        "num_requests": len(requests),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r[6] for r in records if r[6] is not None})[:5],
        "span_s": round(span_s, 2),
        "lookups_per_s": round(len(lookups) / span_s, 1),
        "placements_per_s": round(len(master_rtt.get("place", [])) / span_s, 1),
        "blocks_looked_up_per_s": round(num_blocks / span_s),
        "blocks_placed_per_s": round(sum(r[4] for r in ok) / span_s),
        "hit_block_fraction": round(sum(r[3] for r in ok) / max(1, num_blocks), 3),
        "late_p50_ms": _percentile([r[0] for r in records], 50),
        "late_p99_ms": _percentile([r[0] for r in records], 99),
        "lookup_prefix_p50_ms": _percentile(lookups, 50),
        "lookup_prefix_p99_ms": _percentile(lookups, 99),
        "put_many_p50_ms": _percentile(puts, 50),
        "put_many_p99_ms": _percentile(puts, 99),
        "master_rtt_ms": {verb: {"count": len(v), "p50": _percentile(v, 50),
                                 "p99": _percentile(v, 99)}
                          for verb, v in sorted(master_rtt.items())},
        "cpu_cores": cpu,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def measure_index_memory(cluster: Cluster, args: argparse.Namespace, first_key: int) -> dict:
    """Master RSS as --index-blocks fresh blocks are put (and indexed) in --index-points
    steps; the slope is the bytes per block."""
    from pdserve.kvstore.fleet_client import FleetClient

    probe = FleetClient(cluster.master_address, transport="zmq", timeout_s=30.0)
    try:
        def indexed() -> int:
            return int(probe.stats()["num_master_blocks"])

        points = []
        step = args.index_blocks // args.index_points
        base = indexed()
        points.append((base, rss_bytes(cluster.master.pid)))
        for k in range(args.index_points):
            start = time.monotonic()
            cluster.ask({"verb": "fill", "first": first_key + k * step, "count": step,
                         "batch": 512})
            target = base + (k + 1) * step
            _wait(lambda t=target: indexed() >= t, 600, "blocks not indexed")
            points.append((indexed(), rss_bytes(cluster.master.pid)))
            print(f"index: {points[-1][0]:>9,} blocks, master RSS "
                  f"{points[-1][1] / 2**20:7.1f} MiB ({step / (time.monotonic() - start):,.0f} "
                  f"blocks/s)", flush=True)
    finally:
        probe.close()
    blocks = np.array([p[0] for p in points], dtype=float)
    rss = np.array([p[1] for p in points], dtype=float)
    slope = float(np.polyfit(blocks, rss, 1)[0])
    return {"points": [{"blocks": int(b), "rss_bytes": int(r)} for b, r in points],
            "bytes_per_block": round(slope, 1),
            "mib_per_million_blocks": round(slope * 1e6 / 2**20, 1)}


def index_breakdown(num_blocks: int, num_nodes: int) -> dict:
    """Where an in-process Master's bytes per block go (sys.getsizeof of its structures),
    the blocks spread over `num_nodes` nodes as placement spreads them."""
    import gc

    from pdserve.kvstore.master import Master

    master = Master(node_ttl_s=10.0)
    for i in range(num_nodes):
        master.join(f"node-{i}", f"tcp://127.0.0.1:{9000 + i}")
    keys = [block_key(h) for h in range(num_blocks)]
    for i in range(num_nodes):
        master.update(f"node-{i}", [(k, "dram") for k in keys[i::num_nodes]])
    gc.collect()
    index = master._index  # noqa: SLF001
    key_bytes = sum(sys.getsizeof(k) for k in keys)
    holders = {id(v): sys.getsizeof(v) for v in index.values()}
    node_sets = sum(sys.getsizeof(n.keys) for n in master._nodes.values())  # noqa: SLF001
    parts = {"key objects": key_bytes, "index table": sys.getsizeof(index),
             "holder entries": sum(holders.values()), "per-node key sets": node_sets}
    return {"num_blocks": num_blocks,
            "bytes_per_block": {k: round(v / num_blocks, 1) for k, v in parts.items()},
            "total_bytes_per_block": round(sum(parts.values()) / num_blocks, 1)}


def handler_cost(requests: list[tuple[float, list[int]]], num_nodes: int) -> dict:
    """CPU microseconds the master's own code spends per verb (decode, handler, encode), in
    process over the whole trace: the ceiling of one core, apart from sockets and the box.
    Each node reports each request's placements in one update, as a reporter does when
    requests are 5 ms apart."""
    from pdserve.kvstore.master import Master, Usage
    from pdserve.kvstore.master_service import MasterService
    from pdserve.kvstore.service import Peer
    from pdserve.protocol.store.base import (
        STORE_PROTOCOL,
        LookupPrefixRequest,
        decode_store_message,
    )
    from pdserve.protocol.store.master import PlacementChange, PlaceRequest, UpdateRequest

    service = MasterService(Master(node_ttl_s=10.0))
    for i in range(num_nodes):
        service.master.join(f"node-{i}", f"tcp://127.0.0.1:{9000 + i}", Usage(1 << 24, 0, 0))
    peer = Peer(b"bench", [])
    seconds: Counter[str] = Counter()
    counts: Counter[str] = Counter()

    def serve(verb: str, request) -> object:
        raw = STORE_PROTOCOL.encode(request)
        start = time.process_time()
        decoded = decode_store_message(raw)
        reply = STORE_PROTOCOL.encode(service.handlers[type(decoded)](decoded, peer).reply)
        seconds[verb] += time.process_time() - start
        counts[verb] += 1
        return decode_store_message(reply)

    for i, (_, ids) in enumerate(requests):
        keys = [block_key(h) for h in ids]
        found = serve("lookup_prefix", LookupPrefixRequest(request_id=i + 1, keys=keys))
        new = keys[found.num_blocks:]
        if not new:
            continue
        placed = serve("place", PlaceRequest(request_id=i + 1, keys=new))
        by_node: dict[str, list[PlacementChange]] = {}
        for k, targets in zip(new, placed.targets, strict=True):
            for node_id in targets:
                by_node.setdefault(node_id, []).append(PlacementChange(k, "dram"))
        for node_id, changes in by_node.items():
            serve("update", UpdateRequest(request_id=i + 1, node_id=node_id, changes=changes))
    per_op = {verb: round(seconds[verb] / counts[verb] * 1e6, 1) for verb in counts}
    return {"us_per_op": per_op, "ops": dict(counts),
            "us_per_request": round(sum(seconds.values()) / len(requests) * 1e6, 1)}


def plot(steps: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    offered = [s["offered_req_s"] for s in steps]
    ax_rate.plot(offered, [s["lookups_per_s"] for s in steps], marker="o", label="lookups/s")
    ax_rate.plot(offered, [s["placements_per_s"] for s in steps], marker="s",
                 label="placements/s")
    ax_rate.plot(offered, offered, color="grey", linestyle=":", label="offered")
    ax_rate.set_xlabel("offered requests/s")
    ax_rate.set_ylabel("completed per s")
    ax_rate.legend()
    for verb, marker in (("lookup_prefix", "o"), ("place", "s")):
        for q, style in (("p50", "-"), ("p99", "--")):
            ax_lat.plot(offered, [s["master_rtt_ms"].get(verb, {}).get(q) for s in steps],
                        marker=marker, linestyle=style, label=f"{verb} {q}")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("offered requests/s")
    ax_lat.set_ylabel("master round trip (ms)")
    ax_lat.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor()


def drive(args: argparse.Namespace) -> int:
    from pdserve import security

    requests = load_trace(args.trace)
    cursor = TraceCursor(requests)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    out = output_path(args, "store_scale", "store_scale.json", args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-store-scale-") as tmp:
        work_dir = Path(tmp)  # the key; the processes' logs go beside the results
        log_dir = out.parent / "logs"
        log_dir.mkdir(exist_ok=True)
        key = security.ClusterKey.generate()
        security.configure(key)  # the driver's own probe of the master
        env = dict(os.environ, PDSERVE_CLUSTER_KEY_FILE=str(key.save(work_dir / "cluster.key")))
        cluster = Cluster(args, log_dir, env)
        print(f"starting a master, {args.num_nodes} data nodes and {args.num_client_procs} "
              f"client processes ({args.num_clients} identities)...", flush=True)
        steps, index = [], None
        try:
            cluster.start()
            for rate in [args.warmup_rate, *rates]:
                step = run_step(cluster, cursor, rate, args)
                step["warmup"] = rate == args.warmup_rate and not steps
                steps.append(step)
                rtt = step["master_rtt_ms"]
                print(f"offered {step['offered_req_s']:7.1f} req/s: lookups "
                      f"{step['lookups_per_s']:7.1f}/s placements {step['placements_per_s']:7.1f}"
                      f"/s | master rtt lookup p50/p99 "
                      f"{rtt.get('lookup_prefix', {}).get('p50') or 0:6.2f}/"
                      f"{rtt.get('lookup_prefix', {}).get('p99') or 0:6.2f} ms, place "
                      f"{rtt.get('place', {}).get('p50') or 0:6.2f}/"
                      f"{rtt.get('place', {}).get('p99') or 0:6.2f} ms | late p99 "
                      f"{step['late_p99_ms']:7.1f} ms | cpu {step['cpu_cores']} load "
                      f"{step['loadavg_1m']} | errors "
                      f"{step['num_errors']}", flush=True)
            if args.profile_master:  # the profile covers the sweep, not the fill below
                cluster.master.send_signal(signal.SIGUSR1)
            if args.index_blocks:
                index = measure_index_memory(cluster, args, first_key=1 << 60)
        finally:
            cluster.stop()
        profile = (json.loads(cluster.profile_path.read_text())
                   if cluster.profile_path.exists() else None)
    measured = [s for s in steps if not s["warmup"]]
    plot_path = out.with_suffix(".png")
    if measured:
        plot(measured, plot_path)
    result = {
        "benchmark": "store_scale", "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "note": args.note, "trace": args.trace, "num_nodes": args.num_nodes,
        "num_clients": args.num_clients, "num_client_procs": args.num_client_procs,
        "block_bytes": args.block_bytes, "step_s": args.step_s,
        "steps": steps, "index_memory": index,
        "index_breakdown": index_breakdown(args.breakdown_blocks, args.num_nodes)
        if args.breakdown_blocks else None,
        "handler_cost": handler_cost(requests, args.num_nodes) if args.handler_cost else None,
        "master_profile": profile, "plot": str(plot_path) if measured else None,
    }
    out.write_text(json.dumps(result, indent=1))
    if index is not None:
        print(f"index: {index['bytes_per_block']:.0f} bytes per block in the master's RSS "
              f"({index['mib_per_million_blocks']:.0f} MiB per million)")
    if result["index_breakdown"]:
        print(f"in process: {result['index_breakdown']}")
    if result["handler_cost"]:
        print(f"master handlers in process (CPU us per op): {result['handler_cost']}")
    if profile is not None:
        print(f"master profile: idle {profile['idle_fraction']:.2f}; busy time, top (self): "
              + ", ".join(f"{f} {s:.2f}" for f, s in profile["self"][:8]))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client-process"]:
        return client_process()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--rates", default="100,200,400,800,1600",
                        help="offered requests/s, one step each")
    parser.add_argument("--warmup-rate", type=float, default=50.0)
    parser.add_argument("--step-s", type=float, default=8.0, help="seconds per rate step")
    parser.add_argument("--num-nodes", type=int, default=8)
    parser.add_argument("--num-clients", type=int, default=64, help="worker identities")
    parser.add_argument("--num-client-procs", type=int, default=4)
    parser.add_argument("--block-bytes", type=int, default=64,
                        help="scaled bytes per block (the master never sees them)")
    parser.add_argument("--node-dram-blocks", type=int, default=400_000,
                        help="each data node's capacity (the run must not evict)")
    parser.add_argument("--index-blocks", type=int, default=1_000_000,
                        help="fresh blocks indexed to measure the master's memory (0: skip)")
    parser.add_argument("--index-points", type=int, default=4)
    parser.add_argument("--breakdown-blocks", type=int, default=1_000_000,
                        help="blocks of the in-process account of the index (0: skip)")
    parser.add_argument("--no-handler-cost", dest="handler_cost", action="store_false",
                        help="skip the in-process cost of the master's handlers")
    parser.add_argument("--profile-master", action="store_true",
                        help="sample the master's socket loop (where its CPU goes)")
    parser.add_argument("--sample-interval-ms", type=float, default=2.0)
    parser.add_argument("--serve-master", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the host load)")
    parser.add_argument("--out", default=None,
                        help="the JSON file (default: store_scale.json in --output-dir)")
    add_output_dir(parser, "store_scale")
    if "--serve-master" in argv:  # the master process itself: store flags after "--"
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        return serve_master(args.profile_out, args.sample_interval_ms, argv[split + 1:])
    return drive(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
