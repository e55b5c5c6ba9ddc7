"""`pdserve prefill | decode | colocated`: one engine behind a ZeroMQ ROUTER socket.

    router (DEALER) ──GenerateRequest/AbortRequest/StatusRequest/SetRole──► worker (ROUTER)
                    ◄─────────────────────── Output deltas / WorkerStatus ──

One thread runs everything: it drains the socket (without blocking while the engine has
work), lets the hand-off component finish KV transfers, runs one engine step, and sends each
request's delta to the router that owns it. The engine is never touched from two threads.
What the role changes (a request's two ends, the KV that crosses between prefill and decode)
lives in the hand-off component (pdserve/serve/worker/gateway.py); a drained prefill or decode
worker flips to the other role on SetRole (the router's goodput controller moves capacity between
the phases); a colocated worker never does.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import zmq

from pdserve import addresses, discovery, envs, lifecycle, security
from pdserve.handoff.registry import AUTO, TRANSPORTS, WIRES
from pdserve.protocol.codec import WireError
from pdserve.protocol.worker import (
    WORKER_PROTOCOL,
    AbortRequest,
    FollowPrefill,
    GenerateRequest,
    Output,
    SetRole,
    StatusRequest,
    WorkerStatus,
)
from pdserve.serve.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SimConfig,
    SpeculativeConfig,
)
from pdserve.serve.cpu.core_share import CoreBorrower, IdleFlag, Lender
from pdserve.serve.engine.roles import ROLE_NAMES
from pdserve.serve.layers.distributed import RendezvousError
from pdserve.serve.worker.args import (  # noqa: F401 (the flags; tests import them here)
    add_arguments,
    engine_configs_from_args,
    parallel_config_from_args,
    sim_config_from_args,
)
from pdserve.serve.worker.follow import StagingAnnouncer
from pdserve.serve.worker.gateway import RequestGateway
from pdserve.serve.worker.kv_transfer import KVTransfer, make_kv_transfer
from pdserve.serve.worker.status import _cpu_path, _kv_tiers, _mean_seconds, _moe_load, _sim

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100
"""The longest an idle worker's loop sleeps: a message, a finished transfer or a held
answer's deadline wakes it sooner; only a stop asked by another thread waits for it (a fleet
of dozens of idle workers on a host spent a core on a 20 ms tick)."""
FOLLOW_POLL_MS = 1  # idle but following a prefill's layers (pdserve/serve/worker/follow.py)
NUM_STEP_SAMPLES_PER_STATUS = 64  # 128 steps/s between two 0.5 s status polls
NUM_STEP_TIMES_AVERAGED = 32


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process: its role, its socket, its store, and its engine's configs."""

    role: str
    """colocated | prefill | decode."""
    model: ModelConfig
    port: int
    """ZeroMQ port the router connects to."""
    host: str = "127.0.0.1"
    """Address to bind."""
    worker_id: str | None = None
    """Name in status and metrics; None: '<role>-<port>'."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store_address: str | None = None
    """KV store data server (prefill saves, decode loads); None: decode recomputes prompts."""
    store_master_address: str | None = None
    """KV store master (metadata service)."""
    store_timeout_s: float = 10.0
    """Longest wait on the store; past it a transfer is a miss."""
    kv_lease_ttl_s: float = 30.0
    """Prefill pins a hand-off's blocks in the store this long at most (the decode worker
    releases them once loaded)."""
    handoff_dram_gb: float = 1.0
    """Host DRAM of this worker's own hand-off node (prefill saves there, decode workers
    read from it directly); 0: hand off through the fleet store instead."""
    kv_handoff: str = "auto"
    """The hand-off transport by name (pdserve/handoff/registry.py TRANSPORTS); auto: "node"
    with handoff_dram_gb > 0, else "store"."""
    handoff_shm: bool = field(default_factory=envs.handoff_shm_default)
    """Same host: stage prompts in the node's shared memory segment, and read other nodes'
    segments (default on; the deprecated PDSERVE_HANDOFF_SHM sets the default)."""
    handoff_follow: bool = field(default_factory=envs.handoff_follow_default)
    """A prefill announces its stagings and a decode worker copies each layer as it lands
    (default on; the deprecated PDSERVE_HANDOFF_FOLLOW sets the default)."""
    handoff_wire: str = WIRES[0]
    """How this worker's hand-off node sends offers: raw (the pool's bytes), or fp8 (1 byte a
    value and per-block scales, for slow links; pdserve/handoff/wire_fp8.py). fp8 turns
    following off. Any decode worker reads either."""
    save_answers: bool = True
    """Decode: a finished request's answer blocks go through to the fleet store, for the
    prefill of the conversation's next turn (KVTransfer.save_answer)."""
    discovery_ttl_s: float = discovery.DEFAULT_TTL_S  # (before the field that hides the module)
    """The registration's lease TTL: a killed worker leaves the registry this long after."""
    discovery: str | None = None
    """etcd://HOST:PORT[/CLUSTER]: register there (pdserve/discovery.py), find the store
    there when store_address is None, and drain on SIGTERM (withdraw, finish, exit)."""
    discovery_store_wait_s: float = 30.0
    """With discovery and no store_address: how long to wait for a store data node to
    register (past it the worker exits with an error); 0: take one if registered, else run
    without the store."""
    drain_timeout_s: float = 60.0
    """With discovery, SIGTERM: the longest wait for the requests held to finish."""
    lend_idle_flag: str | None = None
    """Publish in this file whether the worker holds no request, so that a worker of the
    other role on the same host borrows its cores meanwhile (pdserve/serve/cpu/core_share.py)."""
    borrow_idle_cores: tuple[Lender, ...] = ()
    """One rank: also run on each lender's cores while that lender is idle."""
    speculative: SpeculativeConfig | None = None
    """MTP speculative decoding (pdserve/serve/engine/spec_decode.py); None: off. A prefill worker
    loads the drafter but never drafts (its requests end at their first token)."""
    sim: SimConfig | None = None
    """--engine sim: a simulated forward (pdserve/serve/executor/sim_runner.py); None: the
    model's."""

    def __post_init__(self) -> None:
        if self.role not in ROLE_NAMES:
            raise ValueError(f"role must be one of {ROLE_NAMES}, got {self.role!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.store_timeout_s <= 0 or self.kv_lease_ttl_s <= 0:
            raise ValueError("store_timeout_s and kv_lease_ttl_s must be positive")
        if self.handoff_dram_gb < 0:
            raise ValueError(f"handoff_dram_gb must be >= 0, got {self.handoff_dram_gb}")
        if self.handoff_wire not in WIRES:
            raise ValueError(f"unknown hand-off wire {self.handoff_wire!r}; known: "
                             f"{list(WIRES)}")
        if self.kv_handoff != AUTO and self.kv_handoff not in TRANSPORTS:
            raise ValueError(f"unknown hand-off transport {self.kv_handoff!r}; known: "
                             f"{[AUTO, *sorted(TRANSPORTS)]}")
        if self.discovery is not None:
            discovery.DiscoveryURL.parse(self.discovery)
            discovery.check_ttl(self.discovery_ttl_s)
        if self.discovery_store_wait_s < 0 or self.drain_timeout_s <= 0:
            raise ValueError("discovery_store_wait_s must be >= 0 and drain_timeout_s > 0")
        if (self.lend_idle_flag is not None or self.borrow_idle_cores) \
                and self.role not in ("prefill", "decode"):
            raise ValueError("only prefill and decode workers lend and borrow cores "
                             "(--lend-idle-flag, --borrow-idle-cores)")
        if self.sim is not None and (self.borrow_idle_cores or self.speculative is not None):
            raise ValueError("the simulated engine borrows no cores and drafts nothing "
                             "(--borrow-idle-cores, --speculative-config)")
        if self.borrow_idle_cores and self.parallel.world_size > 1:
            raise ValueError("only a one-rank worker borrows cores (--borrow-idle-cores): "
                             "its threads are all in one process")

    @property
    def name(self) -> str:
        return self.worker_id or f"{self.role}-{self.port}"


class Worker:
    """One engine behind a ZeroMQ ROUTER socket (`pdserve prefill|decode|colocated`): takes
    GenerateRequests from routers, steps the engine, streams each Output back to the router
    that sent the request, answers status and role flips, and drains on SIGTERM. What a
    request does at its start and end (hand-off, admission) is its RequestGateway's."""

    def __init__(self, engine, role: str, address: str, worker_id: str,
                 open_kv_transfer: Callable[[StagingAnnouncer], KVTransfer | None] | None = None,
                 idle_flag: IdleFlag | None = None,
                 borrower: CoreBorrower | None = None) -> None:
        """open_kv_transfer: makes the worker's KV transfer (None: none), given what its
        connector calls as a prefill's save starts staging (kv_transfer.py make_kv_transfer);
        idle_flag: the worker publishes there whether it holds a request; borrower: it
        takes the idle lenders' cores before each step, and a prefill before each layer too
        (pdserve/serve/cpu/core_share.py)."""
        self.engine = engine
        self.idle_flag = idle_flag
        self.borrower = borrower
        if borrower is not None:
            engine.runner.call_before_each_layer(self.borrow_cores)
        self.worker_id = worker_id
        announcer = StagingAnnouncer(engine, self._send)
        kv_transfer = open_kv_transfer(announcer) if open_kv_transfer is not None else None
        self.gateway = RequestGateway(engine, role, worker_id, kv_transfer, announcer)
        self._context = zmq.Context()
        for core in envs.io_cores():  # set before the first socket starts the I/O thread
            self._context.set(zmq.THREAD_AFFINITY_CPU_ADD, core)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted router takes over
        security.secure_server(self._socket)  # CurveZMQ: only the cluster key gets through
        self._socket.bind(address)
        self._owners: dict[str, bytes] = {}  # request id -> the router that sent it
        # request id -> the choices (Output.index) that have not ended yet (n > 1: several)
        self._open_choices: dict[str, set[int]] = {}
        self.stop_event = threading.Event()
        self.is_draining = False
        """Leaving: its status says not ready, so routers send it nothing new."""
        self.on_role_change: Callable[[str], None] | None = None
        """Told the new role after a flip (the registration follows it)."""

    @property
    def role(self) -> str:
        return self.gateway.role

    @property
    def is_idle(self) -> bool:
        """Holds no request: none owned, none in the engine, none held for a save, loading,
        or leased or staged on its hand-off node for a decode worker to read."""
        kv_transfer = self.gateway.kv_transfer
        totals = kv_transfer.totals() if kv_transfer else {}
        return (not self._owners and not self.engine.has_unfinished_requests()
                and not self.gateway.is_busy and not totals.get("num_handoff_leases", 0)
                and not totals.get("num_live_stagings", 0))

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        if self.gateway.wakeup_fd is not None:  # a finished transfer ends the wait too
            poller.register(self.gateway.wakeup_fd, zmq.POLLIN)
        while not self.stop_event.is_set():
            busy = self.engine.has_unfinished_requests() or self.gateway.must_poll
            self._share_cores()
            idle_ms = FOLLOW_POLL_MS if self.gateway.is_following else IDLE_POLL_MS
            deadline_s = self.gateway.next_deadline_s()
            if deadline_s is not None:
                idle_ms = max(0, min(idle_ms, math.ceil(1000 * (deadline_s - time.monotonic()))))
            if poller.poll(0 if busy else idle_ms):
                self._drain()
                self._share_cores()
            for output in self.gateway.poll():
                self._send(output)
            if self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    output = self.gateway.to_wire(delta)
                    if output is not None:
                        self._send(output)
            else:  # idle: a step switches itself (pdserve/serve/executor/cpu_preparation.py)
                getattr(self.engine.runner, "switch_cpu_path_if_ready", bool)()

    def _share_cores(self) -> None:
        """A lender says whether it holds a request; a borrower takes the cores of the idle
        lenders and gives back those of the busy ones (a prefill also before each layer)."""
        lending = self.idle_flag is not None and not self._owners
        if self.idle_flag is not None:
            self.idle_flag.set_idle(lending)
        self.gateway.copy_early = not lending  # a decode worker's (pdserve/serve/worker/follow.py)
        if self.borrower is not None:
            self.borrow_cores()

    def borrow_cores(self) -> None:
        """The cores of the lenders that hold no request, and only those."""
        self.borrower.update()
        self.gateway.borrowing_cores = self.borrower.is_borrowing

    def close(self) -> None:
        if self.borrower is not None:
            self.borrower.close()
        if self.idle_flag is not None:
            self.idle_flag.close()
        self.engine.shutdown()
        self._socket.close(linger=0)
        security.release_context(self._context)
        self._context.term()

    # ---- messages in -------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                identity, raw = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not exactly [identity, payload]
                logger.warning("dropped a message with unexpected framing")
                continue
            try:
                message = WORKER_PROTOCOL.decode(raw)
            except WireError as exc:
                logger.warning("dropped a malformed message: %s", exc)
                continue
            if isinstance(message, GenerateRequest):
                self._on_generate(identity, message)
            elif isinstance(message, FollowPrefill):
                try:
                    self.gateway.follow(message)
                except Exception as exc:  # only an optimisation: the hand-off still comes
                    logger.warning("could not follow %s: %s", message.request_id, exc)
            elif isinstance(message, AbortRequest):
                self._owners.pop(message.request_id, None)
                self._open_choices.pop(message.request_id, None)
                self.gateway.abort(message.request_id)
            elif isinstance(message, StatusRequest):
                self._reply(identity, self.status())
            elif isinstance(message, SetRole):
                self._on_set_role(message.role)
                self._reply(identity, self.status())
            else:
                logger.warning("unexpected %s", type(message).__name__)

    def _on_generate(self, identity: bytes, message: GenerateRequest) -> None:
        request_id = message.request_id
        if request_id in self._owners:
            self._reply(identity, Output(request_id, [], "", "error",
                                         error=f"request id {request_id} is already running"))
            return
        try:
            self.gateway.add(message)
        except Exception as exc:  # any rejection is this request's error, not the worker's
            logger.info("rejected %s: %s", request_id, exc)
            self._reply(identity, Output(request_id, [], "", "error", error=str(exc)))
            return
        self._owners[request_id] = identity
        self._open_choices[request_id] = set(message.choice_indices)

    def _on_set_role(self, role: str) -> None:
        if role == self.role:
            return
        if self._owners or not self.gateway.can_switch_role():
            logger.warning("refused to switch from %s to %s (a colocated worker never "
                           "switches; others only when drained): %d requests, %s",
                           self.role, role, len(self._owners),
                           self.gateway.describe_in_flight())
            return
        self.gateway.switch_role(role)
        logger.info("%s is now a %s worker", self.worker_id, role)
        if self.on_role_change is not None:
            self.on_role_change(role)

    # ---- messages out ------------------------------------------------------------------
    def _send(self, output: Output) -> None:
        """Send a delta to the router that owns the request; a finished request (each of
        its choices ended: any finish_reason, a hand-off included; or an error) is
        forgotten here."""
        identity = self._owners.get(output.request_id)
        if identity is None:
            return  # aborted meanwhile
        self._reply(identity, output)
        if output.finish_reason is None:
            return
        open_choices = self._open_choices.get(output.request_id, set())
        open_choices.discard(output.index)
        if not open_choices or output.finish_reason == "error":
            self._owners.pop(output.request_id, None)
            self._open_choices.pop(output.request_id, None)

    def _reply(self, identity: bytes, message) -> None:
        try:
            self._socket.send_multipart([identity, WORKER_PROTOCOL.encode(message)],
                                        zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("router %r is not reading; dropped a %s", identity,
                           type(message).__name__)

    def status(self) -> WorkerStatus:
        engine, role = self.engine, self.role
        stats = engine.stats()
        samples = list(engine.step_samples)
        recent = samples[-NUM_STEP_TIMES_AVERAGED:]
        block_size = engine.block_manager.block_size
        kv_transfer = self.gateway.kv_transfer
        return WorkerStatus(
            worker_id=self.worker_id, role=role, model=engine.spec.model_id,
            max_model_len=engine.max_model_len, is_ready=not self.is_draining,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + self.gateway.num_loading,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_blocks,
            block_size=block_size, kv_layout=asdict(engine.spec.kv_layout(block_size)),
            prefill_step_s=_mean_seconds([s for s in recent if s.num_prefill_tokens]),
            decode_step_s=_mean_seconds([s for s in recent if not s.num_prefill_tokens]),
            num_prefix_queried_tokens=stats.num_prefix_queried_tokens,
            num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
            num_preemptions=stats.num_preemptions,
            kv_transfer=kv_transfer.totals() if kv_transfer is not None else {},
            spec_decode=(engine.speculator.stats.as_dict() if engine.speculator is not None
                         else {}),
            step_samples=samples[-NUM_STEP_SAMPLES_PER_STATUS:],
            max_num_seqs=engine.scheduler_config.max_num_seqs,
            max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
            tensor_parallel_size=engine.runner.tensor_parallel_size,
            num_cached_blocks=stats.num_cached_blocks,
            max_num_used_blocks=engine.block_manager.max_num_used_blocks,
            is_idle=self.is_idle,
            cpu_path=_cpu_path(engine), sim=_sim(engine),
            kv_tiers=_kv_tiers(engine, kv_transfer),
            **_moe_load(engine),
        )


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    if args.port is None:
        raise ValueError("--port is required (the router connects to it)")
    model, cache, parallel, scheduler = engine_configs_from_args(args)
    sim = sim_config_from_args(args)
    handoff_dram_gb = args.handoff_dram_gb
    if sim is not None:  # the tiers hold as many of the smaller blocks as they would
        cache = dataclasses.replace(
            cache, kv_offload_bytes=int(cache.kv_offload_bytes * sim.kv_fraction))
        handoff_dram_gb *= sim.kv_fraction
    return WorkerConfig(
        role=args.command, host=args.host, port=args.port, worker_id=args.worker_id,
        model=model, cache=cache, parallel=parallel, scheduler=scheduler,
        store_address=args.store, store_master_address=args.store_master,
        store_timeout_s=args.store_timeout_s, kv_lease_ttl_s=args.kv_lease_ttl_s,
        handoff_dram_gb=handoff_dram_gb, kv_handoff=args.kv_handoff,
        handoff_shm=args.handoff_shm, handoff_follow=args.handoff_follow,
        handoff_wire=args.handoff_wire, save_answers=args.save_answers, discovery=args.discovery,
        discovery_ttl_s=args.discovery_ttl_s,
        discovery_store_wait_s=args.discovery_store_wait_s,
        drain_timeout_s=args.drain_timeout_s,
        lend_idle_flag=args.lend_idle_flag, borrow_idle_cores=tuple(args.borrow_idle_cores),
        speculative=SpeculativeConfig.parse(args.speculative_config), sim=sim)


def run_node(args: argparse.Namespace) -> int:
    """--node-rank k > 0: run this node's ranks of the worker (no engine, no socket) until
    node 0 stops them or a signal comes."""
    from pdserve.serve.executor.model_runner import serve_node

    stop = threading.Event()  # (before anything starts: see run)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        model, cache, parallel, scheduler = engine_configs_from_args(args)
    except ValueError as exc:
        logger.error("cannot start node %d of the %s worker: %s", args.node_rank,
                     args.command, exc)
        return 2
    if stop.is_set():
        return 0
    return serve_node(model, cache, parallel, scheduler, stop)


def discover_store(config: WorkerConfig) -> WorkerConfig:
    """With discovery and no store address: the store's data node (one on this host first)
    and master from the registry. Raises DiscoveryError when none registers in time."""
    if config.discovery is None or config.store_address is not None \
            or config.role == "colocated":  # a colocated worker never uses the store
        return config
    url = discovery.DiscoveryURL.parse(config.discovery)
    wait_s = config.discovery_store_wait_s
    nodes = discovery.find(url, "store-data", wait_s)
    if not nodes:
        if wait_s > 0:
            raise discovery.DiscoveryError(
                f"no KV store data node registered in {url} within {wait_s:.0f}s: start "
                f"`pdserve store --discovery {config.discovery}`, or pass "
                "--discovery-store-wait-s 0 to run without the store")
        logger.warning("no KV store registered in %s: running without it", url)
        return config
    host = addresses.advertised_host(config.host)
    node = next((n for n in nodes if n.record_id.startswith(f"{host}:")), nodes[0])
    master = config.store_master_address
    if master is None:
        masters = discovery.find(url, "store-master", wait_s)
        master = masters[0].address if masters else None
    logger.info("store from the registry: data node %s, master %s", node.address, master)
    return dataclasses.replace(config, store_address=node.address, store_master_address=master)


def worker_record(config: WorkerConfig, worker: Worker) -> discovery.Record:
    """What this worker tells the fleet: its role, address, model, KV layout, TP degree and
    capacity (what a router otherwise learns from its first WorkerStatus)."""
    engine = worker.engine
    block_size = engine.block_manager.block_size
    return discovery.Record(
        role=worker.role, address=addresses.reachable(f"tcp://{config.host}:{config.port}"),
        name=config.name, model=engine.spec.model_id,
        kv_layout=asdict(engine.spec.kv_layout(block_size)),
        tensor_parallel_size=engine.runner.tensor_parallel_size,
        capacity={"num_kv_blocks": engine.stats().num_blocks, "block_size": block_size,
                  "max_num_seqs": engine.scheduler_config.max_num_seqs,
                  "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
                  "max_model_len": engine.max_model_len})


DRAIN_QUIET_S = 1.0
"""A draining worker exits once idle this long: a request a router sent before it saw the
withdrawal has arrived by then."""


def drain_then_stop(worker: Worker, registration: discovery.Registration | None,
                    timeout_s: float) -> None:
    """Leave gracefully: withdraw from the registry (routers stop sending), report not ready,
    finish what is held (at most `timeout_s`), then stop the serving loop."""
    worker.is_draining = True
    if registration is not None:
        registration.withdraw()
    deadline = time.monotonic() + timeout_s
    idle_since = None
    while time.monotonic() < deadline:
        if not worker.is_idle:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= DRAIN_QUIET_S:
            break
        time.sleep(0.05)
    else:
        logger.warning("requests still held after %.0fs of draining: stopping anyway",
                       timeout_s)
    logger.info("%s drained", worker.worker_id)
    worker.stop_event.set()


def run(args: argparse.Namespace) -> int:
    from pdserve.serve.engine.engine import Engine
    from pdserve.tokenizer import load_tokenizer

    if args.node_rank > 0:
        return run_node(args)
    # The handlers go in before anything binds (the engine's ranks, the worker's socket, its
    # registration): a SIGTERM while the worker starts (a supervisor stopping it, a rolling
    # restart) stops it cleanly once the start step under way (loading the engine, say) is
    # done, instead of killing it with the default action. Once it serves, a signal drains it
    # (stop_serving).
    stop_asked = threading.Event()
    serving: list[Callable[[], None]] = []  # stop_serving, once there is a worker to stop

    def on_stop_signal(signum: int, _frame: object) -> None:
        logger.info("%s worker: signal %d, shutting down", args.command, signum)
        stop_asked.set()
        if serving:
            serving[0]()

    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(signal.SIGINT, on_stop_signal)
    borrower = None
    try:
        config = discover_store(config_from_args(args))
        if config.borrow_idle_cores:  # before the engine starts threads (see CoreBorrower)
            borrower = CoreBorrower(config.borrow_idle_cores,
                                    main_on_lent=config.role == "decode")
        tokenizer = load_tokenizer(config.model.model)
        runner = None
        if config.sim is not None:
            from pdserve.serve.executor.sim_runner import SimRunner

            runner = SimRunner(config.model, config.cache, config.parallel, config.sim)
        engine = Engine(config.model, config.cache, config.parallel, config.scheduler,
                        tokenizer=tokenizer, runner=runner,
                        speculative_config=config.speculative)
    except (ValueError, FileNotFoundError, OSError, discovery.DiscoveryError,
            RendezvousError) as exc:
        logger.error("cannot start the %s worker: %s", args.command, exc)
        return 2
    if stop_asked.is_set():  # asked while the engine started: bind nothing
        engine.shutdown()
        if borrower is not None:
            borrower.close()
        logger.info("%s worker stopped before serving", config.role)
        return 0
    worker = Worker(engine, config.role, f"tcp://{config.host}:{config.port}", config.name,
                    lambda announcer: make_kv_transfer(config, engine, announcer),
                    IdleFlag(config.lend_idle_flag, create=True) if config.lend_idle_flag
                    else None, borrower)
    kv_transfer = worker.gateway.kv_transfer
    registration = None
    if config.discovery is not None and not stop_asked.is_set():
        try:
            registration = discovery.Registration(
                discovery.DiscoveryURL.parse(config.discovery), worker_record(config, worker),
                config.discovery_ttl_s).start()
        except discovery.DiscoveryError as exc:
            logger.error("cannot register the %s worker: %s", args.command, exc)
            worker.close()
            if kv_transfer is not None:
                kv_transfer.close()
            return 2
        else:
            # off the serving thread: the update waits on etcd (bounded by its timeout)
            worker.on_role_change = lambda role: threading.Thread(
                target=registration.update, args=(worker_record(config, worker),),
                name="discovery-update", daemon=True).start()

    def stop_serving() -> None:
        if registration is None or worker.is_draining:  # no fleet to leave, or asked twice
            worker.stop_event.set()
            return
        threading.Thread(target=drain_then_stop, name="drain", daemon=True,
                         args=(worker, registration, config.drain_timeout_s)).start()

    serving.append(stop_serving)
    if stop_asked.is_set():  # asked while it bound or registered: the loop stops at once
        worker.stop_event.set()
    logger.info("%s worker %s ready on tcp://%s:%d", config.role, config.name, config.host,
                config.port)
    lifecycle.freeze_startup_heap(f"{config.role} worker")
    try:
        worker.serve_forever()
    except RuntimeError as exc:  # the engine's ranks failed: a lost rank (and node) is named
        logger.debug("the engine failed", exc_info=True)
        logger.error("the %s worker stops: %s", config.role, exc)
        return 1
    finally:
        if registration is not None:
            registration.withdraw()
        worker.close()
        if kv_transfer is not None:
            kv_transfer.close()
    return 0
