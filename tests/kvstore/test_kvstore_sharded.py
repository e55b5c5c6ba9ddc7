"""A store that spans data nodes: the master places blocks (spread by fill, `replicas`
distinct holders), lookups name holders, clients read from a holder and fall over to the
next, and a node that leaves (goodbye or SIGKILL) loses only its blocks: misses, never a
failed request. Real sockets on 127.0.0.1: in-process StoreServers where nothing is killed,
`pdserve store --role data` processes where one is, and in-process Worker loops (real
engines, real ZeroMQ) whose prefill and decode sides are attached to different nodes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq
from helpers.cluster_util import free_port_block, wait_until
from helpers.engine_util import run_to_completion, token_ids
from helpers.worker_util import (
    BLOCK,
    assert_worker_idle,
    collect,
    dealer_sockets,
    make_engine,
    stop_workers,
)

from pdserve.kvstore.channel import StoreUnavailable
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.fleet_client import FleetClient, connect_store
from pdserve.kvstore.master import Master, Usage
from pdserve.kvstore.server import StoreServer
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import GenerateRequest

TTL_S = 1.5  # a killed node leaves the index this long after its last report
BEAT_S = 0.2


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, num_bytes: int = 512) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, num_bytes, dtype=np.uint8)


# ---- the master's placement, on a fake clock ------------------------------------------------
def test_placement_spreads_by_fill_deterministically_with_distinct_replicas():
    clock = FakeClock()
    master = Master(node_ttl_s=10, clock=clock)
    master.join("b", "tcp://b", Usage(capacity_blocks=8, num_blocks=0, num_bytes=0))
    master.join("a", "tcp://a", Usage(capacity_blocks=8, num_blocks=0, num_bytes=0))
    targets, held, addresses = master.place([key(i) for i in range(4)])
    assert targets == [["a"], ["b"], ["a"], ["b"]] and held == [False] * 4
    assert addresses == {"a": "tcp://a", "b": "tcp://b"}
    # a reports 6 of 8 held, b 0 of 8: the next ones all go to b until it is as full
    master.heartbeat("a", Usage(8, 6, 6 * 512))
    master.heartbeat("b", Usage(8, 2, 2 * 512))
    targets, _, _ = master.place([key(i) for i in range(10, 16)])
    assert targets == [["b"], ["b"], ["b"], ["b"], ["a"], ["b"]]
    # a bigger node takes proportionally more; a key already held is not written again
    master.join("c", "tcp://c", Usage(capacity_blocks=32, num_blocks=0, num_bytes=0))
    master.update("a", [(key(0), "dram")])
    targets, held, _ = master.place([key(0), *[key(i) for i in range(20, 28)]])
    assert targets[0] == [] and held[0] and not any(held[1:])
    assert sum(t == ["c"] for t in targets) == 8  # c is still far emptier than a and b
    # replicas: distinct nodes, never more than live ones
    two = Master(node_ttl_s=10, clock=clock, replicas=2)
    two.join("a", "tcp://a", Usage(8, 0, 0))
    two.join("b", "tcp://b", Usage(8, 0, 0))
    two.join("c", "tcp://c", Usage(8, 0, 0))
    targets, _, _ = two.place([key(1), key(2), key(3), key(1)])
    assert [sorted(t) for t in targets] == [["a", "b"], ["a", "c"], ["b", "c"], []]
    two.leave("c")
    two.leave("b")
    assert two.place([key(9)])[0] == [["a"]]
    two.leave("a")
    assert two.place([key(9)])[0] == [[]]  # no live node: nothing to write to


def test_placement_takes_the_least_full_nodes_as_a_full_sort_would():
    """place() keeps the nodes in a heap; the reference sorts every node for every key."""
    rng = np.random.default_rng(7)
    for replicas in (1, 2, 3):
        nodes = {f"n{i}": [int(rng.integers(1, 64)), 0] for i in range(9)}  # capacity, held
        master = Master(node_ttl_s=10, clock=FakeClock(), replicas=replicas)
        for name, (capacity, _) in nodes.items():
            held = int(rng.integers(0, capacity))
            nodes[name][1] = held
            master.join(name, f"tcp://{name}", Usage(capacity, held, 0))
        placed = dict.fromkeys(nodes, 0)
        expected = []
        for _ in range(200):
            order = sorted(nodes, key=lambda n: ((nodes[n][1] + placed[n]) / nodes[n][0],
                                                 placed[n], n))
            expected.append(order[:replicas])
            for name in order[:replicas]:
                placed[name] += 1
        targets, _, _ = master.place([key(i) for i in range(200)])
        assert targets == expected


def test_an_indexed_block_costs_its_slots_not_a_holder_map():
    """A million blocks are a few hundred MiB of master RSS: each block's holders must be a
    shared object (a dict per block alone was 184 bytes)."""
    import tracemalloc

    master = Master(node_ttl_s=10, clock=FakeClock())
    for name in ("a", "b"):
        master.join(name, f"tcp://{name}", Usage(1 << 20, 0, 0))
    keys = [key(i) for i in range(20_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    master.update("a", [(k, "dram") for k in keys[::2]])
    master.update("b", [(k, "dram") for k in keys[1::2]])
    master.update("a", [(k, "disk") for k in keys[:100:2]])  # tier changes, another holder
    master.update("b", [(k, "disk") for k in keys[:100:2]])
    per_block = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    tracemalloc.stop()
    assert per_block < 160, f"{per_block:.0f} bytes per indexed block"
    assert master.locate([keys[0], keys[1]])[0] == [[("a", "disk"), ("b", "disk")],
                                                   [("b", "dram")]]
    master.update("a", [(keys[0], None)])
    master.leave("b")
    assert master.locate([keys[0], keys[1], keys[200]])[0] == [[], [], [("a", "dram")]]
    master.check_integrity()


def test_holders_lease_groups_and_per_node_stats():
    clock = FakeClock()
    master = Master(node_ttl_s=10, clock=clock, replicas=2)
    master.join("a", "tcp://a", Usage(8, 0, 0))
    master.join("b", "tcp://b", Usage(16, 0, 0))
    master.update("a", [(key(1), "disk"), (key(2), "dram")])
    master.update("b", [(key(1), "dram")])
    holders, addresses = master.locate([key(1), key(3), key(2)])
    assert holders == [[("b", "dram"), ("a", "disk")], [], [("a", "dram")]]
    assert addresses == {"a": "tcp://a", "b": "tcp://b"}
    group = master.add_lease_group([("a", 11), ("b", 12)], ttl_s=5)
    master.leave("b")  # its lease died with it
    assert master.take_lease_group(group) == (True, [("a", 11)], {"a": "tcp://a"})
    assert master.take_lease_group(group) == (False, [], {})
    master.add_lease_group([("a", 13)], ttl_s=5)
    clock.now_s = 6
    master.heartbeat("a", Usage(8, 2, 1024))
    master.expire_nodes()
    assert master.num_lease_groups == 0  # expired, as the node leases inside it did
    stats = master.stats()
    assert stats["num_nodes"] == 1 and stats["replicas"] == 2
    assert stats["capacity_blocks.a"] == 8 and stats["num_bytes.a"] == 1024
    assert stats["num_indexed.a"] == 2 and stats["num_node_bytes"] == 1024
    master.check_integrity()


# ---- in-process servers ---------------------------------------------------------------------
@pytest.fixture
def make_server():
    servers: list[StoreServer] = []

    def make(**overrides) -> StoreServer:
        config = StoreConfig(**{"master_port": 0, "data_port": 0, "transport": "zmq",
                                "request_timeout_s": 5.0, "node_ttl_s": TTL_S,
                                "heartbeat_interval_s": BEAT_S, **overrides})
        servers.append(StoreServer(config).start())
        return servers[-1]

    yield make
    for server in reversed(servers):  # data nodes first: their goodbye reaches the master
        server.stop()


def _all_indexed(master: StoreServer, num_blocks: int) -> bool:
    return wait_until(lambda: master.master.num_blocks >= num_blocks, 10)


def test_blocks_written_through_one_node_are_read_through_another(make_server):
    master = make_server(role="master")
    a = make_server(role="data", master_address=master.master_address, node_id="a")
    b = make_server(role="data", master_address=master.master_address, node_id="b")
    assert wait_until(lambda: len(master.master.nodes()) == 2, 10)
    # each client is pointed at one data node only: node_info names the fleet's master
    writer = connect_store(a.data_address, transport="zmq", timeout_s=5)
    reader = connect_store(b.data_address, transport="zmq", timeout_s=5)
    assert isinstance(writer, FleetClient) and writer.master_address == master.master_address
    keys, blocks = [key(i) for i in range(8)], [block(i) for i in range(8)]
    assert writer.put_many(keys, blocks) == [True] * 8
    assert _all_indexed(master, 8)
    # spread evenly over both nodes, one copy each
    assert a.store.stats()["num_blocks_dram"] == 4 and b.store.stats()["num_blocks_dram"] == 4
    got = reader.get_many([*keys, key(99)])
    assert all(np.array_equal(g, b_) for g, b_ in zip(got, blocks, strict=False))
    assert got[-1] is None
    # the router's lookup (a master-only client) sees the whole prefix, with holders
    router = StoreClient(None, master.master_address, transport="zmq", timeout_s=5)
    found = router.lookup_prefix([*keys, key(99)])
    assert found.num_blocks == 8 and {h[0][0] for h in found.holders} == {"a", "b"}
    assert writer.put_many(keys[:2], blocks[:2]) == [True, True]  # held: not written again
    assert a.store.stats()["num_blocks_dram"] + b.store.stats()["num_blocks_dram"] == 8
    # status: per-node capacity and bytes at the master
    assert wait_until(lambda: writer.stats().get("num_bytes.a") == 4 * 512, 10)
    stats = writer.stats()
    assert stats["capacity_blocks.a"] == stats["capacity_blocks.b"] == 4096
    assert stats["num_bytes.b"] == 4 * 512 and stats["num_node_blocks"] == 8
    assert writer.usage()["a"].num_blocks == 4
    # a fleet lease pins every copy; released by another client, by its id alone
    lease_id, pinned = writer.pin(keys, ttl_s=30)
    assert pinned == [True] * 8
    assert a.store.num_pinned_blocks == 4 and b.store.num_pinned_blocks == 4
    assert reader.release(lease_id) and not reader.release(lease_id)
    assert a.store.num_pinned_blocks == b.store.num_pinned_blocks == 0
    # a graceful goodbye: b's blocks leave the index at once and become misses
    b.stop()
    assert wait_until(lambda: master.master.nodes() == {"a": a.data_address}, 5)
    got = writer.get_many(keys)
    assert sum(g is not None for g in got) == 4  # a's half, read as before; b's: misses
    assert writer.lookup_prefix(keys).num_blocks < 8
    assert writer.put_many([key(50)], [block(50)]) == [True]  # placed on a, the only one
    for client in (writer, reader):
        client.check_integrity()
        client.close()
    router.close()
    assert a.leases.num_leases == 0 and a.store.num_pinned_blocks == 0
    assert master.master.num_lease_groups == 0
    master.check_integrity()


def test_a_node_alone_and_a_node_whose_master_is_itself(make_server):
    alone = make_server(role="data", node_id="solo")
    client = connect_store(alone.data_address, transport="zmq", timeout_s=5)
    assert isinstance(client, StoreClient)  # no master: the one node, as before
    assert client.put_many([key(1)], [block(1)]) == [True]
    client.close()
    both = make_server(role="all")
    client = connect_store(both.data_address, transport="zmq", timeout_s=5)
    assert isinstance(client, FleetClient) and client.master_address == both.master_address
    assert client.put_many([key(1), key(2)], [block(1), block(2)]) == [True, True]
    assert np.array_equal(client.get_many([key(2)])[0], block(2))
    assert client.lookup_prefix([key(1), key(2)]).num_blocks == 2
    client.close()


def test_fleet_reads_and_writes_over_ucx(make_server):
    pytest.importorskip("ucxx")
    master = make_server(role="master")
    nodes = [make_server(role="data", master_address=master.master_address, node_id=n,
                         transport="ucx") for n in ("a", "b")]
    assert wait_until(lambda: len(master.master.nodes()) == 2, 10)
    client = FleetClient(master.master_address, transport="ucx", timeout_s=10)
    blocks = [block(i, 70_000) for i in range(4)]  # above UCX's eager threshold too
    assert client.put_many([key(i) for i in range(4)], blocks) == [True] * 4
    assert _all_indexed(master, 4)
    assert all(n.store.stats()["num_blocks_dram"] == 2 for n in nodes)
    got = client.get_many([key(i) for i in range(4)])
    assert all(np.array_equal(g, b) for g, b in zip(got, blocks, strict=True))
    assert {c.transport for c in client._nodes.values()} == {"ucx"}
    client.check_integrity()
    client.close()


# ---- data-node processes, killed -------------------------------------------------------------
class DataNodes:
    """`pdserve store --role data` processes reporting to an in-process master."""

    def __init__(self, tmp_path, master_address: str, count: int) -> None:
        base = free_port_block(count)
        self.addresses = {f"n{i}": f"tcp://127.0.0.1:{base + i}" for i in range(count)}
        self.processes = {}
        for i, node_id in enumerate(self.addresses):
            log = open(tmp_path / f"{node_id}.log", "wb")
            self.processes[node_id] = subprocess.Popen(
                [sys.executable, "-m", "pdserve.app.cli", "store", "--role", "data",
                 "--master-address", master_address, "--data-port", str(base + i),
                 "--node-id", node_id, "--transport", "zmq", "--node-ttl-s", str(TTL_S),
                 "--heartbeat-interval-s", str(BEAT_S)],
                stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, PDSERVE_INSECURE_PLAINTEXT="1"))

    def kill(self, node_id: str) -> None:
        self.processes[node_id].kill()
        self.processes[node_id].wait(10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@pytest.fixture
def fleet(make_server, tmp_path):
    """An in-process master and two data-node processes, n0 and n1; (master, nodes)."""
    holder: dict = {}

    def start(replicas: int = 1, num_nodes: int = 2) -> tuple[StoreServer, DataNodes]:
        master = make_server(role="master", replicas=replicas)
        nodes = holder["nodes"] = DataNodes(tmp_path, master.master_address, num_nodes)
        assert wait_until(lambda: len(master.master.nodes()) == num_nodes, 60), \
            "nodes did not join"
        return master, nodes

    yield start
    if "nodes" in holder:
        holder["nodes"].stop()


def test_a_master_that_does_not_answer_is_held_off_then_asked_again():
    """A master that timed out is not asked again for master_hold_s: each verb that needs it
    meanwhile fails at once (a miss), so a worker's loop waits out one timeout per hold, not
    one per request; once the hold ends it is asked again."""
    port = free_port_block(1)  # nothing listens there: every request times out
    client = FleetClient(f"tcp://127.0.0.1:{port}", transport="zmq", timeout_s=0.2,
                         master_hold_s=3600)
    asked = []
    real_request = client._master.request

    def counting(*args, **kwargs):
        asked.append(args[0].__name__)
        return real_request(*args, **kwargs)

    client._master.request = counting
    try:
        keys = [b"k" * 32]
        with pytest.raises(StoreUnavailable):
            client.lookup_prefix(keys)
        for verb in (lambda: client.lookup_prefix(keys), lambda: client.get_many(keys),
                     lambda: client.put_many(keys, [b"x"]), lambda: client.release(1)):
            with pytest.raises(StoreUnavailable, match="not asked again"):
                verb()
        assert asked == ["LookupPrefixRequest"]
        client.master_hold_s = 0.0  # the hold is over
        with pytest.raises(StoreUnavailable):
            client.nodes()
        assert asked == ["LookupPrefixRequest", "NodesRequest"]
    finally:
        client.close()


def test_with_two_replicas_a_read_survives_killing_a_holder(fleet):
    master, nodes = fleet(replicas=2)
    client = connect_store(nodes.addresses["n1"], transport="zmq", timeout_s=1.0)
    keys, blocks = [key(i) for i in range(6)], [block(i) for i in range(6)]
    assert client.put_many(keys, blocks) == [True] * 6
    assert wait_until(lambda: all(len(h) == 2 for h in master.master.locate(keys)[0]), 10)
    nodes.kill("n1")  # the client's home node, first in its read order
    got = client.get_many(keys)  # n1 fails (timeout): every block from its other holder
    assert all(np.array_equal(g, b) for g, b in zip(got, blocks, strict=True))
    assert client.is_held_off(nodes.addresses["n1"])
    # n1's reports stopped: the master drops it within its TTL, and its copies with it
    assert wait_until(lambda: list(master.master.nodes()) == ["n0"], 10)
    assert all(h == [("n0", "dram")] for h in master.master.locate(keys)[0])
    assert client.put_many([key(7)], [block(7)]) == [True]  # one live node: one copy
    client.check_integrity()
    stats = StoreClient(nodes.addresses["n0"], transport="zmq").stats()
    assert stats["num_leases"] == 0 and stats["num_pinned"] == 0
    client.close()
    master.check_integrity()


def test_the_master_plans_copies_when_a_holder_leaves():
    clock = FakeClock()
    master = Master(node_ttl_s=10, clock=clock, replicas=2)
    for node_id in ("a", "b", "c"):
        master.join(node_id, f"tcp://{node_id}", Usage(8, 0, 0))
    master.update("a", [(key(1), "dram"), (key(2), "dram")])
    master.update("b", [(key(1), "dram"), (key(2), "dram")])
    master.update("c", [(key(3), "dram")])
    master.leave("b")  # keys 1 and 2 fall to one holder (a); key 3 never had two
    assert master.num_copies_pending == 2
    assert master.take_copies("c") == []
    assert sorted(master.take_copies("a")) == [(key(1), "tcp://c"), (key(2), "tcp://c")]
    master.update("c", [(key(1), "dram"), (key(2), "dram")])  # c's report indexes them
    assert all(len(h) == 2 for h in master.locate([key(1), key(2)])[0])
    master.leave("c")  # a copy whose target left meanwhile is not handed out
    master.join("d", "tcp://d", Usage(8, 0, 0))
    master.leave("d")
    assert master.take_copies("a") == []
    master.check_integrity()


def test_a_node_that_joins_gets_copies_of_what_fell_under_replicas_once_settled():
    """Both holders but a left while no third node was there: nothing to copy to. A node that
    joins (a restarted one) receives those copies once it has been in for node_ttl_s (its
    own inventory in first), and not the blocks it reported holding itself."""
    clock = FakeClock()
    master = Master(node_ttl_s=10, clock=clock, replicas=2)
    for node_id in ("a", "b"):
        master.join(node_id, f"tcp://{node_id}", Usage(8, 0, 0))
    clock.now_s += 10
    master.expire_nodes()  # both settled (and not yet past their TTL)
    master.update("a", [(key(1), "dram"), (key(2), "dram"), (key(3), "dram")])
    master.update("b", [(key(1), "dram"), (key(2), "dram"), (key(3), "dram")])
    master.leave("b")  # no other node: keys 1-3 stay at one holder, nothing planned
    assert master.num_copies_pending == 0
    master.join("b", "tcp://b", Usage(8, 0, 0))  # back, empty but for key 3 (its disk)
    master.update("b", [(key(3), "disk")])
    clock.now_s += 5
    master.expire_nodes()
    assert master.num_copies_pending == 0  # not settled yet
    clock.now_s += 6
    master.heartbeat("a")
    master.heartbeat("b")
    master.expire_nodes()
    assert sorted(master.take_copies("a")) == [(key(1), "tcp://b"), (key(2), "tcp://b")]
    master.expire_nodes()  # planned once per join
    assert master.num_copies_pending == 0
    master.check_integrity()


def test_a_killed_holder_is_re_replicated(fleet):
    """replicas = 2 over three data nodes: SIGKILL a holder, and once the master drops it
    every block it held has two holders again, copied by a surviving holder to the third
    node, with the same bytes."""
    master, nodes = fleet(replicas=2, num_nodes=3)
    client = connect_store(nodes.addresses["n0"], transport="zmq", timeout_s=1.0)
    keys, blocks = [key(i) for i in range(12)], [block(i) for i in range(12)]
    assert client.put_many(keys, blocks) == [True] * 12
    assert wait_until(lambda: all(len(h) == 2 for h in master.master.locate(keys)[0]), 10)
    victim = "n1"
    held_by_victim = [k for k, h in zip(keys, master.master.locate(keys)[0], strict=True)
                      if victim in dict(h)]
    assert held_by_victim
    nodes.kill(victim)
    assert wait_until(lambda: victim not in master.master.nodes(), 10)
    assert wait_until(lambda: all(len(h) == 2 for h in master.master.locate(keys)[0]), 15), \
        master.master.locate(keys)[0]
    assert all(victim not in dict(h) for h in master.master.locate(keys)[0])
    got = client.get_many(keys)
    assert all(np.array_equal(g, b) for g, b in zip(got, blocks, strict=True))
    client.close()
    master.check_integrity()


# ---- workers on different nodes ---------------------------------------------------------------
def _start_worker(engine, role: str, address: str, name: str, store_address: str) -> tuple:
    from pdserve.serve.worker.kv_transfer import KVTransfer
    from pdserve.serve.worker.server import Worker

    # no hand-off node: the prompt's KV goes through the fleet store, pinned under a lease
    transfer = KVTransfer.connect(engine.runner, engine.block_manager, store_address,
                                  timeout_s=1.0, lease_ttl_s=10.0, handoff_node=None)
    worker = Worker(engine, role, address, name, lambda announcer: transfer)
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    return worker, thread


def test_decode_on_another_node_and_a_killed_node_costs_only_a_recompute(fleet, llama_dir):
    master, nodes = fleet(replicas=1)
    shared = list(range(10, 10 + 4 * BLOCK))  # four full blocks, then a partial one
    prompts = {"r1": shared + [7, 8, 9], "r2": shared + [11, 12], "r3": [5] * (3 * BLOCK)}
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    reference = make_engine(llama_dir)
    try:
        for rid, prompt in prompts.items():
            reference.add_request(prompt, sampling, rid)
        expected = {rid: token_ids(o) for rid, o in run_to_completion(reference).items()}
    finally:
        reference.shutdown()
    base = free_port_block(2)
    workers, threads = {}, []
    for i, (name, role, node_id) in enumerate([("prefill", "prefill", "n0"),
                                               ("decode", "decode", "n1")]):
        worker, thread = _start_worker(make_engine(llama_dir), role,
                                       f"tcp://127.0.0.1:{base + i}", name,
                                       nodes.addresses[node_id])
        workers[name], threads = worker, threads + [thread]
    context = zmq.Context()
    sockets = dealer_sockets(context, base, workers)

    def disaggregated(request_id: str) -> tuple[list[bytes], list[int]]:
        """(the keys the prompt's KV went to the store under, with a lease; all tokens)."""
        prompt = prompts[request_id]
        [first] = collect(sockets["prefill"], GenerateRequest(request_id, prompt, sampling))
        assert first.finish_reason == "handoff" and first.handoff is not None
        rest = collect(sockets["decode"], GenerateRequest(request_id, prompt, sampling,
                                                           handoff=first.handoff))
        keys = list(first.handoff.block_keys) if first.handoff.lease_id else []
        return keys, first.token_ids + [t for o in rest for t in o.token_ids]

    try:
        decode_transfer = workers["decode"].gateway.kv_transfer
        r1_keys, tokens = disaggregated("r1")
        assert len(r1_keys) == 5 and tokens == expected["r1"]
        # decode installed all five blocks, read from the store (not recomputed)
        assert decode_transfer.totals()["loaded_bytes"] == 5 * decode_transfer.connector.block_bytes
        # the prompt's five blocks were spread over both nodes
        on_n0 = [[h[0] for h in hs] == ["n0"] for hs in master.master.locate(r1_keys)[0]]
        assert 0 < sum(on_n0) < 5
        # kill n0: the master names it until its TTL; reads of its blocks fail (one copy),
        # whatever cannot be loaded is recomputed, and the request completes, same tokens
        nodes.kill("n0")
        _, tokens = disaggregated("r2")
        assert tokens == expected["r2"]
        probe = connect_store(nodes.addresses["n1"], transport="zmq", timeout_s=1.0)
        got = probe.get_many(r1_keys)  # n0's blocks are misses, n1's are still there
        assert [g is None for g in got] == on_n0
        probe.close()
        assert wait_until(lambda: list(master.master.nodes()) == ["n1"], 10)
        r3_keys, tokens = disaggregated("r3")  # every block now placed on n1
        assert len(r3_keys) == 3 and tokens == expected["r3"]
        for worker in workers.values():
            assert wait_until(lambda w=worker: w.gateway.kv_transfer.num_in_flight == 0, 10)
            assert_worker_idle(worker)
        # no lease, pin or lease group left anywhere
        survivor = StoreClient(nodes.addresses["n1"], transport="zmq", timeout_s=5)
        assert wait_until(lambda: survivor.stats()["num_leases"] == 0, 15), survivor.stats()
        assert survivor.stats()["num_pinned"] == 0
        survivor.check_integrity()
        survivor.close()
        assert wait_until(lambda: master.master.num_lease_groups == 0, 15)
        master.check_integrity()
    finally:
        stop_workers(workers, threads, sockets, context)
