"""Fleet discovery through etcd: every role registers a record under a lease it keeps alive;
routers and workers watch the records (docs/fleet.md).

Key layout (one key per process, the value a JSON `Record`):

    /pdserve/<cluster>/<role>/<id>
        cluster  the path of the discovery URL, etcd://HOST:PORT/<cluster> ("default")
        role     router | prefill | decode | colocated | store-master | store-data
        id       the process's advertised host:port (unique per reachable endpoint)

Each key is put under a lease of `ttl_s` seconds that a keepalive thread renews every third
of it. A graceful stop revokes the lease (its keys vanish at once); a process that dies
stops renewing, and its keys vanish when the lease expires, at most `ttl_s` later.

etcd is reached through its v3 JSON gateway (`/v3/kv/put`, `/v3/kv/range`, `/v3/lease/*`,
`/v3/watch`: keys and values base64) with httpx; every call has a timeout. A watch resumes
from the revision after the last one it saw, so no event is lost across a reconnect; when
that revision has been compacted away it starts over from a fresh range.

Records are validated on read: a malformed one is logged and skipped, never raised into a
watcher. This module is a leaf: it imports nothing else of pdserve, so every package (the
router, the workers, the store) may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve import etcd
from pdserve.etcd import (  # noqa: F401 (the gateway's names, as the roles use them)
    REQUEST_TIMEOUT_S,
    WATCH_IDLE_S,
    Compacted,
    DiscoveryError,
    EtcdAccess,
    EtcdClient,
    Event,
)

logger = logging.getLogger(__name__)

KEY_ROOT = "/pdserve"
DEFAULT_CLUSTER = "default"
WORKER_ROLES = ("prefill", "decode", "colocated")
ROLES = ("router", *WORKER_ROLES, "store-master", "store-data")
DEFAULT_TTL_S = 10.0
RETRY_S = 0.5
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class RecordError(ValueError):
    """A registry value is not a valid Record."""


# ---- where -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiscoveryURL:
    """etcd://HOST:PORT[,HOST:PORT...][/CLUSTER], or etcd+https://[USER@]HOST:PORT[,...]
    [/CLUSTER]: etcd's members (tried in turn, pdserve/etcd.py) and the fleet's name in it."""

    host: str
    port: int
    cluster: str = DEFAULT_CLUSTER
    more_members: tuple[tuple[str, int], ...] = ()
    """The members after the first (host, port)."""
    tls: bool = False
    user: str = ""

    @classmethod
    def parse(cls, url: str) -> DiscoveryURL:
        form = ("--discovery must look like etcd://HOST:PORT[/CLUSTER] (several members: "
                "HOST:PORT,HOST:PORT; TLS and a user: etcd+https://[USER@]HOST:PORT...)")
        match = re.fullmatch(r"etcd(\+https)?://(?:([A-Za-z0-9._-]{1,64})@)?([^/\s]+?)"
                             r"(?:/([^/\s]*))?/?", url)
        if match is None:
            raise ValueError(f"{form}, got {url[:80]!r}")
        tls, user, members_text, cluster = (bool(match.group(1)), match.group(2) or "",
                                            match.group(3), match.group(4) or "")
        members = []
        for member in members_text.split(","):
            found = re.fullmatch(r"([^/:\s,@]+|\[[0-9a-fA-F:]+\]):(\d+)", member)
            if found is None:
                raise ValueError(f"{form}, got {url[:80]!r}")
            port = int(found.group(2))
            if not 0 < port < 65536:
                raise ValueError(f"--discovery port must be in 1..65535, got {port}")
            members.append((found.group(1), port))
        cluster = cluster or DEFAULT_CLUSTER
        if not _NAME.fullmatch(cluster):
            raise ValueError(f"cluster name {cluster!r} must be 1-63 letters, digits, '.', "
                             "'_' or '-'")
        (host, port), *more = members
        return cls(host, port, cluster, tuple(more), tls, user)

    @property
    def endpoints(self) -> list[str]:
        """Every member's base URL, the first first."""
        scheme = "https" if self.tls else "http"
        return [f"{scheme}://{host}:{port}"
                for host, port in ((self.host, self.port), *self.more_members)]

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]

    def client(self) -> EtcdClient:
        """A client of these members, with this process's access (etcd.configure)."""
        return EtcdClient(self.endpoints, user=self.user or None)

    def prefix(self, role: str | None = None) -> str:
        """The key prefix of the whole fleet, or of one role in it."""
        base = f"{KEY_ROOT}/{self.cluster}/"
        return base if role is None else f"{base}{role}/"

    def key(self, role: str, record_id: str) -> str:
        return f"{self.prefix(role)}{record_id}"

    def __str__(self) -> str:
        members = ",".join(f"{h}:{p}" for h, p in ((self.host, self.port), *self.more_members))
        user = f"{self.user}@" if self.user else ""
        return f"etcd{'+https' if self.tls else ''}://{user}{members}/{self.cluster}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--discovery, --discovery-ttl-s and --advertise-address: the same flags on every
    role."""
    parser.add_argument("--discovery", default=None, metavar="etcd://HOST:PORT[/CLUSTER]",
                        help="register in this etcd under a lease, and find the other roles "
                             "there (no worker, store or master addresses needed); several "
                             "members comma-separated (HOST:PORT,HOST:PORT), tried in turn; "
                             "etcd+https://[USER@]HOST:PORT[,...][/CLUSTER] for TLS and a user")
    parser.add_argument("--discovery-ca-file", default=None, metavar="PATH",
                        help="etcd+https: the CA that signed the etcd members' certificates "
                             "(default: the system's)")
    parser.add_argument("--discovery-cert-file", default=None, metavar="PATH",
                        help="etcd+https: this process's client certificate, for members "
                             "that ask for one (with --discovery-key-file)")
    parser.add_argument("--discovery-key-file", default=None, metavar="PATH",
                        help="etcd+https: the client certificate's private key")
    parser.add_argument("--discovery-password-file", default=None, metavar="PATH",
                        help="the password of the discovery URL's USER, read from this file")
    parser.add_argument("--discovery-allow-plaintext-password", action="store_true",
                        help="send the USER's password to plain-HTTP etcd members (etcd://USER@"
                             "...), in clear on the wire; without it such a URL is refused")
    parser.add_argument("--discovery-ttl-s", type=float, default=DEFAULT_TTL_S,
                        help="registry lease TTL: a process that dies leaves the registry "
                             "this long after (default %(default)s)")
    parser.add_argument("--advertise-address", default=None, metavar="HOST",
                        help="the host name or address other hosts reach this role at, in its "
                             "registry record and every address it hands its peers (default: "
                             "the --host it binds; for 0.0.0.0, this host's first "
                             "non-loopback address)")


def configure_access(args: argparse.Namespace) -> None:
    """Apply the --discovery-*-file flags to this process (ValueError names a bad one, or a
    password that would cross plain HTTP without --discovery-allow-plaintext-password)."""
    access = etcd.EtcdAccess.from_files(
        getattr(args, "discovery_ca_file", None), getattr(args, "discovery_cert_file", None),
        getattr(args, "discovery_key_file", None),
        getattr(args, "discovery_password_file", None),
        bool(getattr(args, "discovery_allow_plaintext_password", False)))
    if getattr(args, "discovery", None):
        url = DiscoveryURL.parse(args.discovery)
        if url.user and not url.tls and not access.allow_plaintext_password:
            raise ValueError(f"--discovery {url}: USER's password would cross plain HTTP; use "
                             "etcd+https://, or --discovery-allow-plaintext-password")
    etcd.configure(access)


def access_argv(args: argparse.Namespace) -> list[str]:
    """The --discovery-*-file flags as given, for a child process (`pdserve up`)."""
    argv = []
    for flag in ("ca", "cert", "key", "password"):
        value = getattr(args, f"discovery_{flag}_file", None)
        if value is not None:
            argv += [f"--discovery-{flag}-file", value]
    if getattr(args, "discovery_allow_plaintext_password", False):
        argv.append("--discovery-allow-plaintext-password")
    return argv


def check_ttl(ttl_s: float) -> None:
    if not 1 <= ttl_s <= 3600:
        raise ValueError(f"--discovery-ttl-s must be in [1, 3600] seconds, got {ttl_s}")


# ---- what ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """What one process tells the fleet about itself."""

    role: str
    """One of ROLES."""
    address: str
    """Where it is reached: a worker's or store node's ZeroMQ address (tcp://HOST:PORT), a
    router's HTTP base URL."""
    name: str = ""
    """Its name in statuses and metrics (worker id, store node id)."""
    model: str | None = None
    """The model it serves (workers)."""
    kv_layout: dict[str, Any] | None = None
    """The KV layout its blocks have (workers; the fields of WorkerStatus.kv_layout)."""
    tensor_parallel_size: int = 1
    capacity: dict[str, int] = field(default_factory=dict)
    """What it can hold: a worker's num_kv_blocks, block_size, max_num_seqs; a data node's
    dram_blocks, disk_blocks."""
    addresses: dict[str, str] = field(default_factory=dict)
    """Further addresses by purpose (e.g. a store node's master and data sockets)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RecordError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.address, str) or not re.fullmatch(r"\w+://\S+:\d+\S*",
                                                                  self.address):
            raise RecordError(f"address must be SCHEME://HOST:PORT, got {self.address!r}")
        if not isinstance(self.name, str) or len(self.name) > 200:
            raise RecordError("name must be a string of at most 200 characters")
        if self.model is not None and not isinstance(self.model, str):
            raise RecordError("model must be a string")
        if self.kv_layout is not None and not isinstance(self.kv_layout, dict):
            raise RecordError("kv_layout must be an object")
        if (not isinstance(self.tensor_parallel_size, int) or isinstance(
                self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1):
            raise RecordError("tensor_parallel_size must be a positive integer")
        if not isinstance(self.capacity, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in self.capacity.items()):
            raise RecordError("capacity must map names to integers")
        if not isinstance(self.addresses, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.addresses.items()):
            raise RecordError("addresses must map names to strings")

    @property
    def record_id(self) -> str:
        """The last part of its key: HOST:PORT of its address."""
        return self.address.split("://", 1)[1].rstrip("/")

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RecordError("not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise RecordError(f"unknown fields {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a required field missing
            raise RecordError(str(exc)) from None


def parse_entry(url: DiscoveryURL, key: str, raw: bytes) -> Record | None:
    """The record stored at `key`, or None (logged) when it is malformed or its key does not
    match its role."""
    try:
        record = Record.from_json(raw)
    except RecordError as exc:
        logger.warning("ignored a malformed registry record at %s: %s", key, exc)
        return None
    if not key.startswith(url.prefix(record.role)):
        logger.warning("ignored a registry record at %s: its role is %s", key, record.role)
        return None
    return record


# ---- registering -----------------------------------------------------------------------------
class Registration:
    """One process's record, kept in the registry under a lease until `withdraw()`.

    A keepalive thread renews the lease every ttl/3; if the lease is gone (etcd restarted, or
    this process was cut off longer than the TTL) it takes a new one and puts the record
    again, so a process that comes back reappears by itself."""

    def __init__(self, url: DiscoveryURL, record: Record, ttl_s: float = DEFAULT_TTL_S
                 ) -> None:
        check_ttl(ttl_s)
        self.url = url
        self.ttl_s = ttl_s
        self._record = record
        self._client = url.client()
        self._lock = threading.Lock()  # the client and the lease, between the two threads
        self._lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return self.url.key(self._record.role, self._record.record_id)

    @property
    def record(self) -> Record:
        return self._record

    def start(self) -> Registration:
        """Put the record now (raises DiscoveryError when etcd is unreachable), then keep it."""
        with self._lock:
            self._put_fresh()
        self._thread = threading.Thread(target=self._keep, name="discovery-keepalive",
                                        daemon=True)
        self._thread.start()
        logger.info("registered %s at %s in %s (lease TTL %.0fs)", self._record.address,
                    self.key, self.url, self.ttl_s)
        return self

    def update(self, record: Record) -> None:
        """Replace the record (e.g. after a role flip: its key moves with the role)."""
        with self._lock:
            old_key = self.key
            self._record = record
            if self._lease_id is None or self._stop.is_set():
                return
            try:
                self._client.put(self.key, record.to_json(), self._lease_id)
                if self.key != old_key:
                    self._client.delete(old_key)
            except DiscoveryError as exc:
                logger.warning("could not update the registry record: %s", exc)

    def withdraw(self) -> None:
        """Stop renewing and revoke the lease: the record vanishes now. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S + 1)
        with self._lock:
            if self._lease_id is not None:
                try:
                    self._client.revoke(self._lease_id)
                except DiscoveryError as exc:  # it expires within its TTL anyway
                    logger.warning("could not revoke the registry lease: %s", exc)
                self._lease_id = None
            self._client.close()
        logger.info("withdrew %s from the registry", self._record.address)

    def _put_fresh(self) -> None:
        self._lease_id = self._client.grant(self.ttl_s)
        self._client.put(self.key, self._record.to_json(), self._lease_id)

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    if self._lease_id is None or self._client.keepalive(self._lease_id) <= 0:
                        logger.warning("registry lease lost; registering %s again",
                                       self._record.address)
                        self._put_fresh()
                except DiscoveryError as exc:
                    logger.warning("registry keepalive failed (will retry): %s", exc)


# ---- watching --------------------------------------------------------------------------------
class RegistryWatch:
    """A thread that keeps `records` (key -> Record) equal to the registry under the fleet's
    prefix, and calls `on_change(records)` (a copy) after every change it applies, from the
    watch thread. Malformed values are logged and left out."""

    def __init__(self, url: DiscoveryURL,
                 on_change: Callable[[dict[str, Record]], None] | None = None) -> None:
        self.url = url
        self.on_change = on_change
        self._records: dict[str, Record] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.is_synced = False
        """The first range has been read (records reflect the registry)."""

    @property
    def records(self) -> dict[str, Record]:
        with self._cond:
            return dict(self._records)

    def start(self) -> RegistryWatch:
        self._thread = threading.Thread(target=self._run, name="discovery-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WATCH_IDLE_S + REQUEST_TIMEOUT_S)

    def wait_for(self, predicate: Callable[[dict[str, Record]], bool], timeout_s: float
                 ) -> bool:
        """Whether `predicate(records)` held within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(dict(self._records)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def _run(self) -> None:
        client = self.url.client()
        prefix = self.url.prefix()
        next_revision = None
        try:
            while not self._stop.is_set():
                try:
                    if next_revision is None:  # (re)start from a fresh range
                        revision, entries = client.range_prefix(prefix)
                        self._reset({key: raw for key, raw in entries})
                        next_revision = revision + 1
                    for event in client.watch(prefix, next_revision):
                        self._apply(event)
                        next_revision = event.revision + 1
                        if self._stop.is_set():
                            return
                except Compacted as exc:
                    logger.warning("registry watch: %s; reading it afresh", exc)
                    next_revision = None
                except DiscoveryError as exc:
                    logger.warning("registry watch failed (retrying): %s", exc)
                    self._stop.wait(RETRY_S)
        finally:
            client.close()

    def _reset(self, entries: dict[str, bytes]) -> None:
        records = {}
        for key, raw in entries.items():
            record = parse_entry(self.url, key, raw)
            if record is not None:
                records[key] = record
        with self._cond:
            changed = records != self._records or not self.is_synced
            self._records = records
            self.is_synced = True
            self._cond.notify_all()
        if changed:
            self._notify()

    def _apply(self, event: Event) -> None:
        with self._cond:
            if event.kind == "delete":
                changed = self._records.pop(event.key, None) is not None
            else:
                record = parse_entry(self.url, event.key, event.value)
                if record is None:  # a malformed replacement: the key holds nothing valid
                    changed = self._records.pop(event.key, None) is not None
                else:
                    changed = self._records.get(event.key) != record
                    self._records[event.key] = record
            self._cond.notify_all()
        if changed:
            self._notify()

    def _notify(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(self.records)
        except Exception:  # a bad callback must not end the watch
            logger.exception("registry watch callback failed")


def check_reachable(url: DiscoveryURL) -> None:
    """Raise DiscoveryError (naming the endpoint) unless etcd answers a read."""
    client = url.client()
    try:
        client.range_prefix(url.prefix())
    finally:
        client.close()


def find(url: DiscoveryURL, role: str, timeout_s: float) -> list[Record]:
    """The records of `role`, waiting up to `timeout_s` for at least one to appear (an empty
    list when none did; DiscoveryError when etcd could not be reached at all)."""
    client = url.client()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            _, entries = client.range_prefix(url.prefix(role))
            records = [r for key, raw in entries if (r := parse_entry(url, key, raw))]
            if records or time.monotonic() >= deadline:
                return sorted(records, key=lambda r: r.address)
            time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))
    finally:
        client.close()
