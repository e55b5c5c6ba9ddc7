"""What a role advertises for the host it binds (pdserve/addresses.py): never a loopback
address where another host could reach this one."""

from __future__ import annotations

import pytest

from pdserve import addresses


@pytest.fixture
def fresh_routable_host():
    addresses.routable_host.cache_clear()
    yield
    addresses.routable_host.cache_clear()


def test_a_wildcard_bind_never_advertises_loopback_where_an_interface_is_reachable(
        monkeypatch, caplog, fresh_routable_host):
    """Debian maps the host name to 127.0.1.1: a role bound to 0.0.0.0 must still advertise
    an address other hosts reach, and say which."""
    monkeypatch.setattr(addresses.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(addresses, "interface_addresses", lambda: ["192.0.2.7", "10.0.0.4"])
    with caplog.at_level("INFO", logger="pdserve.addresses"):
        assert addresses.advertised_host("0.0.0.0") == "192.0.2.7"
        assert addresses.reachable("tcp://0.0.0.0:8100") == "tcp://192.0.2.7:8100"
    assert "192.0.2.7" in caplog.text and "127.0.1.1" in caplog.text
    assert addresses.advertised_host("10.9.8.7") == "10.9.8.7"  # an explicit host as given


def test_a_resolving_host_name_is_advertised_and_no_interface_means_a_warning(
        monkeypatch, caplog, fresh_routable_host):
    monkeypatch.setattr(addresses.socket, "gethostbyname", lambda name: "192.0.2.9")
    assert addresses.advertised_host("::") == "192.0.2.9"
    addresses.routable_host.cache_clear()
    monkeypatch.setattr(addresses.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(addresses, "interface_addresses", lambda: [])
    with caplog.at_level("WARNING", logger="pdserve.addresses"):
        assert addresses.advertised_host("0.0.0.0") == "127.0.1.1"
    assert "no interface address" in caplog.text


def test_interface_addresses_are_read_without_loopback():
    import ipaddress

    found = addresses.interface_addresses()
    assert all(not ipaddress.ip_address(a).is_loopback for a in found)


def test_an_advertised_address_names_every_address_handed_out(fresh_routable_host) -> None:
    try:
        addresses.advertise_as("10.1.2.3")
        assert addresses.advertised_host("0.0.0.0") == "10.1.2.3"
        assert addresses.reachable("tcp://127.0.0.1:8100") == "tcp://10.1.2.3:8100"
    finally:
        addresses.advertise_as(None)
    assert addresses.advertised_host("10.9.8.7") == "10.9.8.7"
    with pytest.raises(ValueError, match="--advertise-address"):
        addresses.advertise_as("not a host!")


def test_a_role_given_a_bad_advertised_address_exits_with_a_clear_error() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "store",
                           "--advertise-address", "bad host", "--insecure-plaintext"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--advertise-address must be a host name or an IP address" in done.stderr
    assert "Traceback" not in done.stderr
