"""etcd failover when a member answers but cannot serve (pdserve/etcd.py): a member cut off
from its cluster's majority says "no leader"; the client must move on to the next member, as it
does for a member that does not answer at all. The cut-off member here is real: member 0 of a
three-member cluster whose other two are SIGSTOPped. The healthy member is a second etcd."""

from __future__ import annotations

import pytest
from helpers.etcd_util import start_etcd, start_minority_member, start_trio

from pdserve import etcd
from pdserve.discovery import (
    DiscoveryError,
    DiscoveryURL,
    Record,
    Registration,
    RegistryWatch,
    configure_access,
)

TTL_S = 2.0
WAIT_S = 20.0


@pytest.fixture(scope="module")
def minority(tmp_path_factory):
    member = start_minority_member(tmp_path_factory.mktemp("etcd-minority"))
    yield member
    member.stop()


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    server = start_etcd(tmp_path_factory.mktemp("etcd-healthy"))
    yield server
    server.stop()


def _url(minority, healthy, cluster: str) -> DiscoveryURL:
    """The cut-off member first: every client talks to it first."""
    first, second = (e.removeprefix("http://") for e in (minority.endpoint, healthy.endpoint))
    return DiscoveryURL.parse(f"etcd://{first},{second}/{cluster}")


def test_answers_are_told_apart_as_etcd_gives_them():
    """The bodies etcd's gateway gave here: a cut-off member's, and a request's own error."""
    assert etcd.member_failed(503, {"error": {"grpc_code": 14, "http_code": 503,
                                              "message": "etcdserver: no leader"}})
    assert etcd.member_failed(503, {"error": "etcdserver: request timed out", "code": 14})
    assert etcd.member_failed(500, {"error": "context deadline exceeded", "code": 2})
    assert etcd.member_failed(502, None)  # a proxy in front of a dead member
    assert not etcd.member_failed(404, {"error": "etcdserver: requested lease not found",
                                        "code": 5})
    assert not etcd.member_failed(400, {"error": "bad key", "code": 3})


def test_a_cut_off_member_alone_is_an_error_that_names_it(minority):
    client = etcd.EtcdClient([minority.endpoint])
    with pytest.raises(DiscoveryError, match="no leader"):
        client.put("/pdserve-test/x", b"1")
    client.close()


def _moved_on_no_leader(caplog) -> bool:
    """The client moved on because the member said so, not after a request timed out (the
    member's own answer to a write comes only after 7 s, past the client's timeout)."""
    return any("failed" in r.getMessage() and "no leader" in r.getMessage()
               for r in caplog.records if r.name == "pdserve.etcd")


def test_a_registration_and_a_watch_move_past_a_cut_off_member(minority, healthy, caplog):
    caplog.set_level("WARNING", logger="pdserve.etcd")
    url = _url(minority, healthy, "partition")
    registration = Registration(url, Record("decode", "tcp://127.0.0.1:7101"), TTL_S).start()
    watch = RegistryWatch(url).start()
    try:
        # the watch moved too: a watch kept on the cut-off member would never see an event
        assert watch.wait_for(lambda records: len(records) == 1, WAIT_S), watch.records
        # several TTLs: the keepalive stays on the healthy member and the lease holds
        assert not watch.wait_for(lambda records: not records, 3 * TTL_S)
        late = Registration(url, Record("prefill", "tcp://127.0.0.1:7102"), TTL_S).start()
        assert watch.wait_for(lambda records: len(records) == 2, WAIT_S), watch.records
        late.withdraw()
        registration.withdraw()
        assert watch.wait_for(lambda records: not records, WAIT_S)
    finally:
        watch.stop()
    assert _moved_on_no_leader(caplog)


def test_a_watch_on_a_member_cut_off_mid_run_moves_on(tmp_path, healthy):
    """The watch opened on member 0 while it was healthy; then it is cut off (while the
    member learns it has no leader it may hang rather than answer: a timeout moves on then)."""
    trio = start_trio(tmp_path)
    try:
        url = _url(trio, healthy, "cut-mid-run")
        watch = RegistryWatch(url).start()
        try:
            assert watch.wait_for(lambda records: not records, WAIT_S)
            trio.cut_off_first()
            registered = etcd.EtcdClient([healthy.endpoint])  # the fleet's side of the cut
            key = url.key("decode", "d-0")
            registered.put(key, Record("decode", "tcp://127.0.0.1:7103").to_json())
            assert watch.wait_for(lambda records: len(records) == 1, WAIT_S), watch.records
            registered.delete(key)
            registered.close()
        finally:
            watch.stop()
    finally:
        trio.stop()


def test_an_error_about_the_request_is_raised_at_once_on_the_same_member(minority, healthy):
    client = etcd.EtcdClient([healthy.endpoint, minority.endpoint])
    with pytest.raises(DiscoveryError, match="lease not found"):
        client.put("/pdserve-test/y", b"1", lease_id=12345)
    assert client.endpoint == healthy.endpoint  # not moved: every member would say the same
    assert client.keepalive(12345) == 0  # a lease that is gone is an answer, not a failure
    client.close()


def test_a_password_never_crosses_plain_http_unless_allowed(tmp_path, monkeypatch):
    password = tmp_path / "password"
    password.write_text("s3cret")
    monkeypatch.setattr(etcd, "_ACCESS", etcd.EtcdAccess(password="s3cret"))
    with pytest.raises(ValueError, match="--discovery-allow-plaintext-password"):
        DiscoveryURL.parse("etcd://root@127.0.0.1:2379").client()

    class Args:
        discovery = "etcd://root@127.0.0.1:2379"
        discovery_password_file = str(password)
        discovery_ca_file = discovery_cert_file = discovery_key_file = None
        discovery_allow_plaintext_password = False

    with pytest.raises(ValueError, match="plain HTTP"):
        configure_access(Args())
    Args.discovery_allow_plaintext_password = True
    configure_access(Args())
    assert etcd.access().allow_plaintext_password
    DiscoveryURL.parse("etcd://root@127.0.0.1:2379").client().close()
