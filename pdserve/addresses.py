"""The address other hosts reach this one at: what a role advertises (in discovery records,
in the addresses it hands its peers) for the host it binds.

A role bound to one address advertises that address. One bound to every interface (0.0.0.0,
::) advertises this host's routable address: its host name's where that resolves off
loopback, else its first non-loopback interface's, read from the kernel (nothing is sent).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import re
import socket

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


_advertise_as: list[str] = []  # --advertise-address, set once at start (advertise_as)


def advertise_as(host: str | None) -> None:
    """--advertise-address: the host every address this process hands out names, whatever it
    binds (a NAT or a load balancer in front of it). None: derived from the bind."""
    if host is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:-]*|\[[0-9a-fA-F:]+\]",
                                             host):
        raise ValueError(f"--advertise-address must be a host name or an IP address, got "
                         f"{host!r}")
    _advertise_as.clear()
    if host is not None:
        _advertise_as.append(host)
        logger.info("advertising %s (--advertise-address)", host)


def advertised_host(bind_host: str) -> str:
    """The host others reach a socket bound to `bind_host` at: --advertise-address where
    given, else the host itself, or for a wildcard bind (0.0.0.0, ::) this machine's routable
    address (routable_host)."""
    if _advertise_as:
        return _advertise_as[0]
    return routable_host() if bind_host in WILDCARD_HOSTS else bind_host


@functools.cache
def routable_host() -> str:
    """This host's address as other hosts reach it: its hostname's, where that is not a
    loopback one (Debian maps the hostname to 127.0.1.1), else its first interface's that is
    not loopback; loopback only where there is none (said once, as is the choice)."""
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = "127.0.0.1"
    if not ipaddress.ip_address(named).is_loopback:
        logger.info("a wildcard bind advertises %s (this host's name resolves to it)", named)
        return named
    interfaces = interface_addresses()
    if interfaces:
        logger.info("a wildcard bind advertises %s, the first non-loopback interface "
                    "address (the host name resolves to %s); --host ADDRESS picks another",
                    interfaces[0], named)
        return interfaces[0]
    logger.warning("a wildcard bind advertises %s: this host has no interface address other "
                   "hosts can reach", named)
    return named


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces, loopback ones left out, in interface
    order (read from the kernel: nothing is sent anywhere)."""
    import fcntl
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                    struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found.append(address)
    return found


def reachable(address: str) -> str:
    """`address` (tcp://HOST:PORT or http://HOST:PORT) with a wildcard host replaced by the
    advertised one."""
    match = re.fullmatch(r"(\w+)://(.*):(\d+)", address)
    if match is None:
        return address
    scheme, host, port = match.groups()
    return f"{scheme}://{advertised_host(host)}:{port}"


def advertised(bound: str) -> str:
    """tcp://host:port as another host dials it: a wildcard host (0.0.0.0, ::) becomes this
    host's routable address (routable_host)."""
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    return f"tcp://{advertised_host(host)}:{port}"
