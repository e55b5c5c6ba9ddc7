"""Discovery against etcd as operators run it (pdserve/etcd.py): three members, clients over
TLS with certificates, a user with a password; one member stopped mid-run and nothing
noticed: the registration keeps its lease and the watch sees what is registered after."""

from __future__ import annotations

import pytest
from helpers.etcd_util import start_tls_cluster

from pdserve import etcd
from pdserve.discovery import DiscoveryError, DiscoveryURL, Record, Registration, RegistryWatch

TTL_S = 2.0
WAIT_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_tls_cluster(tmp_path_factory.mktemp("etcd-tls"))
    yield cluster
    cluster.stop()


@pytest.fixture
def access(cluster, monkeypatch):
    files = cluster.files
    granted = etcd.EtcdAccess.from_files(str(files["ca.crt"]), str(files["client.crt"]),
                                         str(files["client.key"]), str(files["password"]))
    monkeypatch.setattr(etcd, "_ACCESS", granted)
    return granted


def test_the_url_names_members_tls_and_user():
    url = DiscoveryURL.parse("etcd+https://root@10.0.0.1:2379,10.0.0.2:2379,[::1]:2379/prod")
    assert url.endpoints == ["https://10.0.0.1:2379", "https://10.0.0.2:2379",
                             "https://[::1]:2379"]
    assert (url.user, url.cluster, url.tls) == ("root", "prod", True)
    assert DiscoveryURL.parse(str(url)) == url
    for bad in ("etcd+http://h:1", "etcd://h:1,", "etcd://h:1,h", "etcd://a b@h:1"):
        with pytest.raises(ValueError, match="etcd"):
            DiscoveryURL.parse(bad)
    with pytest.raises(ValueError, match="go together"):
        etcd.EtcdAccess.from_files(None, "/etc/hostname", None, None)
    with pytest.raises(ValueError, match="no such file"):
        etcd.EtcdAccess.from_files("/nonexistent/ca.crt", None, None, None)


def test_a_fleet_survives_a_member_stopped_mid_run(cluster, access):
    url = DiscoveryURL.parse(cluster.url("tls"))
    registration = Registration(url, Record("decode", "tcp://127.0.0.1:7101"), TTL_S).start()
    watch = RegistryWatch(url).start()
    try:
        assert watch.wait_for(lambda records: len(records) == 1, WAIT_S)
        cluster.members[0].stop()  # the member every client talked to first
        # past several TTLs: the keepalive moved to another member and kept the lease
        assert not watch.wait_for(lambda records: not records, 3 * TTL_S)
        late = Registration(url, Record("prefill", "tcp://127.0.0.1:7102"), TTL_S).start()
        assert watch.wait_for(lambda records: len(records) == 2, WAIT_S), watch.records
        late.withdraw()
        registration.withdraw()
        assert watch.wait_for(lambda records: not records, WAIT_S)
    finally:
        watch.stop()


def test_wrong_or_missing_credentials_are_refused(cluster, access, monkeypatch):
    url = DiscoveryURL.parse(cluster.url("refused"))
    monkeypatch.setattr(etcd, "_ACCESS", etcd.EtcdAccess(access.ca_file, access.cert_file,
                                                          access.key_file, "wrong"))
    client = url.client()
    with pytest.raises(DiscoveryError):
        client.range_prefix(url.prefix())
    client.close()
    monkeypatch.setattr(etcd, "_ACCESS", etcd.EtcdAccess(access.ca_file, access.cert_file,
                                                          access.key_file, None))
    with pytest.raises(ValueError, match="password"):
        url.client()
    anonymous = DiscoveryURL.parse(cluster.url("refused").replace("root@", ""))
    client = anonymous.client()  # its certificate's name is no user of etcd's
    with pytest.raises(DiscoveryError):
        client.range_prefix(url.prefix())
    client.close()
