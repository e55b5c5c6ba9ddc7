"""etcd's v3 JSON gateway as operators run it: several members, TLS, a user and password.

    etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]              plain HTTP
    etcd+https://[USER@]HOST:PORT[,HOST:PORT...][/CLUSTER] TLS; USER authenticates with the
                                                           password of --discovery-password-file

An `EtcdClient` talks to one member at a time and moves to the next on any answer that is not
a healthy member's: no answer (a member down), or an error that says the member cannot serve
(a member cut off from the majority answers "no leader"; every call requires a leader so it
says so at once), so a registration's keepalive and a watch outlive a member. An error about
the request itself (a lease not found, a bad argument, a refused permission) is the same on
every member and is raised at once.

TLS takes the CA, and a client certificate and key where the members ask for one
(`--client-cert-auth`), from `--discovery-ca-file`, `--discovery-cert-file` and
`--discovery-key-file`. With a user the client fetches a token (`/v3/auth/authenticate`) and
sends it on every call, fetching a new one when etcd refuses it (expired, or a member that
never issued it). A password goes only over TLS: a user on a plain-HTTP member is refused
unless `--discovery-allow-plaintext-password` says the operator accepts it in clear. The flags
are the same on every role (discovery.add_arguments) and `configure` applies them once per
process. Every call has a timeout.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}
"""Sent on every call: a member without a leader (cut off from the majority) then answers "no
leader" at once (its watches are cancelled with it) instead of serving stale reads, holding a
write for 7 s, or keeping a watch open that never brings an event."""
WATCH_IDLE_S = 2.0
"""A watch stream that brings nothing for this long is reopened (from its next revision)."""


class DiscoveryError(RuntimeError):
    """etcd could not be reached, or answered with an error."""


class _MemberFailed(DiscoveryError):
    """The member answered that it cannot serve now (no leader, a timeout inside etcd, an
    internal error): another member may."""


# gRPC codes of answers that say the member, not the request, failed: CANCELLED, UNKNOWN
# (etcd's "context deadline exceeded"), DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED,
# INTERNAL, UNAVAILABLE ("no leader", "request timed out"), DATA_LOSS. The others (NOT_FOUND,
# INVALID_ARGUMENT, PERMISSION_DENIED, FAILED_PRECONDITION, ...) are about the request.
MEMBER_FAILURE_CODES = frozenset({1, 2, 4, 8, 10, 13, 14, 15})


def _failure(status_code: int, body: Any) -> type[DiscoveryError]:
    """The error an answer raises: _MemberFailed (the next member may serve) or not."""
    return _MemberFailed if member_failed(status_code, body) else DiscoveryError


def member_failed(status_code: int, body: Any) -> bool:
    """Whether an answer (HTTP status, decoded JSON body or None) says the member failed:
    a 5xx with no gRPC code, or a gRPC code of MEMBER_FAILURE_CODES (etcd's gateway puts it in
    "code" or in "error": {"grpc_code": ...})."""
    code = None
    if isinstance(body, dict):
        error = body.get("error")
        code = error.get("grpc_code") if isinstance(error, dict) else body.get("code")
    if isinstance(code, int):
        return code in MEMBER_FAILURE_CODES
    return status_code >= 500


@dataclass(frozen=True)
class EtcdAccess:
    """How this process proves itself to etcd: TLS files and a user's password."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    password: str | None = None
    allow_plaintext_password: bool = False
    """Send the password to plain-HTTP members too (--discovery-allow-plaintext-password)."""

    def ssl_context(self) -> ssl.SSLContext:
        """TLS to etcd: its CA (else the system's), and this client's certificate."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    @classmethod
    def from_files(cls, ca_file: str | None, cert_file: str | None, key_file: str | None,
                   password_file: str | None, allow_plaintext_password: bool = False
                   ) -> EtcdAccess:
        """From the flags; ValueError naming the flag where a file is missing or unreadable,
        or where a certificate comes without its key (or the other way round)."""
        if bool(cert_file) != bool(key_file):
            raise ValueError("--discovery-cert-file and --discovery-key-file go together")
        for flag, path in (("--discovery-ca-file", ca_file), ("--discovery-cert-file", cert_file),
                           ("--discovery-key-file", key_file),
                           ("--discovery-password-file", password_file)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        password = None
        if password_file is not None:
            try:
                password = Path(password_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"--discovery-password-file: {exc}") from None
        return cls(ca_file, cert_file, key_file, password, allow_plaintext_password)


_ACCESS = EtcdAccess()


def configure(access: EtcdAccess) -> None:
    """This process's access to etcd (from its flags, at start)."""
    global _ACCESS
    _ACCESS = access


def access() -> EtcdAccess:
    return _ACCESS


# ---- the wire --------------------------------------------------------------------------------
def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: str) -> str:
    """etcd's range_end for every key starting with `prefix` (its last byte plus one)."""
    raw = prefix.encode()
    return _b64(raw[:-1] + bytes([raw[-1] + 1]))


@dataclass(frozen=True)
class Event:
    kind: str
    """put | delete."""
    key: str
    value: bytes
    """The new value of a put (b"" for a delete)."""
    revision: int


class Compacted(DiscoveryError):
    """A watch asked for a revision etcd has compacted away."""


class _Refused(DiscoveryError):
    """etcd refused the call's credentials (an expired or unknown token)."""


class EtcdClient:
    """A few verbs of etcd's v3 API over its JSON gateway, on one member at a time (the next
    when it cannot be reached or answers that it cannot serve). Not shared between threads:
    each thread that talks to etcd makes its own."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = REQUEST_TIMEOUT_S,
                 user: str | None = None, access: EtcdAccess | None = None) -> None:
        """`endpoints`: base URLs (http://host:port or https://...), tried in order."""
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.timeout_s = timeout_s
        self.user = user
        self.access = access if access is not None else _ACCESS
        if user and self.access.password is None:
            raise ValueError(f"etcd user {user!r} needs --discovery-password-file")
        plain = [e for e in self.endpoints if not e.startswith("https://")]
        if user and plain and not self.access.allow_plaintext_password:
            raise ValueError(
                f"etcd user {user!r}: the password would cross plain HTTP to {plain[0]}; use "
                "etcd+https://, or --discovery-allow-plaintext-password to send it in clear")
        self._index = 0
        self._clients: dict[str, httpx.Client] = {}
        self._token: str | None = None

    @property
    def endpoint(self) -> str:
        """The member this client talks to now."""
        return self.endpoints[self._index]

    def _http(self) -> httpx.Client:
        endpoint = self.endpoint
        if endpoint not in self._clients:
            tls: dict[str, Any] = {}
            if endpoint.startswith("https://"):
                tls["verify"] = self.access.ssl_context()
            self._clients[endpoint] = httpx.Client(base_url=endpoint, timeout=self.timeout_s,
                                                   headers=REQUIRE_LEADER, **tls)
        return self._clients[endpoint]

    def _next_member(self, error: Exception) -> None:
        logger.warning("etcd member %s failed (%s); trying the next", self.endpoint, error)
        self._index = (self._index + 1) % len(self.endpoints)
        self._token = None  # a token is a member's; the next one may not know it

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _headers(self) -> dict[str, str]:
        if not self.user:
            return {}
        if self._token is None:
            reply = self._post("/v3/auth/authenticate",
                               {"name": self.user, "password": self.access.password}, {})
            self._token = reply.get("token")
            if not self._token:
                raise DiscoveryError(f"etcd at {self.endpoint} gave user {self.user!r} no "
                                     "token")
        return {"Authorization": self._token}

    def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]
              ) -> dict[str, Any]:
        response = self._http().post(path, json=body, headers=headers)
        if response.status_code == 401 or (
                response.status_code != 200 and "token" in response.text.lower()):
            raise _Refused(f"etcd {path} refused the credentials: {response.text[:200]}")
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if response.status_code != 200 or (isinstance(reply, dict) and "error" in reply):
            raise _failure(response.status_code, reply)(
                f"etcd {path} answered {response.status_code}: {response.text[:200]}")
        if not isinstance(reply, dict):
            raise _MemberFailed(f"etcd {path} answered non-JSON: {response.text[:200]}")
        return reply

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call, on the members in turn until one answers (each at most once); a
        refused token is fetched again once."""
        failures = []
        for _ in range(len(self.endpoints)):
            try:
                try:
                    return self._post(path, body, self._headers())
                except _Refused:
                    self._token = None
                    return self._post(path, body, self._headers())
            except (httpx.HTTPError, _MemberFailed) as exc:
                failures.append(f"{self.endpoint}: {exc}")
                self._next_member(exc)
        raise DiscoveryError(f"etcd at {', '.join(self.endpoints)} unreachable or unable to "
                             f"serve ({'; '.join(failures)})")

    # ---- verbs -------------------------------------------------------------------------------
    def grant(self, ttl_s: float) -> int:
        """A new lease of `ttl_s` seconds (rounded up to whole seconds)."""
        reply = self._call("/v3/lease/grant", {"TTL": max(1, int(-(-ttl_s // 1)))})
        if "ID" not in reply or reply.get("error"):
            raise DiscoveryError(f"lease grant failed: {reply}")
        return int(reply["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Renew a lease once; its remaining TTL in seconds, 0 when it no longer exists."""
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke(self, lease_id: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease_id)})

    def put(self, key: str, value: bytes, lease_id: int | None = None) -> int:
        """Store `value` at `key` (tied to the lease when given); the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id is not None:
            body["lease"] = str(lease_id)
        return int(self._call("/v3/kv/put", body)["header"]["revision"])

    def delete(self, key: str) -> None:
        self._call("/v3/kv/deleterange", {"key": _b64(key)})

    def range_prefix(self, prefix: str) -> tuple[int, list[tuple[str, bytes]]]:
        """Every (key, value) under `prefix`, and the store's revision they were read at."""
        reply = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        entries = [(_unb64(kv["key"]).decode(errors="replace"), _unb64(kv.get("value", "")))
                   for kv in reply.get("kvs", [])]
        return int(reply["header"]["revision"]), entries

    def watch(self, prefix: str, start_revision: int, idle_s: float = WATCH_IDLE_S
              ) -> Iterator[Event]:
        """The events under `prefix` from `start_revision` on, until the stream has been
        quiet for `idle_s` (then it ends; the caller reopens from its next revision).
        Raises Compacted when start_revision is gone, DiscoveryError when etcd fails (the
        next call goes to the next member)."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                   "start_revision": str(start_revision)}}
        timeout = httpx.Timeout(self.timeout_s, read=idle_s)
        try:
            headers = self._headers()
            with self._http().stream("POST", "/v3/watch", json=body, timeout=timeout,
                                     headers=headers) as stream:
                if stream.status_code == 401:
                    self._token = None
                    raise DiscoveryError("etcd watch refused the credentials")
                if stream.status_code != 200:
                    stream.read()
                    try:
                        reply = json.loads(stream.text)
                    except ValueError:
                        reply = None
                    raise _failure(stream.status_code, reply)(
                        f"etcd watch answered {stream.status_code}: {stream.text[:200]}")
                for line in stream.iter_lines():
                    if not line.strip():
                        continue
                    yield from _watch_events(json.loads(line))
        except httpx.ReadTimeout:
            return
        except (httpx.HTTPError, ValueError, _MemberFailed) as exc:
            endpoint = self.endpoint
            self._next_member(exc)
            raise DiscoveryError(f"etcd watch at {endpoint} failed: {exc}") from exc


def _watch_events(message: dict[str, Any]) -> list[Event]:
    if "error" in message:
        raise _failure(200, message)(f"etcd watch error: {message['error']}")
    result = message.get("result", {})
    if int(result.get("compact_revision", 0) or 0):
        raise Compacted(f"revision compacted (now from {result['compact_revision']})")
    if result.get("canceled"):
        raise DiscoveryError(f"etcd cancelled the watch: {result.get('cancel_reason', '')}")
    events = []
    for event in result.get("events", []):
        kv = event.get("kv", {})
        events.append(Event("delete" if event.get("type") == "DELETE" else "put",
                            _unb64(kv["key"]).decode(errors="replace"),
                            _unb64(kv.get("value", "")), int(kv.get("mod_revision", 0))))
    return events
