"""KV block transfer bandwidth between two processes: UCX (shared memory, TCP), ZeroMQ, a
shared memory segment, memcpy.

For each block size, a sender process streams blocks to a receiver process, which lands each
in a preallocated buffer (as a decode worker would into its pool); after the last block the
receiver acknowledges over ZeroMQ, and GB/s = bytes / (first send -> ack). In-process memcpy
into an existing buffer is the ceiling. `cma` is the kernel's cross-process copy on its own
(process_vm_readv from another process's buffer into the same landing pool): the single copy
UCX's shared-memory transport (`ucx_shm`) makes for messages past its eager size
(`UCX_PROTO_INFO=y`: "rendezvous zero-copy read from remote, cma"), so the ceiling UCX can
reach here without xpmem or knem. `shm` is pdserve's same-host hand-off path on its own
(pdserve/kvstore/shm_segment.py): a copy out of another process's memfd segment, mapped read-only,
into the landing pool. UCX runs twice in fresh processes (UCX_TLS is read once at import):
`sm,self` (shared memory / CMA, endpoints from worker addresses exchanged over ZeroMQ) and
`tcp,self`. ZeroMQ is PUSH/PULL over tcp://127.0.0.1.

The hand-off read as a decode worker makes it, request round trip included: `get_shm` and
`get_ucx` are StoreClient.get_many of one block from a hand-off node
(pdserve/handoff/node_server.py) in another process, through its segment and over UCX.

    python -m benchmarks.kv_transfer [--sizes-kib 64,256,1024,4096,16384]

The last line printed is one JSON object: {"results": [{"block_bytes", "ucx_shm_gbps",
"ucx_tcp_gbps", "zmq_gbps", "get_shm_gbps", "get_ucx_gbps", "memcpy_gbps", "cma_gbps",
"shm_gbps", and each path's ratio to memcpy}, ...], ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import zmq

from pdserve.benchmarks.output import add_output_dir, output_path

logger = logging.getLogger(__name__)

_TIMEOUT_MS = 60_000
_TARGET_BYTES = 256 * 1024 * 1024  # per size and transport: enough to amortise setup
_TLS = {"ucx_shm": "sm,self", "ucx_tcp": "tcp,self"}


def num_iters(block_bytes: int) -> int:
    return max(10, min(400, _TARGET_BYTES // block_bytes))


def pattern(block_bytes: int) -> np.ndarray:
    return np.resize(np.arange(251, dtype=np.uint8), block_bytes)  # 0..250 repeating


def landing_pool(block_bytes: int, n: int) -> list[np.ndarray]:
    """One distinct, already touched buffer per transfer, like blocks of a large KV pool: the
    copy lands in memory, not in a cache-resident buffer reused every time."""
    return [np.ones(block_bytes, np.uint8) for _ in range(n)]


def memcpy_gbps(block_bytes: int, warmup: int = 3) -> float:
    """The ceiling: one in-process copy per block into the same kind of landing pool."""
    n = num_iters(block_bytes)
    src = pattern(block_bytes)
    pool = landing_pool(block_bytes, n + warmup)
    for i in range(warmup):
        np.copyto(pool[n + i], src)
    start = time.perf_counter()
    for i in range(n):
        np.copyto(pool[i], src)
    return n * block_bytes / (time.perf_counter() - start) / 1e9


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@contextlib.contextmanager
def _child_holding(offer: Callable[[], tuple[bytes, object]]) -> Iterator[tuple[int, bytes]]:
    """(pid, message) of a forked child that ran offer() -> (message, what it holds) and keeps
    holding that (a buffer, a segment) until the block ends."""
    message_r, message_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            message, held = offer()
            os.write(message_w, message)
            os.read(done_r, 1)
            del held
        finally:
            os._exit(0)
    os.close(message_w)
    os.close(done_r)
    try:
        yield pid, os.read(message_r, 1 << 16)
    finally:
        os.close(message_r)
        os.write(done_w, b"x")
        os.close(done_w)
        os.waitpid(pid, 0)


def _copies_gbps(copy_into: Callable[[np.ndarray], bool], block_bytes: int, warmup: int,
                 what: str) -> float | None:
    """GB/s of copy_into(buffer) (-> whether it worked) over a landing pool, one block at a
    time; None if the warm-up copies fail; the bytes checked against the pattern."""
    n = num_iters(block_bytes)
    pool = landing_pool(block_bytes, n + warmup)  # after a fork: no copy-on-write pages
    if not all(copy_into(pool[n + i]) for i in range(warmup)):
        return None
    start = time.perf_counter()
    worked = [copy_into(pool[i]) for i in range(n)]
    seconds = time.perf_counter() - start
    if not all(worked) or not np.array_equal(pool[n - 1][::997],
                                             pattern(block_bytes)[::997]):
        raise AssertionError(f"{what}: the bytes read differ from the source's")
    return n * block_bytes / seconds / 1e9


def cma_gbps(block_bytes: int, warmup: int = 3) -> float | None:
    """process_vm_readv of one block at a time from a child process's buffer into a landing
    pool: the kernel's single cross-process copy (None where it is not allowed here)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def offer() -> tuple[bytes, object]:
        source = pattern(block_bytes)
        return source.ctypes.data.to_bytes(8, "little"), source

    with _child_holding(offer) as (pid, message):
        remote = _IoVec(int.from_bytes(message, "little"), block_bytes)

        def read_into(buffer: np.ndarray) -> bool:
            local = _IoVec(buffer.ctypes.data, block_bytes)
            return libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1,
                                         0) == block_bytes

        gbps = _copies_gbps(read_into, block_bytes, warmup, "cma")
        if gbps is None:
            logger.warning("cma: process_vm_readv failed (errno %d)", ctypes.get_errno())
        return gbps


def shm_gbps(block_bytes: int, warmup: int = 3) -> float | None:
    """One block at a time copied out of a child process's shared memory segment into a
    landing pool (pdserve/kvstore/shm_segment.py: the one user-space copy a decode worker on the
    prefill worker's host makes of a hand-off), its serial checked after each copy."""
    from pdserve.kvstore.shm_segment import ShmArena, ShmReader
    from pdserve.protocol.store.data import ShmSegment, ShmSpan

    def offer() -> tuple[bytes, object]:
        arena = ShmArena(block_bytes + 2 * 4096)
        block = arena.allocate(block_bytes)
        assert block is not None
        block[:] = pattern(block_bytes)
        span = arena.locate(block.ctypes.data, block_bytes)
        return json.dumps([dataclasses.asdict(arena.segment),
                           dataclasses.asdict(span)]).encode(), (arena, block)

    with _child_holding(offer) as (_, message):
        segment, span = json.loads(message)
        reader = ShmReader(ShmSegment(**segment))
        spans = [ShmSpan(**span)]
        gbps = _copies_gbps(lambda buffer: reader.copy(spans, [block_bytes], buffer)[0],
                            block_bytes, warmup, "shm")
        reader.close()
        return gbps


def run_node(sizes: list[int]) -> None:
    """The `--role node` process: a hand-off node (pdserve/handoff/node_server.py) with a shared
    memory segment, holding one staged block of each size under key `size`; prints its
    address, and lives until its stdin closes."""
    from pdserve.handoff.node_server import HandoffNode

    node = HandoffNode("kv-transfer", "127.0.0.1", len(sizes), 600.0, _TIMEOUT_MS / 1000,
                       shm_bytes=sum(sizes) + 2 * 4096 * len(sizes))
    for size in sizes:
        staging = node.allocate_staging(size)
        assert staging is not None
        staging.numpy()[:] = pattern(size)
        node.put_many([str(size).encode()], [staging])
    print(json.dumps({"address": node.address}), flush=True)
    sys.stdin.read()
    node.close()


def handoff_get_gbps(sizes: list[int], repeats: int, warmup: int) -> dict[str, dict]:
    """What a decode worker's read of a hand-off moves per second, request round trip
    included: StoreClient.get_many of one block from a hand-off node in another process,
    through the node's shared memory segment (`get_shm`) and over UCX (`get_ucx`)."""
    from pdserve.kvstore.client import StoreClient

    node = subprocess.Popen([sys.executable, "-m", "benchmarks.kv_transfer",
                             "--role", "node", "--sizes-bytes", ",".join(map(str, sizes))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out: dict[str, dict] = {"get_shm": {s: [] for s in sizes}, "get_ucx": {s: [] for s in sizes}}
    try:
        assert node.stdout is not None
        if not select.select([node.stdout], [], [], _TIMEOUT_MS / 1000)[0]:
            raise TimeoutError(f"the hand-off node did not start within {_TIMEOUT_MS / 1000:g} s")
        address = json.loads(node.stdout.readline())["address"]
        clients = {"get_shm": StoreClient(address, shm=True),
                   "get_ucx": StoreClient(address, shm=False)}
        if clients["get_shm"].transport != "shm+ucx":
            logger.warning("get_shm: the client could not map the node's segment (%s)",
                           clients["get_shm"].transport)
        for _ in range(repeats):
            for size in sizes:
                key = [str(size).encode()]
                for name, client in clients.items():
                    n = max(5, num_iters(size) // 4)
                    for _ in range(warmup):
                        client.get_many(key)
                    start = time.perf_counter()
                    for _ in range(n):
                        block = client.get_many(key)[0]
                    out[name][size].append(n * size / (time.perf_counter() - start) / 1e9)
                    if block is None or not np.array_equal(block[::997], pattern(size)[::997]):
                        raise AssertionError(f"{name}: the bytes read differ from the node's")
        for client in clients.values():
            client.close()
    finally:
        if node.stdin is not None:
            node.stdin.close()
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
    return out


# ---- the two ends (run as separate processes) ------------------------------------------------
def _control(ctx: zmq.Context, role: str, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, _TIMEOUT_MS)
    if role == "recv":
        sock.bind(f"tcp://127.0.0.1:{port}")
    else:
        sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def run_ucx_end(role: str, port: int, tls: str, sizes: list[int], warmup: int,
                blocking: bool, max_in_flight: int) -> list:
    os.environ["UCX_TLS"] = tls  # before ucxx is imported (inside UcxDataPlane)
    from pdserve.kvstore.ucx_transport import UcxDataPlane

    ctx = zmq.Context()
    control = _control(ctx, role, port)
    plane = UcxDataPlane(tls, blocking=blocking)
    control.send(plane.address)
    peer = plane.connect(control.recv())
    out: list = []  # one value per entry of `sizes`, in order
    for size in sizes:
        n = num_iters(size) + warmup
        window = min(max_in_flight, n)
        in_flight: deque = deque()
        if role == "recv":
            pool = landing_pool(size, n)
            for i in range(n):
                if len(in_flight) == window:
                    plane.wait([in_flight.popleft()], _TIMEOUT_MS / 1000)
                in_flight.append(plane.recv(pool[i], 1))
            plane.wait(list(in_flight), _TIMEOUT_MS / 1000)
            out.append(_ack_and_verify(control, pool, size))
            del pool
        else:
            data = pattern(size)
            for i in range(n):
                if i == warmup:
                    plane.wait(list(in_flight), _TIMEOUT_MS / 1000)
                    in_flight.clear()
                    start = time.perf_counter()
                if len(in_flight) == window:
                    plane.wait([in_flight.popleft()], _TIMEOUT_MS / 1000)
                in_flight.append(plane.send(peer, data, 1))
            plane.wait(list(in_flight), _TIMEOUT_MS / 1000)
            while not control.poll(0):
                plane.progress()  # the receiver may still be pulling the last block from us
            control.recv()
            out.append((n - warmup) * size / (time.perf_counter() - start) / 1e9)
    plane.close()
    ctx.destroy(linger=0)
    return out


def _ack_and_verify(control, pool: list[np.ndarray], size: int) -> bool:
    """Receiver: tell the sender every block landed, then check them (after the ack: the
    check is not part of the transfer)."""
    control.send(b"ack")
    expected = pattern(size)[::997]
    return all(np.array_equal(b[::997], expected) for b in pool)


def run_zmq_end(role: str, port: int, sizes: list[int], warmup: int) -> list:
    ctx = zmq.Context()
    control = _control(ctx, role, port)
    data_sock = ctx.socket(zmq.PULL if role == "recv" else zmq.PUSH)
    data_sock.setsockopt(zmq.LINGER, 0)
    data_sock.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
    if role == "recv":
        data_port = data_sock.bind_to_random_port("tcp://127.0.0.1")
        control.send(str(data_port).encode())
    else:
        data_sock.connect(f"tcp://127.0.0.1:{int(control.recv())}")
    out: list = []
    for size in sizes:
        n = num_iters(size) + warmup
        if role == "recv":
            pool = landing_pool(size, n)
            for i in range(n):
                frame = data_sock.recv(copy=False)
                np.copyto(pool[i], np.frombuffer(frame.buffer, np.uint8))
            out.append(_ack_and_verify(control, pool, size))
            del pool
        else:
            data = pattern(size)
            for i in range(n):
                if i == warmup:
                    start = time.perf_counter()
                data_sock.send(data, copy=False)
            control.recv()
            out.append((n - warmup) * size / (time.perf_counter() - start) / 1e9)
    ctx.destroy(linger=0)
    return out


# ---- orchestration ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(transport: str, sizes: list[int], repeats: int, warmup: int,
             tls: str | None = None, progress: str = "blocking", window: int = 8
             ) -> dict[int, list[float]]:
    """GB/s per block size (one value per repeat) for one transport, from two fresh
    processes; the sizes are interleaved across repeats so background load spreads evenly."""
    port = _free_port()
    sequence = sizes * repeats
    base = [sys.executable, "-m", "benchmarks.kv_transfer",
            "--transport", transport,
            "--port", str(port), "--sizes-bytes", ",".join(map(str, sequence)),
            "--warmup", str(warmup), "--tls", tls or "", "--progress", progress,
            "--window", str(window)]
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    recv = subprocess.Popen([*base, "--role", "recv"], stdout=subprocess.PIPE, env=env)
    send = subprocess.Popen([*base, "--role", "send"], stdout=subprocess.PIPE, env=env)
    try:
        send_out, _ = send.communicate(timeout=600)
        recv_out, _ = recv.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        send.kill()
        recv.kill()
        send.wait()
        recv.wait()
        logger.warning("%s: timed out", transport)
        return {s: [] for s in sizes}
    if send.returncode or recv.returncode:
        logger.warning("%s: an end failed (rc %s/%s); UCX may be unavailable here", transport,
                       send.returncode, recv.returncode)
        return {s: [] for s in sizes}
    gbps = json.loads(send_out.decode().strip().splitlines()[-1])
    verified = json.loads(recv_out.decode().strip().splitlines()[-1])
    if not all(verified):
        raise AssertionError(f"{transport}: received bytes differ from those sent")
    out: dict[int, list[float]] = {s: [] for s in sizes}
    for size, value in zip(sequence, gbps, strict=True):
        out[size].append(value)
    return out


def _best(values: list[float]) -> float | None:
    """The best repeat: on a shared host, the run least disturbed by other processes."""
    return round(max(values), 3) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-kib", default="64,256,1024,4096,16384")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="report the best of these")
    parser.add_argument("--shm-tls", default=_TLS["ucx_shm"], help="UCX_TLS of the shm run")
    parser.add_argument("--tcp-tls", default=_TLS["ucx_tcp"], help="UCX_TLS of the tcp run")
    parser.add_argument("--progress", choices=("blocking", "polling"), default="blocking",
                        help="UCX progress: epoll after a short spin, or pure busy polling")
    parser.add_argument("--window", type=int, default=8,
                        help="UCX transfers in flight per direction")
    parser.add_argument("--out", default=None,
                        help="the JSON file (default: kv_transfer.json in --output-dir)")
    add_output_dir(parser, "kv_transfer")
    # internal: one end of a pair
    parser.add_argument("--role", choices=("send", "recv", "node"), help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes-bytes", help=argparse.SUPPRESS)
    parser.add_argument("--tls", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.role == "node":
        run_node([int(s) for s in args.sizes_bytes.split(",")])
        return 0
    if args.role is not None:
        sizes = [int(s) for s in args.sizes_bytes.split(",")]
        if args.transport == "zmq":
            out = run_zmq_end(args.role, args.port, sizes, args.warmup)
        else:
            out = run_ucx_end(args.role, args.port, args.tls, sizes, args.warmup,
                              args.progress == "blocking", args.window)
        print(json.dumps(out))
        return 0

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    sizes = [int(s) * 1024 for s in args.sizes_kib.split(",")]
    tls = {"ucx_shm": args.shm_tls, "ucx_tcp": args.tcp_tls, "zmq": None}
    by_transport = {t: run_pair(t, sizes, args.repeats, args.warmup, tls[t], args.progress,
                                args.window) for t in tls}
    by_transport.update(handoff_get_gbps(sizes, args.repeats, args.warmup))
    results = []
    for size in sizes:
        row: dict = {"block_bytes": size}
        for transport, gbps in by_transport.items():
            row[f"{transport}_gbps"] = _best(gbps[size])
        row["memcpy_gbps"] = _best([memcpy_gbps(size, args.warmup)
                                    for _ in range(args.repeats)])
        row["cma_gbps"] = _best([v for v in (cma_gbps(size, args.warmup)
                                             for _ in range(args.repeats)) if v is not None])
        row["shm_gbps"] = _best([v for v in (shm_gbps(size, args.warmup)
                                             for _ in range(args.repeats)) if v is not None])
        for name in ("shm", "get_shm", "get_ucx"):
            if row[f"{name}_gbps"] is not None:
                row[f"{name}_vs_memcpy"] = round(row[f"{name}_gbps"] / row["memcpy_gbps"], 3)
        if row["ucx_shm_gbps"] is not None:
            row["ucx_shm_vs_memcpy"] = round(row["ucx_shm_gbps"] / row["memcpy_gbps"], 3)
            if row["cma_gbps"] is not None:
                row["ucx_shm_vs_cma"] = round(row["ucx_shm_gbps"] / row["cma_gbps"], 3)
        if row["cma_gbps"] is not None:
            row["cma_vs_memcpy"] = round(row["cma_gbps"] / row["memcpy_gbps"], 3)
        row["all_repeats_gbps"] = {t: [round(v, 3) for v in g[size]]
                                   for t, g in by_transport.items()}
        results.append(row)
        print(f"{size // 1024:>6} KiB  " + "  ".join(
            f"{k}={v}" for k, v in row.items() if k.endswith(("_gbps", "_memcpy", "_cma"))
            and k != "all_repeats_gbps"), flush=True)
    summary = {"benchmark": "kv_transfer", "results": results, "ucx_tls": tls,
               "ucx_progress": args.progress, "window": args.window,
               "repeats": args.repeats, "loadavg_1m": round(os.getloadavg()[0], 2),
               "note": "two processes on one host, best of repeats; GB/s = 1e9 bytes/s"}
    out = output_path(args, "kv_transfer", "kv_transfer.json", args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
