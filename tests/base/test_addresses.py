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
