"""`pdserve health ROLE ADDRESS`: is the role at ADDRESS up and ready? For probes and scripts.

    worker  tcp://HOST:PORT   StatusRequest over the router <-> worker protocol (CurveZMQ under
                              the cluster key, as the router asks it); ready when the reply says
                              is_ready (any role: a worker the controller flipped is still
                              healthy)
    store   tcp://HOST:PORT   the store's stats verb, on its master or its data port
    router  http://HOST:PORT  GET /health: 200 once the router has the workers it needs

Exit 0 with one line on stdout when ready; 1 with one line on stderr saying why not (no
answer within --timeout-s, connection refused, a handshake the cluster key did not pass, a
503); 2 for a usage error (a malformed address, no cluster key). Kubernetes runs it as the
exec readiness/liveness probe of workers and store nodes (deploy/); the router's probe is a
plain HTTP GET of /health. It imports neither torch nor any model code, so a probe costs a
Python start and one round trip.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import re
import sys
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve import security

ROLES = ("worker", "store", "router")
_ZMQ_ADDRESS = re.compile(r"tcp://([A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")
_HTTP_ADDRESS = re.compile(r"http://([A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})"
                           r"/?")
_HANDSHAKE_FAILED = {
    getattr(zmq, name) for name in ("EVENT_HANDSHAKE_FAILED_NO_DETAIL",
                                    "EVENT_HANDSHAKE_FAILED_PROTOCOL",
                                    "EVENT_HANDSHAKE_FAILED_AUTH") if hasattr(zmq, name)}


class NotHealthy(RuntimeError):
    """The role did not answer, or answered that it is not ready (the message says which)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", choices=ROLES,
                        help="worker (prefill, decode, colocated), store (master or data "
                             "port) or router")
    parser.add_argument("address", help="tcp://HOST:PORT (worker, store) or "
                                        "http://HOST:PORT (router)")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="longest wait for the answer (default %(default)s)")
    parser.add_argument("--insecure-plaintext", action="store_true",
                        help="ask over plaintext ZeroMQ (a role started with "
                             "--insecure-plaintext); default: CurveZMQ under the cluster key "
                             "file in $PDSERVE_CLUSTER_KEY_FILE")


def run(args: argparse.Namespace) -> int:
    if args.timeout_s <= 0:
        print("pdserve health: --timeout-s must be positive", file=sys.stderr)
        return 2
    try:
        _check_address(args.role, args.address)
        if args.role != "router":  # the router's /health is HTTP, open without the key
            # a probe runs every few seconds: no plaintext warning in the pod's events each time
            logging.getLogger(security.__name__).setLevel(logging.ERROR)
            security.configure_from_env(args.insecure_plaintext, "pdserve health")
    except (ValueError, security.ClusterKeyError) as exc:
        print(f"pdserve health: {exc}", file=sys.stderr)
        return 2
    try:
        if args.role == "worker":
            line = check_worker(args.address, args.timeout_s)
        elif args.role == "store":
            line = check_store(args.address, args.timeout_s)
        else:
            line = check_router(args.address, args.timeout_s)
    except NotHealthy as exc:
        print(f"pdserve health: {args.role} at {args.address}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.role} at {args.address}: {line}")
    return 0


def _check_address(role: str, address: str) -> None:
    pattern, form = ((_HTTP_ADDRESS, "http://HOST:PORT") if role == "router"
                     else (_ZMQ_ADDRESS, "tcp://HOST:PORT"))
    match = pattern.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"a {role} address is {form}, got {address[:80]!r}")


# ---- the three checks ---------------------------------------------------------------------
def check_worker(address: str, timeout_s: float) -> str:
    from pdserve.protocol.worker import WORKER_PROTOCOL, StatusRequest, WorkerStatus

    raw = _ask(address, WORKER_PROTOCOL.encode(StatusRequest()), timeout_s)
    status = _decode(WORKER_PROTOCOL, raw, WorkerStatus)
    if not status.is_ready:
        raise NotHealthy(f"{status.worker_id} ({status.role}) answered, not ready")
    return (f"ready: {status.worker_id} ({status.role}, tp={status.tensor_parallel_size}), "
            f"{status.num_running} running, {status.num_waiting} waiting, "
            f"{status.num_free_blocks}/{status.num_total_blocks} KV blocks free")


def check_store(address: str, timeout_s: float) -> str:
    from pdserve.protocol.store.base import STORE_PROTOCOL, ErrorReply, StatsReply, StatsRequest

    raw = _ask(address, STORE_PROTOCOL.encode(StatsRequest(request_id=1)), timeout_s)
    reply = _decode(STORE_PROTOCOL, raw, (StatsReply, ErrorReply))
    if isinstance(reply, ErrorReply):
        raise NotHealthy(f"the store answered with an error: {reply.error}")
    # the fleet-wide counters (a master also reports per node: name.node)
    overall = sorted((n, v) for n, v in reply.stats.items() if "." not in n)
    counters = ", ".join(f"{name}={value}" for name, value in overall[:6])
    return f"ready: {counters}"


def check_router(address: str, timeout_s: float) -> str:
    match = _HTTP_ADDRESS.fullmatch(address)
    assert match is not None  # checked in run()
    host, port = match.group(1).strip("[]"), int(match.group(2))
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        body = response.read(300).decode(errors="replace").strip()
    except TimeoutError:
        raise NotHealthy(f"no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise NotHealthy(f"cannot connect: {exc.strerror or exc}") from None
    finally:
        connection.close()
    if response.status != 200:
        raise NotHealthy(f"HTTP {response.status}: {' '.join(body.split())[:200]}")
    return "ready (HTTP 200)"


# ---- one request/reply over ZeroMQ ----------------------------------------------------------
def _ask(address: str, payload: bytes, timeout_s: float) -> bytes:
    """Send `payload` to the ROUTER socket at `address` and return its one-frame reply, or raise
    NotHealthy naming what went wrong: what the socket monitor saw tells a refused connection
    and a failed CurveZMQ handshake (another cluster's key, or plaintext against Curve) apart
    from a peer that accepted the connection and never answered."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing until a handshake succeeded
    security.secure_client(socket)
    monitor = socket.get_monitor_socket()
    seen: set[int] = set()
    try:
        socket.connect(address)
        # With IMMEDIATE a send is refused (zmq.Again) until a connection is up: retry it.
        deadline = time.monotonic() + timeout_s
        sent = False
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while (remaining_s := deadline - time.monotonic()) > 0:
            if not sent:
                try:
                    socket.send(payload, zmq.NOBLOCK)
                    sent = True
                except zmq.Again:
                    pass
            events = dict(poller.poll(min(remaining_s, 0.05) * 1000))
            if monitor in events:
                seen.update(_drain_monitor(monitor))
                if seen & _HANDSHAKE_FAILED:
                    raise NotHealthy("the CurveZMQ handshake failed: not the cluster key this "
                                     "role runs under (or one side is plaintext)")
            if socket in events:
                return socket.recv()
        raise NotHealthy(_why_silent(seen, sent, timeout_s))
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
        socket.close(linger=0)
        context.term()


def _drain_monitor(monitor: zmq.Socket) -> set[int]:
    events = set()
    while monitor.poll(0):
        events.add(recv_monitor_message(monitor)["event"])
    return events


def _why_silent(seen: set[int], sent: bool, timeout_s: float) -> str:
    if zmq.EVENT_HANDSHAKE_SUCCEEDED in seen or sent:
        return f"connected, but no answer within {timeout_s:g} s (busy, hung, or not this role)"
    if zmq.EVENT_CONNECTED in seen:
        return (f"connected, but no handshake within {timeout_s:g} s (another protocol on "
                "this port, or a CurveZMQ server this key cannot talk to)")
    if zmq.EVENT_DISCONNECTED in seen:
        return (f"the connection was dropped in the handshake, for {timeout_s:g} s: not the "
                "cluster key this role runs under")
    if zmq.EVENT_CONNECT_RETRIED in seen or zmq.EVENT_CLOSED in seen:
        return f"connection refused (nothing listening), retried for {timeout_s:g} s"
    return f"no connection within {timeout_s:g} s (host unreachable or unresolvable)"


def _decode(protocol: Any, raw: bytes, expected: type | tuple[type, ...]) -> Any:
    from pdserve.protocol.codec import WireError

    try:
        message = protocol.decode(raw)
    except WireError as exc:
        raise NotHealthy(f"answered with a malformed message: {exc}") from None
    if not isinstance(message, expected):
        raise NotHealthy(f"answered with a {type(message).__name__}, not a status")
    return message
