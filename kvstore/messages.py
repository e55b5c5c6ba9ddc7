"""Store <-> client control messages: msgpack over ZeroMQ, each decoded against its schema.

Every message is a msgpack map {"type": ..., "request_id": int, <fields>}. Block payloads never
ride inside msgpack: they follow as extra ZeroMQ frames (zmq data path) or move over UCX with a
tag named in the message (ucx data path). Decoding checks the type, that every field is known,
present and of the right type and size; anything else raises MessageError, which the server logs
and answers with an error reply. Nothing is ever unpickled: msgpack only builds plain values.

Requests (-> reply fields):
    hello        ucx_address: bytes|None             -> ucx_address: bytes|None, client_no: int
    bye          -                                   -> -  (frees the client's UCX endpoint)
    put          keys, sizes: [int], ucx_tag: int|None -> stored: [bool]
    get          keys, ucx_tag: int|None             -> found: [bool], sizes: [int]
    exists       keys                                -> found: [bool]
    pin          keys, holder: str, ttl_s: float     -> lease_id: int, pinned: [bool]
    renew        lease_id: int, ttl_s: float         -> known: bool
    release      lease_id: int                       -> known: bool
    evict        keys                                -> num_evicted: int
    prefetch     keys                                -> num_moved: int
    stats        -                                   -> stats: {str: int}
    check        -                                   -> problem: str|None
  master:
    join         node_id: str, address: str          -> -
    heartbeat    node_id: str                        -> known: bool
    leave        node_id: str                        -> -
    update       node_id: str, changes: [[key, tier|None]] -> known: bool
    lookup_prefix keys                               -> num_blocks: int, holders: [[[node, tier]]]
    nodes        -                                   -> nodes: {str: str}
Every reply: {"type": "reply", "request_id", "ok": bool, "error": str|None, ...}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_KEY_BYTES = 64
MAX_STR_CHARS = 256
MAX_ADDRESS_BYTES = 4096
MAX_HEADER_BYTES = 4 * 1024 * 1024


class MessageError(ValueError):
    """A control message that does not match its schema."""


@dataclass(frozen=True)
class Message:
    type: str
    request_id: int
    fields: dict[str, Any]


# ---- field validators: (value, max_items) -> None, raising MessageError ----------------------
def _int(v: Any, _: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
        raise MessageError(f"expected a non-negative int, got {type(v).__name__}")


def _float(v: Any, _: int) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e7:
        raise MessageError("expected a positive number")


def _str(v: Any, _: int) -> None:
    if not isinstance(v, str) or len(v) > MAX_STR_CHARS:
        raise MessageError("expected a short string")


def _optional(check: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    def validate(v: Any, n: int) -> None:
        if v is not None:
            check(v, n)
    return validate


def _address(v: Any, _: int) -> None:
    if not isinstance(v, bytes) or len(v) > MAX_ADDRESS_BYTES:
        raise MessageError("expected address bytes")


def _key(v: Any) -> None:
    if not isinstance(v, bytes) or not 0 < len(v) <= MAX_KEY_BYTES:
        raise MessageError(f"a key must be 1..{MAX_KEY_BYTES} bytes")


def _keys(v: Any, max_items: int) -> None:
    if not isinstance(v, list) or len(v) > max_items:
        raise MessageError(f"keys must be a list of at most {max_items}")
    for key in v:
        _key(key)


def _ints(v: Any, max_items: int) -> None:
    if not isinstance(v, list) or len(v) > max_items:
        raise MessageError(f"expected a list of at most {max_items} ints")
    for item in v:
        _int(item, max_items)


def _changes(v: Any, max_items: int) -> None:
    if not isinstance(v, list) or len(v) > max_items:
        raise MessageError(f"changes must be a list of at most {max_items}")
    for item in v:
        if not isinstance(item, list) or len(item) != 2:
            raise MessageError("a change is [key, tier|None]")
        _key(item[0])
        _optional(_str)(item[1], max_items)


SCHEMAS: dict[str, dict[str, Callable[[Any, int], None]]] = {
    "hello": {"ucx_address": _optional(_address)},
    "put": {"keys": _keys, "sizes": _ints, "ucx_tag": _optional(_int)},
    "get": {"keys": _keys, "ucx_tag": _optional(_int)},
    "exists": {"keys": _keys},
    "pin": {"keys": _keys, "holder": _str, "ttl_s": _float},
    "renew": {"lease_id": _int, "ttl_s": _float},
    "release": {"lease_id": _int},
    "evict": {"keys": _keys},
    "prefetch": {"keys": _keys},
    "stats": {},
    "bye": {},
    "check": {},
    "join": {"node_id": _str, "address": _str},
    "heartbeat": {"node_id": _str},
    "leave": {"node_id": _str},
    "update": {"node_id": _str, "changes": _changes},
    "lookup_prefix": {"keys": _keys},
    "nodes": {},
}


def encode(type_: str, request_id: int, **fields: Any) -> bytes:
    """A request (validated before sending, so a client bug fails loudly at its source)."""
    message = {"type": type_, "request_id": request_id, **fields}
    raw = msgpack.packb(message, use_bin_type=True)
    decode_request(raw, max_items=max(1 << 20, _num_items(fields)))
    return raw


def _num_items(fields: dict[str, Any]) -> int:
    return max((len(v) for v in fields.values() if isinstance(v, list)), default=0)


def encode_reply(request_id: int, error: str | None = None, **fields: Any) -> bytes:
    message = {"type": "reply", "request_id": request_id, "ok": error is None, "error": error,
               **fields}
    return msgpack.packb(message, use_bin_type=True)


def _unpack(raw: bytes) -> dict[str, Any]:
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) > MAX_HEADER_BYTES:
        raise MessageError("header missing or too large")
    try:
        message = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MessageError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(message, dict):
        raise MessageError(f"expected a map, got {type(message).__name__}")
    request_id = message.get("request_id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
        raise MessageError("request_id must be a non-negative int")
    return message


def decode_request(raw: bytes, max_items: int) -> Message:
    """Parse and validate one request; MessageError if it is anything but a known message."""
    message = _unpack(raw)
    type_ = message.pop("type", None)
    request_id = message.pop("request_id")
    schema = SCHEMAS.get(type_) if isinstance(type_, str) else None
    if schema is None:
        raise MessageError(f"unknown message type {type_!r}"[:200])
    unknown = set(message) - set(schema)
    if unknown:
        raise MessageError(f"{type_}: unknown fields {sorted(map(str, unknown))[:5]}")
    for name, validate in schema.items():
        if name not in message:
            raise MessageError(f"{type_}: missing field {name!r}")
        try:
            validate(message[name], max_items)
        except MessageError as e:
            raise MessageError(f"{type_}.{name}: {e}") from None
    return Message(type_, request_id, message)


def decode_reply(raw: bytes) -> Message:
    """Parse a reply; the caller reads the fields it asked for (and checks their types)."""
    message = _unpack(raw)
    if message.pop("type", None) != "reply" or not isinstance(message.get("ok"), bool):
        raise MessageError("not a reply")
    request_id = message.pop("request_id")
    return Message("reply", request_id, message)
