"""Put/get throughput of the sharded KV store: one data node against two, on loopback.

For each fleet size an in-process master (`--replicas 1`) indexes that many `pdserve store
--role data` processes, and one FleetClient writes --num-blocks blocks of --block-bytes in
batches of --batch (the master places them; each batch's nodes are written in parallel),
then reads them back the same way. The baseline in the same run is a plain StoreClient
talking to one data node with no master (the pre-sharding path): the fleet's extra cost is
the master's place/locate round trip per batch.

    python -m benchmarks.store_sharded --num-blocks 512 --block-bytes 262144

Prints a table and writes JSON (GB/s and blocks/s, best of --repeats after a warm-up) to
--out. On a host with few cores, data nodes, client and master share them: two nodes add
server threads, not cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.fleet_client import FleetClient
from pdserve.kvstore.server import StoreServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nodes(master_address: str | None, count: int, capacity_blocks: int,
                 transport: str, log_dir: str) -> tuple[list[subprocess.Popen], list[str]]:
    processes, addresses = [], []
    for i in range(count):
        port = _free_port()
        argv = [sys.executable, "-m", "pdserve.app.cli", "store", "--role", "data",
                "--data-port", str(port), "--node-id", f"bench-{i}", "--transport", transport,
                "--dram-blocks", str(capacity_blocks), "--heartbeat-interval-s", "0.5"]
        if master_address is not None:
            argv += ["--master-address", master_address]
        log = open(os.path.join(log_dir, f"node-{i}-{port}.log"), "wb")
        processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, PDSERVE_INSECURE_PLAINTEXT="1")))
        addresses.append(f"tcp://127.0.0.1:{port}")
    return processes, addresses


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _measure(client, keys: list[bytes], blocks: list[np.ndarray], batch: int,
             repeats: int) -> dict[str, float]:
    """Best-of-`repeats` put and get seconds over every block (after one warm-up pass)."""
    put_s, get_s = [], []
    for attempt in range(repeats + 1):
        # fresh keys per pass: a put of held keys would be skipped by the master
        pass_keys = [k + attempt.to_bytes(2, "little") for k in keys]
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            stored = client.put_many(pass_keys[i:i + batch], blocks[i:i + batch])
            if not all(stored):
                raise RuntimeError("a put was not stored")
        put_seconds = time.perf_counter() - start
        if isinstance(client, FleetClient):  # reads need the nodes' reports at the master
            last = pass_keys[-batch:]
            _wait(lambda: all(client.exists(last)), 10, "blocks not indexed")  # noqa: B023
        start = time.perf_counter()
        for i in range(0, len(keys), batch):
            got = client.get_many(pass_keys[i:i + batch])
            if any(g is None for g in got):
                raise RuntimeError("a get missed")
        get_seconds = time.perf_counter() - start
        if attempt > 0:
            put_s.append(put_seconds)
            get_s.append(get_seconds)
    num_bytes = sum(b.nbytes for b in blocks)
    return {"put_gb_s": num_bytes / min(put_s) / 1e9, "get_gb_s": num_bytes / min(get_s) / 1e9,
            "put_blocks_s": len(keys) / min(put_s), "get_blocks_s": len(keys) / min(get_s)}


def run_case(name: str, num_nodes: int, with_master: bool, args: argparse.Namespace,
             keys: list[bytes], blocks: list[np.ndarray], log_dir: str) -> dict:
    master = None
    capacity = len(keys) * (args.repeats + 1) + 64
    if with_master:
        master = StoreServer(StoreConfig(role="master", master_port=0, data_port=0,
                                         transport=args.transport)).start()
    processes, addresses = _start_nodes(master.master_address if master else None, num_nodes,
                                        capacity, args.transport, log_dir)
    client = None
    try:
        if master is not None:
            _wait(lambda: len(master.master.nodes()) == num_nodes, 120, "nodes did not join")
            client = FleetClient(master.master_address, transport=args.transport,
                                 timeout_s=30)
        else:
            _wait(lambda: _answers(addresses[0]), 120, "node did not start")
            client = StoreClient(addresses[0], transport=args.transport, timeout_s=30)
        result = _measure(client, keys, blocks, args.batch, args.repeats)
        if master is not None:
            stats = master.master.stats()
            result["blocks_per_node"] = [stats.get(f"num_indexed.bench-{i}", 0)
                                         for i in range(num_nodes)]
        return {"case": name, "num_nodes": num_nodes, "master": with_master, **result}
    finally:
        if client is not None:
            client.close()
        _stop(processes)
        if master is not None:
            master.stop()


def _answers(address: str) -> bool:
    client = StoreClient(address, transport="zmq", timeout_s=1.0)
    try:
        client.stats()
        return True
    except Exception:
        return False
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--block-bytes", type=int, default=256 * 1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transport", choices=("zmq", "ucx"), default="zmq")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. the host load)")
    parser.add_argument("--out", default=None,
                        help="the JSON file (default: store_sharded.json in --output-dir)")
    add_output_dir(parser, "store_sharded")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    keys = [i.to_bytes(14, "little") for i in range(args.num_blocks)]
    blocks = [rng.integers(0, 256, args.block_bytes, dtype=np.uint8)
              for _ in range(args.num_blocks)]
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        for name, num_nodes, with_master in (("1 node, no master", 1, False),
                                             ("1 node + master", 1, True),
                                             ("2 nodes + master", 2, True)):
            rows.append(run_case(name, num_nodes, with_master, args, keys, blocks, log_dir))
            print(f"{name:20s} put {rows[-1]['put_gb_s']:6.3f} GB/s "
                  f"({rows[-1]['put_blocks_s']:7.0f} blocks/s)  get "
                  f"{rows[-1]['get_gb_s']:6.3f} GB/s ({rows[-1]['get_blocks_s']:7.0f} blocks/s)"
                  + (f"  per node {rows[-1]['blocks_per_node']}"
                     if "blocks_per_node" in rows[-1] else ""), flush=True)
    out = {"benchmark": "store_sharded", "transport": args.transport,
           "num_blocks": args.num_blocks, "block_bytes": args.block_bytes, "batch": args.batch,
           "repeats": args.repeats, "host": platform.node(), "cpu_count": os.cpu_count(),
           "note": args.note, "rows": rows}
    path = output_path(args, "store_sharded", "store_sharded.json", args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
