"""`pdserve store`: the metadata master and/or the data server, in one ZeroMQ event loop.

One thread owns every socket (ZeroMQ sockets are not thread-safe) and serves requests one at a
time, so the store, lease table and master need no extra locking here. Each loop turn also
expires leases (unpinning their blocks) and silent nodes. A data-only node reports placement
changes and heartbeats to its master from a small reporter thread with its own socket.

A malformed request (not msgpack, unknown type or field, wrong types or sizes, pickle bytes) is
logged and answered with an error; the loop keeps serving. Nothing received is ever executed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from typing import Any

import numpy as np
import zmq

from pdserve.kvstore import messages
from pdserve.kvstore.config import ROLES, TRANSPORTS, StoreConfig
from pdserve.kvstore.lease import Lease, LeaseTable
from pdserve.kvstore.master import Master
from pdserve.kvstore.master_reporter import MasterReporter
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.kvstore.ucx_transport import UcxDataPlane, UcxUnavailable, is_connectable

logger = logging.getLogger(__name__)

_POLL_MS = 50


def _bind(socket: zmq.Socket, host: str, port: int) -> str:
    if port == 0:
        port = socket.bind_to_random_port(f"tcp://{host}")
    else:
        socket.bind(f"tcp://{host}:{port}")
    return f"tcp://{host}:{port}"


class StoreServer:
    """Serves a TieredStore (role data/all) and a Master (role master/all) until stopped."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.master: Master | None = None
        self.store: TieredStore | None = None
        self.leases = LeaseTable()
        self.master_address: str | None = None
        self.data_address: str | None = None
        self._master_socket: zmq.Socket | None = None
        self._data_socket: zmq.Socket | None = None
        self._reporter: MasterReporter | None = None
        self._ucx: UcxDataPlane | None = None
        self._ucx_clients: dict[bytes, tuple[int, int]] = {}  # zmq identity -> (client_no, ep)
        self._next_client_no = 1
        self._pending_sends: list[tuple[Any, np.ndarray]] = []  # UCX gets awaiting completion
        self.num_rejected = 0
        if config.role in ("master", "all"):
            self.master = Master(config.node_ttl_s)
            self._master_socket = self._ctx.socket(zmq.ROUTER)
            self._master_socket.setsockopt(zmq.LINGER, 0)
            self.master_address = _bind(self._master_socket, config.host, config.master_port)
        if config.role in ("data", "all"):
            self._data_socket = self._ctx.socket(zmq.ROUTER)
            self._data_socket.setsockopt(zmq.LINGER, 0)
            self.data_address = _bind(self._data_socket, config.host, config.data_port)
            self.store = TieredStore.build(
                config.dram_capacity_blocks, config.disk_capacity_blocks, config.disk_dir,
                on_change=self._on_block_change)
            if config.transport == "ucx":
                try:
                    self._ucx = UcxDataPlane(config.ucx_tls)
                    logger.info("store: UCX data plane up (UCX_TLS=%s)", self._ucx.tls)
                except UcxUnavailable as e:
                    logger.warning("store: UCX cannot start (%s); KV bytes fall back to "
                                   "ZeroMQ over TCP", e)
            if self.master is not None:
                self.master.join(config.node_id, self.data_address)
                # blocks re-indexed from disk before the master knew this node
                for tier in self.store.tiers:
                    self.master.update(config.node_id,
                                       [(k, tier.name) for k in tier.keys_oldest_first()])
            elif config.master_address is not None:
                self._reporter = MasterReporter(
                    self._ctx, config.master_address, config.node_id, self.data_address,
                    config.heartbeat_interval_s, config.request_timeout_s, self._inventory)
        logger.info("store: role=%s master=%s data=%s", config.role, self.master_address,
                    self.data_address)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> StoreServer:
        self._thread = threading.Thread(target=self._serve, name="store-server", daemon=True)
        self._thread.start()
        if self._reporter is not None:
            self._reporter.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._reporter is not None:
            self._reporter.stop(timeout_s)
        for lease in self.leases.release_all():
            self._unpin(lease)
        if self.store is not None:
            self.store.close()
        if self._ucx is not None:
            self._ucx.close()
        self._ctx.destroy(linger=0)

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler); `stop()` then cleans up."""
        self._stop.set()

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    # ---- events -----------------------------------------------------------------------------
    def _on_block_change(self, key: bytes, tier: str | None) -> None:
        if self.master is not None:
            self.master.update(self.config.node_id, [(key, tier)])
        elif self._reporter is not None:
            self._reporter.record(key, tier)

    def _inventory(self) -> list[tuple[bytes, str | None]]:
        """Every block this node holds (the reporter sends it after (re)joining)."""
        assert self.store is not None
        return [(k, t) for t in ("dram", "disk") for k in self._keys_in(t)]

    def _keys_in(self, tier: str) -> list[bytes]:
        assert self.store is not None
        if all(t.name != tier for t in self.store.tiers):
            return []
        return self.store.keys_in(tier)

    def _unpin(self, lease: Lease) -> None:
        if self.store is not None and lease.keys:
            self.store.release(list(lease.keys))

    # ---- loop -------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for socket in (self._master_socket, self._data_socket):
            if socket is not None:
                poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                break
            for socket in ready:
                try:
                    self._serve_one(socket)
                except Exception:  # never let one request end the server
                    logger.exception("store: request handling failed")
            for lease in self.leases.expire():
                logger.info("store: lease %d of %s expired; unpinning %d blocks",
                            lease.lease_id, lease.holder, len(lease.keys))
                self._unpin(lease)
            if self.master is not None:
                self.master.expire_nodes()
                if self.store is not None:
                    self.master.heartbeat(self.config.node_id)

    def _serve_one(self, socket: zmq.Socket) -> None:
        frames = socket.recv_multipart(copy=False)
        if len(frames) < 2:
            return
        identity, header, payloads = frames[0].bytes, frames[1].bytes, frames[2:]
        try:
            request = messages.decode_request(header, self.config.max_keys_per_message)
        except messages.MessageError as e:
            self.num_rejected += 1
            logger.warning("store: rejected a malformed request (%s)", e)
            socket.send_multipart([identity, messages.encode_reply(0, error=f"malformed: {e}")])
            return
        handlers = self._master_handlers if socket is self._master_socket else self._data_handlers
        handler = handlers.get(request.type)
        reply_frames: list[Any] = []
        if handler is None:
            reply = messages.encode_reply(request.request_id,
                                          error=f"{request.type} is not served here")
        else:
            try:
                fields, reply_frames = handler(self, identity, request.fields, payloads)
                reply = messages.encode_reply(request.request_id, **fields)
            except (ValueError, KeyError, TimeoutError) as e:
                logger.warning("store: %s failed: %s", request.type, e)
                reply = messages.encode_reply(request.request_id, error=str(e)[:500])
            except Exception as e:  # a bug must not take the whole store down
                logger.exception("store: %s crashed", request.type)
                reply = messages.encode_reply(request.request_id, error=repr(e)[:500])
        socket.send_multipart([identity, reply, *reply_frames], copy=False)
        if self._pending_sends:
            self._finish_ucx_sends()

    # ---- data verbs -------------------------------------------------------------------------
    def _hello(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        if self._ucx is None or f["ucx_address"] is None:
            return {"ucx_address": None, "client_no": 0}, []
        if not is_connectable(f["ucx_address"], self._ucx.tls, self.config.request_timeout_s):
            raise ValueError("hello: not a usable UCX worker address")
        if identity in self._ucx_clients:
            self._ucx.disconnect(self._ucx_clients.pop(identity)[1])
        client_no = self._next_client_no
        self._next_client_no += 1
        self._ucx_clients[identity] = (client_no, self._ucx.connect(f["ucx_address"]))
        return {"ucx_address": self._ucx.address, "client_no": client_no}, []

    def _bye(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        if self._ucx is not None and identity in self._ucx_clients:
            self._ucx.disconnect(self._ucx_clients.pop(identity)[1])
        return {}, []

    def _ucx_client(self, identity: bytes, tag: int) -> int:
        client = self._ucx_clients.get(identity)
        if self._ucx is None or client is None or tag >> 32 != client[0]:
            raise ValueError("ucx_tag without a UCX hello, or not this client's tag")
        return client[1]

    def _put(self, identity: bytes, f: dict, payloads: list) -> tuple[dict, list]:
        keys, sizes = f["keys"], f["sizes"]
        if len(sizes) != len(keys) or any(s > self.config.max_block_bytes for s in sizes):
            raise ValueError("put: one size per key, each at most max_block_bytes")
        assert self.store is not None
        if f["ucx_tag"] is not None:
            self._ucx_client(identity, f["ucx_tag"])
            assert self._ucx is not None
            blocks = [np.empty(size, dtype=np.uint8) for size in sizes]
            requests = [self._ucx.recv(b, f["ucx_tag"] + i) for i, b in enumerate(blocks)]
            self._ucx.wait(requests, self.config.request_timeout_s)
            # Fresh buffers nobody else holds: the store keeps them instead of copying.
            return {"stored": self.store.put_many(keys, blocks, adopt=True)}, []
        if len(payloads) != len(keys) or any(
                len(p.buffer) != s for p, s in zip(payloads, sizes, strict=True)):
            raise ValueError("put: one payload frame of the stated size per key")
        # ZeroMQ owns the frames' memory (read-only): the store copies them.
        return {"stored": self.store.put_many(keys, [p.buffer for p in payloads])}, []

    def _get(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.store is not None
        blocks = self.store.get_many(f["keys"])
        found = [b is not None for b in blocks]
        arrays = [b.numpy() for b in blocks if b is not None]
        fields = {"found": found, "sizes": [b.nbytes if b is not None else 0 for b in blocks]}
        if f["ucx_tag"] is None:
            return fields, arrays
        endpoint = self._ucx_client(identity, f["ucx_tag"])
        assert self._ucx is not None
        # Sent after the reply goes out (the client posts its receives once it knows sizes).
        self._pending_sends = [
            (self._ucx.send(endpoint, a, f["ucx_tag"] + i), a) for i, a in enumerate(arrays)]
        return fields, []

    def _finish_ucx_sends(self) -> None:
        assert self._ucx is not None
        sends, self._pending_sends = self._pending_sends, []
        try:
            self._ucx.wait([r for r, _ in sends], self.config.request_timeout_s)
        except TimeoutError:
            logger.warning("store: a client did not take its UCX get within %.1f s",
                           self.config.request_timeout_s)

    def _exists(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.store is not None
        return {"found": [self.store.exists(k) for k in f["keys"]]}, []

    def _pin(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.store is not None
        pinned = self.store.pin(f["keys"])
        keys = [k for k, ok in zip(f["keys"], pinned, strict=True) if ok]
        lease = self.leases.acquire(f["holder"], keys, f["ttl_s"])
        return {"lease_id": lease.lease_id, "pinned": pinned}, []

    def _renew(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        return {"known": self.leases.renew(f["lease_id"], f["ttl_s"])}, []

    def _release(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        lease = self.leases.release(f["lease_id"])
        if lease is not None:
            self._unpin(lease)
        return {"known": lease is not None}, []

    def _evict(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.store is not None
        return {"num_evicted": self.store.evict(f["keys"])}, []

    def _prefetch(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.store is not None
        return {"num_moved": self.store.prefetch(f["keys"])}, []

    def _stats(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        stats = dict(self.store.stats()) if self.store is not None else {}
        stats.update(num_leases=self.leases.num_leases, num_rejected=self.num_rejected)
        if self.master is not None:
            stats.update(num_nodes=len(self.master.nodes()),
                         num_master_blocks=self.master.num_blocks)
        return {"stats": stats}, []

    def _check(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        try:
            self.check_integrity()
        except AssertionError as e:
            return {"problem": str(e)}, []
        return {"problem": None}, []

    def check_integrity(self) -> None:
        """Store, master and leases agree: every pin is held by exactly one live lease.
        Runs on the server thread for a `check` request; call it directly only when idle."""
        if self.store is not None:
            self.store.check_integrity()
            held, pins = self.leases.num_leased_keys, self.store.num_pins
            if held != pins:
                raise AssertionError(f"{pins} pins but leases hold {held}")
        if self.master is not None:
            self.master.check_integrity()

    def _lookup_prefix(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        if self.master is not None:
            found = self.master.lookup_prefix(f["keys"])
            return {"num_blocks": found.num_blocks,
                    "holders": [[list(h) for h in hs] for hs in found.holders]}, []
        assert self.store is not None
        num_blocks = self.store.lookup_prefix(f["keys"])
        holders = [[[self.config.node_id, self.store.tier_of(k)]] for k in f["keys"][:num_blocks]]
        return {"num_blocks": num_blocks, "holders": holders}, []

    # ---- master verbs -----------------------------------------------------------------------
    def _join(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.master is not None
        self.master.join(f["node_id"], f["address"])
        return {}, []

    def _heartbeat(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.master is not None
        return {"known": self.master.heartbeat(f["node_id"])}, []

    def _leave(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.master is not None
        self.master.leave(f["node_id"])
        return {}, []

    def _update(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.master is not None
        changes = [(key, tier) for key, tier in f["changes"]]
        return {"known": self.master.update(f["node_id"], changes)}, []

    def _nodes(self, identity: bytes, f: dict, _: list) -> tuple[dict, list]:
        assert self.master is not None
        return {"nodes": self.master.nodes()}, []

    _data_handlers = {
        "hello": _hello, "bye": _bye, "put": _put, "get": _get, "exists": _exists,
        "pin": _pin, "renew": _renew, "release": _release, "evict": _evict,
        "prefetch": _prefetch, "stats": _stats, "check": _check, "lookup_prefix": _lookup_prefix,
    }
    _master_handlers = {
        "join": _join, "heartbeat": _heartbeat, "leave": _leave, "update": _update,
        "lookup_prefix": _lookup_prefix, "nodes": _nodes, "stats": _stats, "check": _check,
    }


# ---- CLI ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = StoreConfig()
    add = parser.add_argument
    add("--role", choices=ROLES, default=d.role,
        help="master (metadata), data (DRAM + disk tiers) or all (default %(default)s)")
    add("--host", default=d.host, help="address to bind (default %(default)s)")
    add("--master-port", type=int, default=d.master_port, help="default %(default)s")
    add("--data-port", type=int, default=d.data_port, help="default %(default)s")
    add("--master-address", default=d.master_address,
        help="tcp://host:port of the master a data-only node reports to")
    add("--node-id", default=d.node_id, help="this data node's name (default %(default)s)")
    add("--dram-blocks", dest="dram_capacity_blocks", type=int,
        default=d.dram_capacity_blocks, help="DRAM tier capacity (default %(default)s)")
    add("--disk-blocks", dest="disk_capacity_blocks", type=int,
        default=d.disk_capacity_blocks, help="disk tier capacity; 0 = no disk tier")
    add("--disk-dir", default=d.disk_dir, help="directory of the disk tier")
    add("--transport", choices=TRANSPORTS, default=d.transport,
        help="KV bytes over ucx (falls back to zmq, with a warning) or zmq")
    add("--ucx-tls", default=d.ucx_tls, help="UCX_TLS (default %(default)s)")
    add("--lease-ttl-s", type=float, default=d.lease_ttl_s, help="default %(default)s")
    add("--node-ttl-s", type=float, default=d.node_ttl_s, help="default %(default)s")
    add("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
        help="default %(default)s")
    add("--request-timeout-s", type=float, default=d.request_timeout_s,
        help="default %(default)s")


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    names = {f.name for f in dataclasses.fields(StoreConfig)}
    return StoreConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    server = StoreServer(config_from_args(args)).start()

    def shut_down(signum: int, _frame: object) -> None:
        logger.info("store: signal %d, shutting down", signum)
        server.request_stop()

    signal.signal(signal.SIGINT, shut_down)
    signal.signal(signal.SIGTERM, shut_down)
    try:
        server.wait()  # the serving loop itself: until SIGINT/SIGTERM asks it to stop
    finally:
        server.stop()
    logger.info("store: stopped")
    return 0
