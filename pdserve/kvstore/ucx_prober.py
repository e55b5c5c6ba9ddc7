"""UcxAddressProber: whether a peer's UCX worker address is safe to connect to, asked of a child.

UCX *aborts the process* (an assertion, not an error) on a malformed worker address, so a
server never parses a peer's address in its own process. One long-lived child does it instead
(started on first use, then reused: a Python + ucxx start costs ~1 s, a probe ~1 ms):

    server ── "<address hex>\\n" ──► child: parse, make an endpoint, close it
    server ◄── "ok\\n" / "fail\\n" ───┘    (on a malformed address UCX aborts it: EOF, so
                                        "not connectable"; the next probe starts a new child,
                                        as it does after any "fail")

Every read of the child's answer has a deadline; a child that does not answer in time is
killed and the address counts as not connectable. Verdicts are cached (LRU, bounded, with a
time to live), so a client that says hello again costs nothing. Thread-safe: one probe at a
time. `close()` ends the child (and reaps it).
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
"""The longest a child may take to start (an interpreter and ucxx's import: a second of CPU
alone, far more on a host where dozens of processes start at once, as a simulated fleet's
do); an answer's deadline is the request timeout."""

# The child: one UCX worker; per line, make an endpoint to the address and close it again.
_CHILD = """
import os, sys
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import numpy as np
import ucxx._lib.libucxx as u
worker = u.UCXWorker(u.UCXContext(feature_flags=(u.Feature.TAG,)))
out = sys.stdout.buffer
out.write(b"ready\\n"); out.flush()
for line in sys.stdin.buffer:
    try:
        raw = np.frombuffer(bytes.fromhex(line.decode("ascii").strip()), np.uint8)
        address = u.UCXAddress.create_from_buffer(raw)
        endpoint = u.UCXEndpoint.create_from_worker_address(
            worker, address, endpoint_error_handling=False)
        endpoint.close()
        worker.progress()
        verdict = b"ok\\n"
    except Exception:
        verdict = b"fail\\n"
    out.write(verdict); out.flush()
"""

_MAX_LINE_BYTES = 64


class UcxAddressProber:
    """Asks one reused child process whether UCX can make an endpoint from an address."""

    def __init__(self, tls: str, timeout_s: float, max_cached: int = 1024,
                 cache_ttl_s: float = 600.0):
        self.tls = tls
        self.timeout_s = timeout_s
        """Longest wait for the child to start, and for each answer."""
        self.max_cached = max_cached
        self.cache_ttl_s = cache_ttl_s
        self.num_probes = 0
        """Addresses actually sent to a child (cache hits are not probes)."""
        self.num_child_starts = 0
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._cache: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()  # -> verdict, until
        self._is_closed = False

    @property
    def child_pid(self) -> int | None:
        """The live child's pid (tests check it is gone after close)."""
        child = self._child
        return None if child is None else child.pid

    def is_connectable(self, address: bytes) -> bool:
        """Whether an endpoint can be made from `address` without UCX aborting."""
        with self._lock:
            if self._is_closed:
                raise RuntimeError("the UCX address prober is closed")
            now_s = time.monotonic()
            cached = self._cache.get(address)
            if cached is not None and cached[1] > now_s:
                self._cache.move_to_end(address)
                return cached[0]
            verdict = self._probe(address)
            self._cache[address] = (verdict, now_s + self.cache_ttl_s)
            self._cache.move_to_end(address)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return verdict

    def start_early(self) -> None:
        """Start the child now, on a thread of its own, rather than at the first hello (which
        then waits for it: a peer with a short timeout could give up)."""
        def start() -> None:
            with self._lock:
                if self._child is None and not self._is_closed:
                    self._start_child()

        threading.Thread(target=start, name="ucx-prober-start", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._stop_child()

    # ---- the child ----------------------------------------------------------------------------
    def _probe(self, address: bytes) -> bool:
        if self._child is None and not self._start_child():
            return False
        assert self._child is not None and self._child.stdin is not None
        self.num_probes += 1
        try:
            self._child.stdin.write(address.hex().encode("ascii") + b"\n")
            self._child.stdin.flush()
        except OSError:  # the child died since the last probe
            self._stop_child()
            return False
        try:
            answer = self._read_line(time.monotonic() + self.timeout_s)
        except TimeoutError:
            logger.warning("store: the UCX address prober did not answer within %.1f s; "
                           "killing it", self.timeout_s)
            self._stop_child(kill=True)
            return False
        if answer != b"ok":
            # EOF: UCX aborted the child on this address. "fail": it survived, but a half
            # parsed address may have left its UCX state unsound. Either way, a fresh child
            # for the next probe.
            self._stop_child(kill=answer is not None)
            return False
        return True

    def _start_child(self) -> bool:
        env = {**os.environ, "UCX_TLS": self.tls, "UCX_LOG_LEVEL": "fatal"}
        self.num_child_starts += 1
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env)
        self._buffer = b""
        start_timeout_s = max(self.timeout_s, START_TIMEOUT_S)
        try:
            ready = self._read_line(time.monotonic() + start_timeout_s)
        except TimeoutError:
            ready = None
        if ready != b"ready":
            logger.warning("store: the UCX address prober did not start within %.1f s",
                           start_timeout_s)
            self._stop_child(kill=True)
            return False
        return True

    def _read_line(self, deadline_s: float) -> bytes | None:
        """The child's next answer line; None on EOF or an overlong line, TimeoutError past
        the deadline."""
        assert self._child is not None and self._child.stdout is not None
        fd = self._child.stdout.fileno()
        while b"\n" not in self._buffer:
            if len(self._buffer) > _MAX_LINE_BYTES:
                return None
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError("no answer from the UCX address prober")
            readable, _, _ = select.select([fd], [], [], remaining_s)
            if not readable:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.strip()

    def _stop_child(self, kill: bool = False) -> None:
        """End the child and reap it: it exits once its stdin closes, else it is killed."""
        child, self._child = self._child, None
        if child is None:
            return
        if kill:
            child.kill()
        for stream in (child.stdin, child.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            child.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=self.timeout_s)
