"""`pdserve store`: the master service and/or the data service, behind one ZeroMQ socket loop.

    master socket ──► MasterService (master_service.py): block index, node membership
    data socket   ──► DataService   (data_service.py):   tiered store, leases, UCX clients

One thread owns every socket (ZeroMQ sockets are not thread-safe) and serves requests one at a
time, so the services need no extra locking. Each request is decoded into its typed message
(pdserve/protocol/store.py), checked against the batch limit (max_keys_per_message), routed by
its type to the handler of the service owning the socket, and answered with the typed reply
the handler returns. Each loop turn also ticks the services: leases expire (unpinning their
blocks) and silent nodes are dropped. A data-only node reports placement changes and
heartbeats to its master from a small reporter thread with its own socket; in role `all` the
data service reports to the master service directly.

A malformed request (not msgpack, unknown type or field, wrong types or sizes, pickle bytes,
too large a batch) is logged, counted and answered with an ErrorReply; the loop keeps serving.
Nothing received is ever executed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading

import zmq

from pdserve.kvstore.config import ROLES, TRANSPORTS, StoreConfig
from pdserve.kvstore.data_service import DataService
from pdserve.kvstore.lease import LeaseTable
from pdserve.kvstore.master import Master
from pdserve.kvstore.master_reporter import MasterReporter
from pdserve.kvstore.master_service import MasterService
from pdserve.kvstore.service import Answer, Peer, StoreService
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.codec import WireError
from pdserve.protocol.store import (
    STORE_PROTOCOL,
    ErrorReply,
    StoreRequest,
    decode_store_message,
)

logger = logging.getLogger(__name__)

_POLL_MS = 50
_MAX_ERROR_CHARS = 500


def _bind(socket: zmq.Socket, host: str, port: int) -> str:
    if port == 0:
        port = socket.bind_to_random_port(f"tcp://{host}")
    else:
        socket.bind(f"tcp://{host}:{port}")
    return f"tcp://{host}:{port}"


def _batch_size(request: StoreRequest) -> int:
    """The longest list a request carries (its keys, sizes or changes)."""
    lengths = (len(value) for field in dataclasses.fields(request)
               if isinstance(value := getattr(request, field.name), list))
    return max(lengths, default=0)


class StoreServer:
    """Serves a DataService (role data/all) and a MasterService (role master/all) until
    stopped."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.master_service: MasterService | None = None
        self.data_service: DataService | None = None
        self.master_address: str | None = None
        self.data_address: str | None = None
        self._services: dict[zmq.Socket, StoreService] = {}
        self._reporter: MasterReporter | None = None
        if config.role in ("master", "all"):
            self.master_service = MasterService(Master(config.node_ttl_s))
            self.master_address = self._serve_on(config.master_port, self.master_service)
        if config.role in ("data", "all"):
            self.data_service = DataService(config, on_change=self._on_block_change)
            self.data_address = self._serve_on(config.data_port, self.data_service)
            if self.master_service is not None:
                # with the blocks re-indexed from disk before the master knew this node
                self.master_service.join_local(config.node_id, self.data_address,
                                               self.data_service.placements())
            elif config.master_address is not None:
                self._reporter = MasterReporter(
                    self._ctx, config.master_address, config.node_id, self.data_address,
                    config.heartbeat_interval_s, config.request_timeout_s,
                    self.data_service.placements)
        logger.info("store: role=%s master=%s data=%s", config.role, self.master_address,
                    self.data_address)

    def _serve_on(self, port: int, service: StoreService) -> str:
        socket = self._ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        self._services[socket] = service
        return _bind(socket, self.config.host, port)

    # ---- what tests and tools look at -------------------------------------------------------
    @property
    def master(self) -> Master | None:
        return None if self.master_service is None else self.master_service.master

    @property
    def store(self) -> TieredStore | None:
        return None if self.data_service is None else self.data_service.store

    @property
    def leases(self) -> LeaseTable | None:
        return None if self.data_service is None else self.data_service.leases

    @property
    def num_rejected(self) -> int:
        """Malformed requests refused, over both sockets."""
        return sum(service.num_rejected for service in self._services.values())

    def check_integrity(self) -> None:
        """Every service's invariants (store, leases, master index). Runs on the server
        thread for a `check` request; call it directly only when the server is idle."""
        for service in self._services.values():
            service.check_integrity()

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
        for service in self._services.values():
            service.close()
        self._ctx.destroy(linger=0)

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler); `stop()` then cleans up."""
        self._stop.set()

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def _on_block_change(self, key: bytes, tier: str | None) -> None:
        if self.master_service is not None:
            self.master_service.record_local(key, tier)
        elif self._reporter is not None:
            self._reporter.record(key, tier)

    # ---- loop -------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for socket in self._services:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                break
            for socket in ready:
                try:
                    self._serve_one(socket, self._services[socket])
                except Exception:  # never let one request end the server
                    logger.exception("store: request handling failed")
            for service in self._services.values():
                service.tick()

    def _serve_one(self, socket: zmq.Socket, service: StoreService) -> None:
        frames = socket.recv_multipart(copy=False)
        if len(frames) < 2:
            return
        identity, header = frames[0].bytes, frames[1].bytes
        reply, reply_frames = self._answer(service, header, Peer(identity, frames[2:]))
        socket.send_multipart([identity, STORE_PROTOCOL.encode(reply), *reply_frames],
                              copy=False)
        service.after_reply()

    def _answer(self, service: StoreService, header: bytes, peer: Peer) -> Answer:
        try:
            request = decode_store_message(header)
            if not isinstance(request, StoreRequest):
                raise WireError(f"a {type(request).__name__} is not a request")
        except WireError as e:
            return self._reject(service, 0, str(e))
        if _batch_size(request) > self.config.max_keys_per_message:
            return self._reject(service, request.request_id,
                                f"more than {self.config.max_keys_per_message} keys")
        verb = type(request).TAG  # type: ignore[attr-defined]
        handler = service.handlers.get(type(request))
        if handler is None:
            return ErrorReply(request.request_id,
                              f"{verb} is not served by the {service.name} service"), []
        try:
            return handler(request, peer)
        except (ValueError, KeyError, TimeoutError) as e:
            logger.warning("store: %s failed: %s", verb, e)
            return ErrorReply(request.request_id, str(e)[:_MAX_ERROR_CHARS]), []
        except Exception as e:  # a bug must not take the whole store down
            logger.exception("store: %s crashed", verb)
            return ErrorReply(request.request_id, repr(e)[:_MAX_ERROR_CHARS]), []

    def _reject(self, service: StoreService, request_id: int, why: str) -> Answer:
        service.num_rejected += 1
        logger.warning("store: %s service rejected a malformed request (%s)", service.name, why)
        return ErrorReply(request_id, f"malformed: {why}"[:_MAX_ERROR_CHARS]), []


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
