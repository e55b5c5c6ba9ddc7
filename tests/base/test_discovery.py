"""pdserve/discovery.py against a real etcd: records, registrations under leases, watches."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers.etcd_util import start_etcd

from pdserve import discovery
from pdserve.discovery import (
    Compacted,
    DiscoveryURL,
    EtcdClient,
    Record,
    RecordError,
    Registration,
    RegistryWatch,
)

TTL_S = 2.0
WAIT_S = 15.0  # every wait below is bounded; a lease of TTL_S expires well within it


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


def _decode_record(port: int, role: str = "decode") -> Record:
    return Record(role, f"tcp://127.0.0.1:{port}", name=f"{role}-{port}", model="tiny",
                  kv_layout={"dtype": "float32", "block_size": 16, "num_layers": 2,
                             "num_kv_heads": 2, "head_dim": 16, "kind": "mha"},
                  tensor_parallel_size=1, capacity={"num_kv_blocks": 256, "max_num_seqs": 8})


def _addresses(records: dict[str, Record]) -> set[str]:
    return {r.address for r in records.values()}


# ---- without etcd ------------------------------------------------------------------------
def test_discovery_url_parses_host_port_and_cluster():
    url = DiscoveryURL.parse("etcd://10.0.0.5:2379/prod")
    assert (url.host, url.port, url.cluster) == ("10.0.0.5", 2379, "prod")
    assert url.endpoint == "http://10.0.0.5:2379"
    assert url.key("decode", "10.0.0.7:7000") == "/pdserve/prod/decode/10.0.0.7:7000"
    assert DiscoveryURL.parse("etcd://etcd:2379").cluster == "default"
    for bad in ("http://h:1", "etcd://h", "etcd://h:0", "etcd://h:1/a/b", "etcd://h:1/bad name"):
        with pytest.raises(ValueError, match="etcd://|port|cluster"):
            DiscoveryURL.parse(bad)


def test_record_round_trips_and_rejects_malformed_values():
    record = _decode_record(7000)
    assert Record.from_json(record.to_json()) == record
    assert record.record_id == "127.0.0.1:7000"
    good = json.loads(record.to_json())
    for bad in (b"{nope", b"[1, 2]", json.dumps({**good, "role": "wizard"}).encode(),
                json.dumps({**good, "address": "somewhere"}).encode(),
                json.dumps({**good, "capacity": {"blocks": "many"}}).encode(),
                json.dumps({**good, "tensor_parallel_size": 0}).encode(),
                json.dumps({**good, "surprise": 1}).encode(),
                json.dumps({"role": "decode"}).encode()):
        with pytest.raises(RecordError):
            Record.from_json(bad)


# ---- against etcd ------------------------------------------------------------------------
def test_register_update_withdraw_as_a_watch_sees_them(etcd):
    url = DiscoveryURL.parse(etcd.url("watch"))
    changes: list[set[str]] = []
    watch = RegistryWatch(url, on_change=lambda records: changes.append(_addresses(records)))
    watch.start()
    try:
        assert watch.wait_for(lambda records: watch.is_synced, WAIT_S)
        registration = Registration(url, _decode_record(7001), TTL_S).start()
        key = "/pdserve/watch/decode/127.0.0.1:7001"
        assert watch.wait_for(lambda records: key in records, WAIT_S)
        assert watch.records[key] == _decode_record(7001)  # every field as registered
        # A role flip moves the key with the role (the old one is deleted).
        registration.update(_decode_record(7001, role="prefill"))
        flipped = "/pdserve/watch/prefill/127.0.0.1:7001"
        assert watch.wait_for(lambda records: set(records) == {flipped}, WAIT_S)
        registration.withdraw()  # the lease is revoked: the key goes at once
        assert watch.wait_for(lambda records: not records, WAIT_S)
        registration.withdraw()  # twice is harmless
    finally:
        watch.stop()
    assert {"tcp://127.0.0.1:7001"} in changes and changes[-1] == set()


def test_keepalive_holds_a_record_past_its_ttl(etcd):
    url = DiscoveryURL.parse(etcd.url("keep"))
    registration = Registration(url, _decode_record(7002), TTL_S).start()
    watch = RegistryWatch(url).start()
    try:
        # Three TTLs pass: only the keepalive keeps the key (the watch would see it go).
        assert not watch.wait_for(lambda records: watch.is_synced and not records,
                                  3 * TTL_S)
        assert _addresses(watch.records) == {"tcp://127.0.0.1:7002"}
    finally:
        registration.withdraw()
        watch.stop()


def test_a_killed_process_leaves_the_registry_when_its_lease_expires(etcd, tmp_path):
    url = DiscoveryURL.parse(etcd.url("kill"))
    code = textwrap.dedent(f"""
        import time
        from pdserve.discovery import DiscoveryURL, Record, Registration
        url = DiscoveryURL.parse({etcd.url("kill")!r})
        Registration(url, Record("decode", "tcp://127.0.0.1:7003"), {TTL_S}).start()
        print("registered", flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    watch = RegistryWatch(url).start()
    try:
        assert process.stdout.readline().strip() == "registered"
        assert watch.wait_for(lambda records: len(records) == 1, WAIT_S)
        process.kill()  # no revoke: only the lease's expiry removes the key
        process.wait(10)
        assert watch.wait_for(lambda records: not records, WAIT_S), watch.records
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        watch.stop()


def test_malformed_values_are_skipped_and_the_watch_goes_on(etcd, caplog):
    url = DiscoveryURL.parse(etcd.url("bad"))
    client = EtcdClient(url.endpoint)
    good = _decode_record(7004)
    client.put(url.prefix("decode") + "junk", b"\xff{not json")
    client.put(url.prefix("prefill") + "127.0.0.1:7004", good.to_json())  # wrong role's key
    watch = RegistryWatch(url).start()
    try:
        assert watch.wait_for(lambda records: watch.is_synced, WAIT_S)
        assert watch.records == {}
        client.put(url.prefix("decode") + "late-junk", json.dumps({"role": "decode"}).encode())
        client.put(url.key("decode", good.record_id), good.to_json())
        assert watch.wait_for(lambda records: _addresses(records) == {good.address}, WAIT_S)
        # A valid record overwritten by garbage is gone from the view, not kept stale.
        client.put(url.key("decode", good.record_id), b"garbage")
        assert watch.wait_for(lambda records: not records, WAIT_S)
    finally:
        watch.stop()
        client.close()
    assert "malformed registry record" in caplog.text


def test_a_watch_starts_over_from_a_fresh_read_after_compaction(etcd, monkeypatch):
    url = DiscoveryURL.parse(etcd.url("compact"))
    client = EtcdClient(url.endpoint)
    for port in (7005, 7006):
        client.put(url.key("decode", f"127.0.0.1:{port}"), _decode_record(port).to_json())
    revision, _ = client.range_prefix(url.prefix())
    client._call("/v3/kv/compaction", {"revision": str(revision)})
    with pytest.raises(Compacted):
        list(client.watch(url.prefix(), 1))
    # The watch's first read claims an old revision: its watch from there is compacted away,
    # so it must read again and go on from the fresh revision.
    real_range, calls = EtcdClient.range_prefix, []

    def stale_range(self, prefix):
        revision, entries = real_range(self, prefix)
        calls.append(revision)
        return (1 if len(calls) == 1 else revision), entries

    monkeypatch.setattr(EtcdClient, "range_prefix", stale_range)
    watch = RegistryWatch(url).start()
    try:
        assert watch.wait_for(lambda records: len(calls) >= 2, WAIT_S), calls
        client.put(url.key("decode", "127.0.0.1:7007"), _decode_record(7007).to_json())
        assert watch.wait_for(lambda records: len(records) == 3, WAIT_S), watch.records
    finally:
        watch.stop()
        client.close()


def test_a_watch_from_a_revision_replays_what_happened_since(etcd):
    """What a reconnecting watch relies on: asked from revision r, etcd sends every event
    from r on, those that happened while no watch was open included."""
    url = DiscoveryURL.parse(etcd.url("replay"))
    client = EtcdClient(url.endpoint)
    try:
        first = client.put(url.key("decode", "127.0.0.1:7008"), _decode_record(7008).to_json())
        client.put(url.key("decode", "127.0.0.1:7009"), _decode_record(7009).to_json())
        client.delete(url.key("decode", "127.0.0.1:7008"))
        events = list(client.watch(url.prefix(), first, idle_s=1.0))
    finally:
        client.close()
    assert [(e.kind, e.key.rsplit("/", 1)[1]) for e in events] == [
        ("put", "127.0.0.1:7008"), ("put", "127.0.0.1:7009"), ("delete", "127.0.0.1:7008")]
    assert [e.revision for e in events] == [first, first + 1, first + 2]


def test_a_watch_survives_a_stalled_etcd(etcd):
    """etcd stops answering (SIGSTOP) for longer than the watch's idle limit and the request
    timeout: the watch retries, and once etcd is back it follows the registry again."""
    url = DiscoveryURL.parse(etcd.url("stall"))
    watch = RegistryWatch(url).start()
    client = EtcdClient(url.endpoint)
    try:
        client.put(url.key("decode", "127.0.0.1:7011"), _decode_record(7011).to_json())
        assert watch.wait_for(lambda records: len(records) == 1, WAIT_S)
        etcd.process.send_signal(signal.SIGSTOP)
        try:
            assert not watch.wait_for(lambda records: len(records) != 1,
                                      discovery.REQUEST_TIMEOUT_S + discovery.WATCH_IDLE_S)
        finally:
            etcd.process.send_signal(signal.SIGCONT)
        client.put(url.key("decode", "127.0.0.1:7012"), _decode_record(7012).to_json())
        client.delete(url.key("decode", "127.0.0.1:7011"))
        assert watch.wait_for(lambda records: _addresses(records) == {"tcp://127.0.0.1:7012"},
                              WAIT_S), watch.records
    finally:
        watch.stop()
        client.close()


def test_find_waits_for_a_role_and_gives_up_empty(etcd):
    url = DiscoveryURL.parse(etcd.url("find"))
    assert discovery.find(url, "store-data", 0.3) == []
    record = Record("store-data", "tcp://127.0.0.1:7010", name="store-0",
                    capacity={"dram_blocks": 64})
    registration = Registration(url, record, TTL_S).start()
    try:
        assert discovery.find(url, "store-data", WAIT_S) == [record]
    finally:
        registration.withdraw()
    with pytest.raises(discovery.DiscoveryError, match="unreachable"):
        discovery.check_reachable(DiscoveryURL.parse("etcd://127.0.0.1:1"))


# ---- the router's view (pdserve/router/fleet_watch.py), in process
# -----------------------------------
def test_the_router_applies_the_registry_to_its_pools(etcd):
    """Through the registry: joins go to the pool of their role, a record's new role moves
    the worker, a departed worker leaves its pool at once and its client closes once it holds
    nothing, a static worker stays, and prefix lookups follow the registered store master."""
    import asyncio

    from pdserve.router.config import RouterConfig
    from pdserve.router.dispatch import Dispatcher

    url = DiscoveryURL.parse(etcd.url("pools"))
    client = EtcdClient(url.endpoint)

    def put(role: str, port: int) -> None:
        record = (_decode_record(port, role) if role in discovery.WORKER_ROLES
                  else Record(role, f"tcp://127.0.0.1:{port}"))
        client.put(url.key(role, record.record_id), record.to_json())

    def delete(role: str, port: int) -> None:
        client.delete(url.key(role, f"127.0.0.1:{port}"))

    async def until(predicate) -> None:
        for _ in range(int(WAIT_S / 0.05)):
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the router's pools did not follow the registry")

    def addresses(pool) -> list[int]:
        return [int(w.address.rsplit(":", 1)[1]) for w in pool]

    async def walk() -> None:
        config = RouterConfig(model="tiny", discovery=str(url),
                              decode_addrs=("tcp://127.0.0.1:7100",))
        dispatcher = Dispatcher(config)
        dispatcher.start()
        view = dispatcher.fleet_watch
        try:
            assert dispatcher.is_disaggregated  # a static decode worker
            put("prefill", 7101)
            put("decode", 7102)
            put("store-master", 7103)
            await until(lambda: addresses(dispatcher.decode) == [7100, 7102]
                        and addresses(dispatcher.prefill) == [7101]
                        and dispatcher.store_lookup is not None)
            moving = dispatcher.decode[1]
            moving.reserve("in-flight")  # it holds a request: its client must stay open
            put("prefill", 7102)  # a role flip moves its key (put the new, delete the old)
            delete("decode", 7102)
            await until(lambda: addresses(dispatcher.prefill) == [7101, 7102])
            assert addresses(dispatcher.decode) == [7100] and moving.role == "prefill"
            delete("prefill", 7102)
            delete("store-master", 7103)
            await until(lambda: addresses(dispatcher.prefill) == [7101]
                        and dispatcher.store_lookup is None)
            assert moving.draining and view.snapshot()["leaving"] == ["tcp://127.0.0.1:7102"]
            await asyncio.sleep(0.3)
            assert view.snapshot()["leaving"] == ["tcp://127.0.0.1:7102"]  # still held
            moving.finish("in-flight")
            await until(lambda: view.snapshot()["leaving"] == [])
            assert addresses(dispatcher.decode) == [7100]  # static: never dropped
            assert (view.num_joined, view.num_left) == (2, 1)
            assert await asyncio.to_thread(discovery.find, url, "router", WAIT_S)  # itself
        finally:
            await dispatcher.close()

    try:
        asyncio.run(walk())
        assert discovery.find(url, "router", 0) == []  # withdrawn on close
    finally:
        client.close()

