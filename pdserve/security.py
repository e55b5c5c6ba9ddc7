"""Who may talk to pdserve's internal ports: CurveZMQ under one cluster key.

The router's HTTP port has its API key; the ports behind it (workers, the store's master and
data nodes, each worker's hand-off node) would otherwise take any message from anyone who
reaches them: generate, evict, read KV blocks, probe cached prefixes. So every ZeroMQ socket
between roles runs CurveZMQ (Curve25519 key exchange, XSalsa20-Poly1305 on every frame):

    server socket   curve_server, the cluster key pair as its own, and a ZAP handler in the
                    same process (zmq.auth) that admits a client only when the key it proved
                    in the handshake is the cluster's public key
    client socket   the cluster key pair as its own, the cluster public key as the server's

A peer without the cluster secret cannot finish the handshake, so it is dropped by libzmq
before a single frame reaches pdserve's decoder; nothing is answered. UCX endpoints are made
only from addresses exchanged over these channels (the store's hello), so only authenticated
peers get one.

The key is a file of two z85 lines (public, secret), mode 0600: `pdserve keygen FILE` writes
one, and `pdserve up` makes a fresh one per run and gives every child its path in
PDSERVE_CLUSTER_KEY_FILE. A role reads that at start (`configure_from_env`). Without a key a
role refuses to start unless plaintext is asked for explicitly (--insecure-plaintext or
PDSERVE_INSECURE_PLAINTEXT=1), and then says so loudly. Library users (tests, embedding) that
never configure a key run plaintext, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.thread

logger = logging.getLogger(__name__)

KEY_FILE_ENV = "PDSERVE_CLUSTER_KEY_FILE"
PLAINTEXT_ENV = "PDSERVE_INSECURE_PLAINTEXT"
ZAP_DOMAIN = "pdserve"


class ClusterKeyError(ValueError):
    """A missing, unreadable or malformed cluster key file."""


@dataclass(frozen=True)
class ClusterKey:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes

    @classmethod
    def generate(cls) -> ClusterKey:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def save(self, path: str | Path) -> Path:
        """Write the key file readable by its owner only (created 0600, never world-readable
        even for an instant)."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.public + b"\n" + self.secret + b"\n")
        os.chmod(path, 0o600)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ClusterKey:
        try:
            lines = Path(path).read_bytes().split()
        except OSError as exc:
            raise ClusterKeyError(
                f"cannot read the cluster key file {path}: {exc.strerror}") from None
        if len(lines) != 2 or any(len(line) != 40 for line in lines):
            raise ClusterKeyError(f"{path} is not a pdserve cluster key file (two z85 lines of 40 "
                            "characters: public, secret; `pdserve keygen` writes one)")
        public, secret = lines
        try:
            derived = zmq.curve_public(secret)
        except zmq.ZMQError:
            derived = b""
        if derived != public:
            raise ClusterKeyError(f"{path}: the public key does not belong to the secret key")
        return cls(public, secret)


_key: ClusterKey | None = None
_lock = threading.Lock()
_authenticators: dict[int, zmq.auth.thread.ThreadAuthenticator] = {}


def configure(key: ClusterKey | None) -> None:
    """This process's key: every socket made secure after this uses it (None: plaintext)."""
    global _key
    _key = key


def current_key() -> ClusterKey | None:
    return _key


@contextlib.contextmanager
def using(key: ClusterKey | None) -> Iterator[None]:
    """`key` in effect for the sockets made inside the block (a tool or test that talks to a
    secured cluster), the previous one after it."""
    previous = _key
    configure(key)
    try:
        yield
    finally:
        configure(previous)


def configure_from_env(allow_plaintext: bool = False, role: str = "this role") -> None:
    """At a role's start: the key named by PDSERVE_CLUSTER_KEY_FILE, else plaintext when asked
    for (the flag or PDSERVE_INSECURE_PLAINTEXT=1), else a ClusterKeyError saying what to do."""
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        configure(ClusterKey.load(path))
        logger.info("internal sockets: CurveZMQ with the cluster key in %s", path)
        return
    if allow_plaintext or os.environ.get(PLAINTEXT_ENV) == "1":
        configure(None)
        logger.warning("INSECURE: %s runs its internal sockets in PLAINTEXT, unauthenticated: "
                       "anyone who reaches its ports can generate, read or evict KV blocks. "
                       "Give it a cluster key (%s=FILE; `pdserve keygen FILE`)", role,
                       KEY_FILE_ENV)
        return
    raise ClusterKeyError(f"no cluster key: set {KEY_FILE_ENV} to a key file "
                    "(`pdserve keygen FILE` writes one; `pdserve up` makes its own), or pass "
                    f"--insecure-plaintext ({PLAINTEXT_ENV}=1) to run unauthenticated")


def secure_server(socket: zmq.Socket) -> None:
    """Make a socket about to bind a CurveZMQ server that admits only the cluster key (no-op
    without a key). Call before bind."""
    key = _key
    if key is None:
        return
    _ensure_authenticator(socket.context, key)
    socket.curve_secretkey = key.secret
    socket.curve_publickey = key.public
    socket.zap_domain = ZAP_DOMAIN.encode()
    socket.curve_server = True


def secure_client(socket: zmq.Socket) -> None:
    """Make a socket about to connect a CurveZMQ client of the cluster (no-op without a key).
    Call before connect."""
    key = _key
    if key is None:
        return
    socket.curve_secretkey = key.secret
    socket.curve_publickey = key.public
    socket.curve_serverkey = key.public


def release_context(context: zmq.Context) -> None:
    """Stop the ZAP handler of a context that is about to be closed (before term/destroy)."""
    with _lock:
        auth = _authenticators.pop(id(context), None)
    if auth is not None:
        auth.stop()


class _ClusterOnly:
    """ZAP credentials check: the client proved the cluster's public key, or nothing."""

    def __init__(self, public: bytes) -> None:
        self._public = public  # z85, as zmq.auth hands the client's key over

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and hmac.compare_digest(key, self._public)


def _ensure_authenticator(context: zmq.Context, key: ClusterKey) -> None:
    with _lock:
        if id(context) in _authenticators:
            return
        auth = zmq.auth.thread.ThreadAuthenticator(context, log=logger.getChild("zap"))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClusterOnly(key.public))
        _authenticators[id(context)] = auth


# ---- `pdserve keygen` ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the key file to write (mode 0600)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.exists() and not args.force:
        print(f"pdserve keygen: {path} exists (--force overwrites it)")
        return 2
    try:
        ClusterKey.generate().save(path)
    except OSError as exc:
        print(f"pdserve keygen: cannot write {path}: {exc.strerror}")
        return 2
    print(f"wrote {path}: give every role of the cluster its path in {KEY_FILE_ENV}")
    return 0
