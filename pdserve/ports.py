"""Who holds a TCP port: so a role whose bind fails says which process to stop, instead of
a bare "Address already in use".

Linux only (reads /proc/net/tcp{,6} for the listening socket's inode, then /proc/*/fd for
the process that has it open); elsewhere, or for another user's process that /proc does not
show, the message says only that the port is taken.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

_TCP_LISTEN = "0A"  # the `st` column of /proc/net/tcp


@dataclass(frozen=True)
class PortHolder:
    pid: int
    command: str


class PortInUse(OSError):
    """A port some other process already listens on; the message names it where known."""

    def __init__(self, host: str, port: int, holder: PortHolder | None) -> None:
        who = (
            f"process {holder.pid} ({holder.command})" if holder is not None else "another process"
        )
        super().__init__(
            errno.EADDRINUSE,
            f"{host}:{port} is already in use by {who}; stop it or pick another port",
        )
        self.host, self.port, self.holder = host, port, holder

    def __str__(self) -> str:
        return self.strerror


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[str]:
    """Socket inodes listening on `port` (any address, IPv4 or IPv6)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _TCP_LISTEN:
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def port_holder(port: int, proc: Path = Path("/proc")) -> PortHolder | None:
    """The process listening on `port`, if /proc shows it."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    raw = (pid_dir / "cmdline").read_bytes()
                    command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
                    return PortHolder(int(pid_dir.name), command or pid_dir.name)
            except OSError:
                continue
    return None


def check_port_free(host: str, port: int) -> None:
    """Raises PortInUse (naming the holder) when `host:port` cannot be bound for listening.
    Binds with SO_REUSEADDR, as the servers do, so a port in TIME_WAIT reads free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(host, port, port_holder(port)) from None


PORT_ARGUMENTS = ("port", "master_port", "data_port")
"""The flags (argparse dests) by which a role is told which ports to listen on."""


def describe_address_in_use(exc: BaseException, args: dict[str, object]) -> str | None:
    """For a bind that failed with EADDRINUSE (an OSError, or a ZeroMQ error with that errno):
    which of the role's ports (PORT_ARGUMENTS in `args`) is taken, and by whom. None for any
    other error."""
    if getattr(exc, "errno", None) != errno.EADDRINUSE:
        return None
    host = str(args.get("host") or "127.0.0.1")
    if host in ("*", ""):
        host = "0.0.0.0"
    taken = []
    for name in PORT_ARGUMENTS:
        port = args.get(name)
        if isinstance(port, int) and port > 0:
            try:
                check_port_free(host, port)
            except PortInUse as in_use:
                taken.append(str(in_use))
            except OSError:
                continue
    return "; ".join(taken) or f"address already in use ({exc})"
