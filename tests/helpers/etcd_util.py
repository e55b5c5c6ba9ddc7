"""A real etcd for the fleet tests: one single-member cluster on free loopback ports, in a
temporary data directory, stopped (and its directory removed) after."""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.cluster_util import free_port_block

ETCD = shutil.which("etcd")
START_TIMEOUT_S = 30.0


@dataclass
class Etcd:
    process: subprocess.Popen
    client_port: int
    data_dir: Path
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def url(self, cluster: str = "default") -> str:
        """The --discovery URL of a fleet in this etcd."""
        return f"etcd://127.0.0.1:{self.client_port}/{cluster}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_etcd(tmp_dir: Path) -> Etcd:
    """Start etcd (pytest.skip when the binary is missing) and wait until it serves."""
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server; .ci/run does)")
    base = free_port_block(2)
    client, peer = base, base + 1
    data_dir, log_path = tmp_dir / f"etcd-{base}", tmp_dir / f"etcd-{base}.log"
    argv = [ETCD, "--name", "default", "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    etcd = Etcd(process, client, data_dir, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"etcd exited early:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{etcd.endpoint}/health", timeout=1).status_code == 200:
                return etcd
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    etcd.stop()
    raise RuntimeError(f"etcd not serving in {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")


def start_members(tmp_dir: Path, prefix: str, client_scheme: str, extra: list[str]
                  ) -> list[Etcd]:
    """Three members of one new cluster on free loopback ports, named prefix0..2, clients
    over `client_scheme` (peers over plain HTTP), `extra` flags on each; not waited for."""
    base = free_port_block(6)
    clients, peers = [base + 2 * i for i in range(3)], [base + 2 * i + 1 for i in range(3)]
    initial = ",".join(f"{prefix}{i}=http://127.0.0.1:{peer}" for i, peer in enumerate(peers))
    members = []
    for i, (client, peer) in enumerate(zip(clients, peers, strict=True)):
        name = f"{prefix}{i}"
        data_dir, log_path = tmp_dir / f"etcd-{name}", tmp_dir / f"etcd-{name}.log"
        argv = [ETCD, "--name", name, "--data-dir", str(data_dir),
                "--listen-client-urls", f"{client_scheme}://127.0.0.1:{client}",
                "--advertise-client-urls", f"{client_scheme}://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", initial, "--initial-cluster-state", "new", *extra]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        members.append(Etcd(process, client, data_dir, log_path))
    return members


# ---- three members over TLS, with a user ---------------------------------------------------
@dataclass
class TlsCluster:
    """Three etcd members serving clients over TLS (client certificates required), auth
    enabled with user root, on loopback; `files` holds the CA, the client certificate and key
    (no CN: a call passes only with root's token) and root's password file."""

    members: list[Etcd]
    files: dict[str, Path]

    def url(self, cluster: str) -> str:
        hosts = ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)
        return f"etcd+https://root@{hosts}/{cluster}"

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certificates(out: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    files = {name: out / name for name in ("ca.crt", "ca.key", "server.crt", "server.key",
                                           "client.crt", "client.key", "password")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             "/CN=pdserve-test-ca", "-keyout", str(files["ca.key"]), "-out", str(files["ca.crt"]))
    for who, subject, extension in (
            ("server", "/CN=etcd", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
            # no CN: etcd's JSON gateway refuses a client certificate with one once auth is
            # on ("CommonName ... will be ignored"), so the user comes from the token alone
            ("client", "/O=pdserve-client", "extendedKeyUsage=clientAuth")):
        csr, ext = out / f"{who}.csr", out / f"{who}.ext"
        ext.write_text(extension + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
                 "-keyout", str(files[f"{who}.key"]), "-out", str(csr))
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca.crt"]), "-CAkey",
                 str(files["ca.key"]), "-CAcreateserial", "-days", "1", "-extfile", str(ext),
                 "-out", str(files[f"{who}.crt"]))
    files["password"].write_text("s3cret\n")
    return files


def start_tls_cluster(tmp_dir: Path) -> TlsCluster:
    """Three members, TLS for clients, auth on (skips where etcd or openssl is missing)."""
    if ETCD is None or shutil.which("openssl") is None:
        pytest.skip("etcd and openssl are needed (Debian: etcd-server, openssl)")
    files = make_certificates(tmp_dir)
    tls_args = ["--cert-file", str(files["server.crt"]), "--key-file", str(files["server.key"]),
                "--trusted-ca-file", str(files["ca.crt"]), "--client-cert-auth"]
    members = start_members(tmp_dir, "m", "https", tls_args)
    cluster = TlsCluster(members, files)
    context = ssl.create_default_context(cafile=str(files["ca.crt"]))
    context.load_cert_chain(str(files["client.crt"]), str(files["client.key"]))
    tls = {"verify": context}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for member in members:
            while True:
                if member.process.poll() is not None:
                    raise RuntimeError(f"etcd exited early:\n{member.log_path.read_text()}")
                try:
                    if httpx.get(f"https://127.0.0.1:{member.client_port}/health", timeout=1,
                                 **tls).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("etcd members not serving in time")
                time.sleep(0.2)
        first = f"https://127.0.0.1:{members[0].client_port}"
        for path, body in (("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/add", {"name": "root", "password": "s3cret"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})):
            reply = httpx.post(first + path, json=body, timeout=5, **tls)
            assert reply.status_code == 200 or "exists" in reply.text, (path, reply.text)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# ---- a member cut off from its cluster's majority ------------------------------------------
@dataclass
class Trio:
    """A plain three-member cluster. `cut_off_first()` SIGSTOPs members 1 and 2: member 0 stays
    alive and reachable, but without a leader, as a member on the small side of a partition."""

    members: list[Etcd]

    @property
    def endpoint(self) -> str:
        """Member 0's."""
        return self.members[0].endpoint

    def cut_off_first(self) -> None:
        """Stop the other two and wait until member 0 answers "no leader"."""
        for member in self.members[1:]:
            member.process.send_signal(signal.SIGSTOP)
        _wait_until(lambda: "no leader" in _put_answer(self.members[0]),
                    "member 0 loses its leader")

    def stop(self) -> None:
        for member in self.members[1:]:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGCONT)
        for member in self.members:
            member.stop()


def start_trio(tmp_dir: Path) -> Trio:
    """Start three members and wait until they serve (skips where etcd is missing)."""
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server; .ci/run does)")
    members = start_members(tmp_dir, "p", "http",
                            ["--heartbeat-interval", "50", "--election-timeout", "500"])
    trio = Trio(members)
    try:
        _wait_until(lambda: all(_serves(m) for m in members), "the three members serve")
    except BaseException:
        trio.stop()
        raise
    return trio


def start_minority_member(tmp_dir: Path) -> Trio:
    """A trio whose member 0 is already cut off."""
    trio = start_trio(tmp_dir)
    try:
        trio.cut_off_first()
    except BaseException:
        trio.stop()
        raise
    return trio


def _serves(member: Etcd) -> bool:
    if member.process.poll() is not None:
        raise RuntimeError(f"etcd exited early:\n{member.log_path.read_text()[-3000:]}")
    try:
        return httpx.get(f"{member.endpoint}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _put_answer(member: Etcd) -> str:
    """The text of a leader-requiring put on the member (its error, or a success)."""
    try:
        return httpx.post(f"{member.endpoint}/v3/kv/put", json={"key": "eA==", "value": ""},
                          headers={"Grpc-Metadata-hasleader": "true"}, timeout=2).text
    except httpx.HTTPError as exc:
        return str(exc)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"etcd: not in {START_TIMEOUT_S}s: {what}")
        time.sleep(0.2)
