"""The store protocol (pdserve/protocol/store/): round trips, what decodes, what is refused,
and that building a bad message fails at its source too."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import msgpack
import pytest

from pdserve.protocol.codec import WireError
from pdserve.protocol.store import base, data, master
from pdserve.protocol.store.base import STORE_PROTOCOL, decode_store_message

KEY = b"k" * 16

# One valid instance of every registered message, request_id 9.
EXAMPLES = [
    data.HelloRequest(9, ucx_address=b"\x01" * 200),
    data.HelloRequest(9, ucx_address=None),
    data.HelloReply(9, ucx_address=None, client_no=0),
    data.ByeRequest(9),
    data.ByeReply(9),
    data.PutRequest(9, keys=[KEY, b"j"], sizes=[4096, 0], ucx_tag=None),
    data.PutReply(9, stored=[True, False]),
    data.GetRequest(9, keys=[KEY], ucx_tag=(3 << 32) | 17),
    data.GetReply(9, found=[True, False], sizes=[4096, 0]),
    data.GetLayersRequest(9, staging_id=3, keys=[KEY], first_block=2, first_layer=1,
                          num_layers=8, wait_s=0.05, ucx_tag=(3 << 32) | 18),
    data.GetLayersReply(9, num_layers=2, nbytes=8192),
    data.GetLayersReply(9, num_layers=0, nbytes=0, gone=True),
    data.ExistsRequest(9, keys=[KEY]),
    data.ExistsReply(9, found=[True]),
    data.EvictRequest(9, keys=[KEY]),
    data.EvictReply(9, num_evicted=1),
    data.PrefetchRequest(9, keys=[]),
    data.PrefetchReply(9, num_moved=0),
    data.PinRequest(9, keys=[KEY], holder="worker-1", ttl_s=30.0),
    data.PinReply(9, lease_id=2**63 - 1, pinned=[True]),
    data.RenewRequest(9, lease_id=5, ttl_s=0.5),
    data.RenewReply(9, known=False),
    data.ReleaseRequest(9, lease_id=5),
    data.ReleaseReply(9, known=True),
    base.StatsRequest(9),
    base.StatsReply(9, stats={"num_blocks_dram": 3, "num_leases": 0}),
    base.CheckRequest(9),
    base.CheckReply(9, problem=None),
    base.CheckReply(9, problem="3 pins but leases hold 2"),
    base.LookupPrefixRequest(9, keys=[KEY, b"j"]),
    base.LookupPrefixReply(9, num_blocks=1, holders=[[base.BlockHolder("n1", "dram"),
                                                       base.BlockHolder("n2", "disk")]]),
    master.JoinRequest(9, node_id="n1", address="tcp://127.0.0.1:7601"),
    master.JoinReply(9),
    master.HeartbeatRequest(9, node_id="n1"),
    master.HeartbeatRequest(9, node_id="n1", usage=master.NodeUsage(8, 2, 8192)),
    master.HeartbeatReply(9, known=True),
    master.LeaveRequest(9, node_id="n1"),
    master.LeaveReply(9),
    master.UpdateRequest(9, node_id="n", changes=[master.PlacementChange(KEY, "dram"),
                                                 master.PlacementChange(b"j", None)]),
    master.UpdateReply(9, known=True),
    master.NodesRequest(9),
    master.NodesReply(9, nodes={"n1": "tcp://127.0.0.1:7601"}),
    master.NodesReply(9, nodes={"n1": "tcp://127.0.0.1:7601"},
                     usage={"n1": master.NodeUsage(capacity_blocks=8, num_blocks=2,
                                                  num_bytes=8192)}),
    data.NodeInfoRequest(9),
    data.NodeInfoReply(9, node_id="n1", master_address="tcp://127.0.0.1:7600"),
    master.PlaceRequest(9, keys=[KEY, b"j"]),
    master.PlaceReply(9, targets=[["n1", "n2"], []], held=[False, True],
                     addresses={"n1": "tcp://127.0.0.1:7601", "n2": "tcp://127.0.0.1:7602"}),
    master.LocateRequest(9, keys=[KEY]),
    master.LocateReply(9, holders=[[base.BlockHolder("n1", "dram")], []],
                      addresses={"n1": "tcp://127.0.0.1:7601"}),
    master.LeaseGroupRequest(9, node_leases=[master.NodeLease("n1", 2**63 - 1)], ttl_s=5.0),
    master.LeaseGroupReply(9, lease_id=7),
    master.TakeLeaseGroupRequest(9, lease_id=7),
    master.TakeLeaseGroupReply(9, known=True, node_leases=[master.NodeLease("n1", 3)],
                              addresses={"n1": "tcp://127.0.0.1:7601"}),
    base.ErrorReply(0, error="malformed: not msgpack"),
]


def registered_types() -> set[type]:
    return {cls for module in (base, data, master) for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, (base.StoreRequest, base.StoreReply))
            and "TAG" in vars(cls)}


def test_every_message_round_trips_exactly():
    assert {type(m) for m in EXAMPLES} == registered_types()  # none left untested
    for message in EXAMPLES:
        decoded = decode_store_message(STORE_PROTOCOL.encode(message))
        assert decoded == message and type(decoded) is type(message)


def test_every_request_and_reply_carries_a_checked_request_id():
    for cls in registered_types():
        assert "request_id" in {f.name for f in dataclasses.fields(cls)}, cls
    for message in EXAMPLES:
        for bad in (-1, True, 2**63, "9"):
            plain = msgpack.unpackb(STORE_PROTOCOL.encode(message))
            with pytest.raises(WireError):
                decode_store_message(msgpack.packb({**plain, "request_id": bad}))


def raw(type_: str, **fields) -> bytes:
    return msgpack.packb({"type": type_, **fields}, use_bin_type=True)


@pytest.mark.parametrize("payload", [
    raw("get", request_id=1, keys=[b"x" * 65], ucx_tag=None),  # key too long
    raw("get", request_id=1, keys=[b""], ucx_tag=None),  # empty key
    raw("get", request_id=1, keys=["not-bytes"], ucx_tag=None),
    raw("get", request_id=1, keys=b"k", ucx_tag=None),  # not a list
    raw("get", request_id=1, keys=[], ucx_tag=-5),
    raw("get", request_id=1, keys=[], ucx_tag=2**63),
    raw("get", request_id=1, keys=[]),  # missing field
    raw("put", request_id=1, keys=[KEY], sizes=[5, 6], ucx_tag=None),  # one size per key
    raw("put", request_id=1, keys=[KEY], sizes=[-1], ucx_tag=None),
    raw("put", request_id=1, keys=[KEY], sizes=[True], ucx_tag=None),
    raw("pin", request_id=1, keys=[], holder="h", ttl_s=0),
    raw("pin", request_id=1, keys=[], holder="h", ttl_s=1e7),
    raw("pin", request_id=1, keys=[], holder="h", ttl_s=float("nan")),
    raw("pin", request_id=1, keys=[], holder="h" * 257, ttl_s=1),
    raw("renew", request_id=1, lease_id=1, ttl_s="1"),
    raw("hello", request_id=1, ucx_address=b"a" * 4097),
    raw("hello", request_id=1, ucx_address="a-string"),
    raw("join", request_id=1, node_id="n" * 257, address="a"),
    raw("update", request_id=1, node_id="n", changes=[[KEY, "dram"]]),  # old list form
    raw("update", request_id=1, node_id="n", changes=[{"key": KEY}]),
    raw("update", request_id=1, node_id="n", changes=[{"key": KEY, "tier": 3}]),
    raw("update", request_id=1, node_id="n", changes=[{"key": b"x" * 65, "tier": None}]),
    raw("get_reply", request_id=1, found=[True, True], sizes=[4, 4], runs=[1]),  # 1 of 2
    raw("get_reply", request_id=1, found=[True], sizes=[4], runs=[0, 1]),  # an empty message
    raw("get_reply", request_id=1, found=[True], sizes=[4], runs=[-1, 2]),
    raw("get_layers", request_id=1, staging_id=1, keys=[], first_block=0, first_layer=0,
        num_layers=8, wait_s=0.0, ucx_tag=None),  # no blocks
    raw("get_layers", request_id=1, staging_id=1, keys=[KEY], first_block=0, first_layer=8,
        num_layers=8, wait_s=0.0, ucx_tag=None),  # past the last layer
    raw("get_layers", request_id=1, staging_id=1, keys=[KEY], first_block=0, first_layer=0,
        num_layers=8, wait_s=5.0, ucx_tag=None),  # holds a node's thread too long
    raw("get_layers", request_id=1, staging_id=1, keys=[KEY] * 30_000, first_block=0,
        first_layer=0, num_layers=8, wait_s=0.0, ucx_tag=None),  # one block, asked again
    raw("get_layers", request_id=1, staging_id=1,
        keys=[i.to_bytes(16, "big") for i in range(data.MAX_LAYER_KEYS + 1)], first_block=0,
        first_layer=0, num_layers=8, wait_s=0.0, ucx_tag=None),  # more than a staging has
    raw("get_layers_reply", request_id=1, num_layers=1, nbytes=0),  # layers without bytes
    raw("get_layers_reply", request_id=1, num_layers=1, nbytes=4, gone=True),
    raw("stats", request_id=1, extra=0),  # unknown field
    raw("stats_reply", request_id=1, stats={"n": -1}),
    raw("lookup_prefix_reply", request_id=1, num_blocks=2, holders=[]),
    raw("__import__", request_id=1),
    msgpack.packb({"type": 7, "request_id": 1}),
    msgpack.packb({"request_id": 1}),
])
def test_schema_violations_are_refused(payload):
    with pytest.raises(WireError):
        decode_store_message(payload)


class _Exploit:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_non_msgpack_pickle_and_oversize_headers_are_refused():
    hostile = [b"", b"\xc1", b"\x80" * 10, msgpack.packb([1]), msgpack.packb({1: 2}),
               pickle.dumps(_Exploit()), pickle.dumps({"type": "stats", "request_id": 1})]
    for payload in hostile:
        with pytest.raises(WireError):
            decode_store_message(payload)
    huge = raw("exists", request_id=1, keys=[KEY] * 300_000)  # > 4 MiB of header
    assert len(huge) > base.MAX_HEADER_BYTES
    with pytest.raises(WireError, match="at most"):
        decode_store_message(huge)


def test_a_bad_message_fails_where_it_is_built():
    with pytest.raises((ValueError, TypeError)):
        data.GetRequest(1, keys=["str-not-bytes"], ucx_tag=None)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        data.PinRequest(1, keys=[KEY], holder="h", ttl_s=0.0)
    with pytest.raises(ValueError):
        data.PutRequest(1, keys=[KEY], sizes=[], ucx_tag=None)
    with pytest.raises(ValueError):
        base.ErrorReply(-1, error="x")
    with pytest.raises(TypeError):
        master.UpdateRequest(1, node_id="n", changes=[(KEY, "dram")])  # type: ignore[list-item]


def test_field_types_are_declared_for_the_codec():
    """Every field of every message has a type the codec checks (no Any slipping through)."""
    for cls in registered_types():
        for name, hint in typing.get_type_hints(cls).items():
            assert hint is not typing.Any, (cls.__name__, name)
