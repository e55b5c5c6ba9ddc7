"""The control-message schema: what decodes, what is refused, and that encode checks too."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.kvstore import messages


def test_round_trip_of_every_field_kind():
    raw = messages.encode("update", 9, node_id="n", changes=[[b"k" * 16, "dram"], [b"j", None]])
    message = messages.decode_request(raw, max_items=10)
    assert (message.type, message.request_id) == ("update", 9)
    assert message.fields["changes"] == [[b"k" * 16, "dram"], [b"j", None]]
    reply = messages.decode_reply(messages.encode_reply(9, found=[True]))
    assert reply.fields["ok"] is True and reply.fields["found"] == [True]
    assert messages.decode_reply(messages.encode_reply(3, error="no")).fields["ok"] is False


@pytest.mark.parametrize("message", [
    {"type": "get", "request_id": -1, "keys": [], "ucx_tag": None},
    {"type": "get", "request_id": True, "keys": [], "ucx_tag": None},
    {"type": "get", "request_id": 1, "keys": [b"x" * 65], "ucx_tag": None},
    {"type": "get", "request_id": 1, "keys": [b""], "ucx_tag": None},
    {"type": "get", "request_id": 1, "keys": [b"k"] * 11, "ucx_tag": None},
    {"type": "get", "request_id": 1, "keys": [], "ucx_tag": -5},
    {"type": "pin", "request_id": 1, "keys": [], "holder": "h", "ttl_s": 0},
    {"type": "pin", "request_id": 1, "keys": [], "holder": "h" * 300, "ttl_s": 1},
    {"type": "update", "request_id": 1, "node_id": "n", "changes": [[b"k"]]},
    {"type": "update", "request_id": 1, "node_id": "n", "changes": [[b"k", 3]]},
    {"type": "stats", "request_id": 1, "extra": 0},
    {"type": 7, "request_id": 1},
])
def test_schema_violations_are_refused(message):
    with pytest.raises(messages.MessageError):
        messages.decode_request(msgpack.packb(message), max_items=10)


def test_non_msgpack_and_non_maps_are_refused():
    for raw in (b"", b"\xc1", msgpack.packb([1]), msgpack.packb({1: 2}), b"\x80" * 10):
        with pytest.raises(messages.MessageError):
            messages.decode_request(raw, max_items=10)
    with pytest.raises(messages.MessageError):
        messages.decode_reply(msgpack.packb({"type": "get", "request_id": 1, "ok": True}))


def test_encode_refuses_a_bad_request_at_its_source():
    with pytest.raises(messages.MessageError):
        messages.encode("get", 1, keys=["str-not-bytes"], ucx_tag=None)
