"""`pdserve store`: the master service and/or the data service, behind one ZeroMQ socket loop.

    master socket ──► MasterService (master_service.py): block index, node membership
    data socket   ──► DataService   (data_service.py):   tiered store, leases, UCX clients

Threads. ZeroMQ sockets are not thread-safe, so one thread, the socket loop, owns the ROUTER
sockets and sends every reply. Each request is decoded there into its typed message
(pdserve/protocol/store/), checked against the batch limit (max_keys_per_message) and routed
by its type to the handler of the service owning the socket. Cheap handlers (every master
verb: lookups never wait behind data-plane work; the data service's exists, pin, renew,
release, lookup_prefix, evict, stats, check) run right there. The types a service lists as
`offloaded` (put, get, prefetch, hello, bye: disk reads, big copies, UCX transfers, the UCX
address prober) go to a queue served by `num_data_threads` worker threads:

    clients ──► ROUTER ──► socket loop ──(cheap)──► handler ──► reply ──► ROUTER ──► client
                                │                                            ▲
                                └──(offloaded)──► job queue ──► worker ──► PUSH ─inproc─► PULL
                                                                   │
                                                                   └─► after_reply (UCX sends)

A worker pushes [socket number, client identity, reply, payload frames] through its own inproc
PUSH socket; the loop forwards them to that socket and identity, so every reply reaches the
client that asked. The services guard their own state with small locks (see each). Each loop
turn also ticks the services: leases expire (unpinning their blocks) and silent nodes are
dropped. A data-only node reports placement changes and heartbeats to its master from a
small reporter thread with its own socket; in role `all` the data service reports to the
master service directly. Every wait has a timeout; `stop()` joins the threads within one.

A malformed request (not msgpack, unknown type or field, wrong types or sizes, pickle bytes,
too large a batch) is logged, counted and answered with an ErrorReply; the loop keeps serving.
Nothing received is ever executed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from pdserve import addresses, discovery, lifecycle, security
from pdserve.kvstore.config import ROLES, TRANSPORTS, StoreConfig
from pdserve.kvstore.data_service import DataService
from pdserve.kvstore.lease import LeaseTable
from pdserve.kvstore.master import Master
from pdserve.kvstore.master_reporter import MasterReporter
from pdserve.kvstore.master_service import MasterService
from pdserve.kvstore.service import Answer, Peer, StoreService
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.codec import WireError
from pdserve.protocol.store.base import (
    STORE_PROTOCOL,
    ErrorReply,
    StoreRequest,
    decode_store_message,
)

logger = logging.getLogger(__name__)

_POLL_MS = 50
_MAX_ERROR_CHARS = 500
_SWITCH_INTERVAL_S = 0.001
_server_numbers = itertools.count()  # names each server's inproc reply channel


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


@dataclass(frozen=True)
class _Job:
    """An offloaded request, waiting for a worker thread."""

    socket_no: int
    service: StoreService
    request: StoreRequest
    peer: Peer


class StoreServer:
    """Serves a DataService (role data/all) and a MasterService (role master/all) until
    stopped."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self.master_service: MasterService | None = None
        self.data_service: DataService | None = None
        self.master_address: str | None = None
        self.data_address: str | None = None
        self._sockets: list[zmq.Socket] = []  # a worker names its reply's socket by index
        self._services: dict[zmq.Socket, StoreService] = {}
        # Workers' replies come back to the loop here (each worker has its own PUSH end).
        self._reply_address = f"inproc://store-replies-{next(_server_numbers)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self._reply_address)
        self._reporter: MasterReporter | None = None
        if config.role in ("master", "all"):
            self.master_service = MasterService(Master(config.node_ttl_s,
                                                        replicas=config.replicas))
            self.master_address = self._serve_on(config.master_port, self.master_service)
        if config.role in ("data", "all"):
            self.data_service = DataService(config, on_change=self._on_block_change)
            self.data_address = self._serve_on(config.data_port, self.data_service)

            if self.master_service is not None:
                # with the blocks re-indexed from disk before the master knew this node
                self.master_service.join_local(config.node_id,
                                               addresses.advertised(self.data_address),
                                               self.data_service.placements(),
                                               self.data_service.usage)
                self.data_service.master_address = self.master_address
            elif config.master_address is not None:
                self._reporter = MasterReporter(
                    self._ctx, config.master_address, config.node_id,
                    addresses.advertised(self.data_address), config.heartbeat_interval_s,
                    config.request_timeout_s, self.data_service.placements,
                    usage=self.data_service.usage, read=self.data_service.store.get_many)
        logger.info("store: role=%s master=%s data=%s", config.role, self.master_address,
                    self.data_address)

    def _serve_on(self, port: int, service: StoreService) -> str:
        socket = self._ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        security.secure_server(socket)  # CurveZMQ: only the cluster key gets through
        self._sockets.append(socket)
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
        """Every service's invariants (store, leases, master index); each service checks
        under its own locks, so this may run while the server serves."""
        for service in self._services.values():
            service.check_integrity()

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> StoreServer:
        self._thread = threading.Thread(target=self._serve, name="store-server", daemon=True)
        self._thread.start()
        if self.data_service is not None:
            self._workers = [
                threading.Thread(target=self._work, name=f"store-data-{i}", daemon=True)
                for i in range(self.config.num_data_threads)]
            for worker in self._workers:
                worker.start()
        if self._reporter is not None:
            self._reporter.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and the workers (each finishes the request in hand), then close the
        services; waits at most about `timeout_s` for the threads."""
        self._stop.set()
        deadline_s = time.monotonic() + timeout_s
        for thread in [self._thread, *self._workers]:
            if thread is not None:
                thread.join(timeout=max(0.0, deadline_s - time.monotonic()))
                if thread.is_alive():
                    logger.warning("store: thread %s did not stop within %.1f s", thread.name,
                                   timeout_s)
        if self._reporter is not None:
            self._reporter.stop(timeout_s)
        for service in self._services.values():
            service.close()
        security.release_context(self._ctx)
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

    # ---- socket loop ------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for socket in self._sockets:
            poller.register(socket, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                break
            for socket in ready:
                try:
                    if socket is self._replies:
                        self._forward_reply()
                    else:
                        self._serve_one(socket)
                except Exception:  # never let one request end the server
                    logger.exception("store: request handling failed")
            for service in self._services.values():
                service.tick()

    def _serve_one(self, socket: zmq.Socket) -> None:
        frames = socket.recv_multipart(copy=False)
        if len(frames) < 2:
            return
        service = self._services[socket]
        identity, peer = frames[0].bytes, Peer(frames[0].bytes, frames[2:])
        request = self._decode(service, frames[1].bytes)
        if isinstance(request, Answer):  # refused
            self._send(socket, identity, request)
        elif type(request) in service.offloaded:
            self._jobs.put(_Job(self._sockets.index(socket), service, request, peer))
        else:
            answer = self._handle(service, request, peer)
            self._send(socket, identity, answer)
            _run_after_reply(answer)

    def _forward_reply(self) -> None:
        """A worker's reply: [socket number, client identity, reply, payload frames...]."""
        socket_no, identity, *reply_frames = self._replies.recv_multipart(copy=False)
        self._sockets[socket_no.bytes[0]].send_multipart([identity, *reply_frames], copy=False)

    @staticmethod
    def _send(socket: zmq.Socket, identity: bytes, answer: Answer) -> None:
        socket.send_multipart([identity, STORE_PROTOCOL.encode(answer.reply), *answer.frames],
                              copy=False)

    # ---- worker threads ---------------------------------------------------------------------
    def _work(self) -> None:
        """Serve offloaded requests until stopped; replies go back through the loop."""
        if self.config.data_thread_nice:
            lifecycle.lower_thread_priority(self.config.data_thread_nice)
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        # The loop drains the channel every turn; a full one means the loop is gone.
        push.setsockopt(zmq.SNDTIMEO, int(self.config.request_timeout_s * 1000))
        push.connect(self._reply_address)
        try:
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    continue
                try:
                    self._run_job(push, job)
                except Exception:  # never let one request end a worker
                    logger.exception("store: request handling failed")
        finally:
            push.close(linger=0)

    def _run_job(self, push: zmq.Socket, job: _Job) -> None:
        answer = self._handle(job.service, job.request, job.peer)
        try:
            push.send_multipart([bytes([job.socket_no]), job.peer.identity,
                                 STORE_PROTOCOL.encode(answer.reply), *answer.frames],
                                copy=False)
        except zmq.Again:
            logger.warning("store: dropped a %s reply: the socket loop is not taking replies",
                           type(job.request).TAG)  # type: ignore[attr-defined]
            return
        _run_after_reply(answer)

    # ---- requests ---------------------------------------------------------------------------
    def _decode(self, service: StoreService, header: bytes) -> StoreRequest | Answer:
        """The checked request, or the ErrorReply refusing it (counted as rejected)."""
        try:
            request = decode_store_message(header)
            if not isinstance(request, StoreRequest):
                raise WireError(f"a {type(request).__name__} is not a request")
        except WireError as e:
            return self._reject(service, 0, str(e))
        if _batch_size(request) > self.config.max_keys_per_message:
            return self._reject(service, request.request_id,
                                f"more than {self.config.max_keys_per_message} keys")
        return request

    def _handle(self, service: StoreService, request: StoreRequest, peer: Peer) -> Answer:
        verb = type(request).TAG  # type: ignore[attr-defined]
        handler = service.handlers.get(type(request))
        if handler is None:
            return Answer(ErrorReply(request.request_id,
                                     f"{verb} is not served by the {service.name} service"))
        try:
            return handler(request, peer)
        except (ValueError, KeyError, TimeoutError) as e:
            logger.warning("store: %s failed: %s", verb, e)
            return Answer(ErrorReply(request.request_id, str(e)[:_MAX_ERROR_CHARS]))
        except Exception as e:  # a bug must not take the whole store down
            logger.exception("store: %s crashed", verb)
            return Answer(ErrorReply(request.request_id, repr(e)[:_MAX_ERROR_CHARS]))

    def _reject(self, service: StoreService, request_id: int, why: str) -> Answer:
        service.num_rejected += 1  # only the loop thread counts
        logger.warning("store: %s service rejected a malformed request (%s)", service.name, why)
        return Answer(ErrorReply(request_id, f"malformed: {why}"[:_MAX_ERROR_CHARS]))


def _run_after_reply(answer: Answer) -> None:
    if answer.after_reply is not None:
        try:
            answer.after_reply()
        except Exception:
            logger.exception("store: work after a reply failed")


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
    add("--replicas", type=int, default=d.replicas,
        help="master: data nodes each new block is placed on (default %(default)s)")
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
    add("--data-threads", dest="num_data_threads", type=int, default=d.num_data_threads,
        help="worker threads for put/get/prefetch/hello/bye (default %(default)s)")
    discovery.add_arguments(parser)
    add("--discovery-master-wait-s", type=float, default=30.0,
        help="role data with --discovery and no --master-address: how long to wait for a "
             "master to register (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    names = {f.name for f in dataclasses.fields(StoreConfig)}
    return StoreConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    # A worker thread holding the GIL (copying a block) delays the socket loop's next reply by
    # up to the switch interval; 1 ms instead of 5 keeps lookups quick. The store's own process.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    # The handlers go in before anything binds: a SIGTERM while the store starts (a supervisor
    # stopping a standby, say) stops it cleanly instead of killing it with the default action.
    stop_asked = threading.Event()
    started: list[StoreServer] = []

    def shut_down(signum: int, _frame: object) -> None:
        logger.info("store: signal %d, shutting down", signum)
        stop_asked.set()
        if started:
            started[0].request_stop()

    signal.signal(signal.SIGINT, shut_down)
    signal.signal(signal.SIGTERM, shut_down)
    try:
        config, url = _discover_master(config_from_args(args), args)
    except (ValueError, discovery.DiscoveryError) as exc:
        logger.error("cannot start the store: %s", exc)
        return 2
    if stop_asked.is_set():
        return 0
    server = StoreServer(config).start()
    started.append(server)
    if stop_asked.is_set():  # asked while it started: the loop stops at its first turn
        server.request_stop()
    try:
        registrations = [] if url is None else _register(server, url, args.discovery_ttl_s)
    except discovery.DiscoveryError as exc:
        logger.error("cannot register the store: %s", exc)
        server.stop()
        return 2
    lifecycle.freeze_startup_heap("store")
    try:
        server.wait()  # the serving loop itself: until SIGINT/SIGTERM asks it to stop
    finally:
        for registration in registrations:
            registration.withdraw()
        server.stop()
    logger.info("store: stopped")
    return 0


def _discover_master(config: StoreConfig, args: argparse.Namespace
                     ) -> tuple[StoreConfig, discovery.DiscoveryURL | None]:
    """With --discovery: the registry's URL, and for a data-only node without
    --master-address the master registered there (DiscoveryError when none in time)."""
    if args.discovery is None:
        return config, None
    url = discovery.DiscoveryURL.parse(args.discovery)
    discovery.check_ttl(args.discovery_ttl_s)
    if config.role == "data" and config.master_address is None:
        masters = discovery.find(url, "store-master", args.discovery_master_wait_s)
        if not masters:
            raise discovery.DiscoveryError(
                f"no store master registered in {url} within "
                f"{args.discovery_master_wait_s:.0f}s: start `pdserve store --role master "
                f"--discovery {args.discovery}`")
        config = dataclasses.replace(config, master_address=masters[0].address)
    return config, url


def _register(server: StoreServer, url: discovery.DiscoveryURL, ttl_s: float
              ) -> list[discovery.Registration]:
    """The store's records (pdserve/discovery.py): its master and its data node, whichever it
    runs, each under its own lease."""
    config, records = server.config, []
    master = server.master_address or config.master_address
    if server.master_address is not None:
        records.append(discovery.Record("store-master",
                                        addresses.reachable(server.master_address),
                                        name="store-master"))
    if server.data_address is not None:
        records.append(discovery.Record(
            "store-data", addresses.reachable(server.data_address), name=config.node_id,
            capacity={"dram_blocks": config.dram_capacity_blocks,
                      "disk_blocks": config.disk_capacity_blocks},
            addresses={"master": addresses.reachable(master)} if master else {}))
    registrations: list[discovery.Registration] = []
    try:
        for record in records:
            registrations.append(discovery.Registration(url, record, ttl_s).start())
    except discovery.DiscoveryError:
        for registration in registrations:
            registration.withdraw()
        raise
    return registrations
