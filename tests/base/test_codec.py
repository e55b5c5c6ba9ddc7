"""The checked msgpack codec (pdserve/protocol/codec.py): each declared type's check is made
once and reused; what it accepts and refuses is the contract of every process boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from pdserve.protocol.codec import Protocol, WireError

P = Protocol("test")


@dataclass(frozen=True)
class Inner:
    name: str
    weight: float = 1.0


@P.message("outer")
@dataclass(frozen=True)
class Outer:
    ids: list[int]
    inner: Inner | None = None
    inners: list[Inner] = field(default_factory=list)
    top: dict[int, float] = field(default_factory=dict)
    keys: tuple[bytes, ...] = ()
    either: int | str = 0
    extra: Any = None
    flag: bool = False


@P.message("tree")
@dataclass(frozen=True)
class Tree:
    label: str
    children: list[Tree] = field(default_factory=list)


@P.message("odd")
@dataclass(frozen=True)
class Odd:
    pair: tuple[int, str] | None = None  # not a form the codec checks


def _raw(**fields: Any) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def test_messages_round_trip_with_nested_and_recursive_types() -> None:
    message = Outer([1, 2], Inner("a", 0.5), [Inner("b")], {7: -0.25}, (b"k",), "x", {"a": 1},
                    True)
    assert P.decode(P.encode(message)) == message
    tree = Tree("root", [Tree("a", [Tree("a1")]), Tree("b")])
    assert P.decode(P.encode(tree)) == tree
    # an int where a float is declared is that float; a tuple arrives as a list
    decoded = P.decode(_raw(type="outer", ids=[], inners=[{"name": "c", "weight": 2}],
                            keys=[b"a", b"b"]))
    assert decoded.inners[0].weight == 2.0 and isinstance(decoded.inners[0].weight, float)
    assert decoded.keys == (b"a", b"b")


@pytest.mark.parametrize(("fields", "error"), [
    ({"ids": [1, True]}, r"outer\.ids\[1\]: expected an integer"),  # a bool is not an int
    ({"ids": "12"}, r"outer\.ids: expected a list"),
    ({}, r"outer: missing field 'ids'"),
    ({"ids": [], "bogus": 1}, r"outer: unknown fields .*bogus"),
    ({"ids": [], "inner": {"name": 3}}, r"outer\.inner: dict is not .*Inner \| None"),
    ({"ids": [], "inners": [{"name": 3}]}, r"outer\.inners\[0\]\.name: expected str"),
    ({"ids": [], "top": {"7": 1.0}}, r"outer\.top: expected an integer"),
    ({"ids": [], "either": 1.5}, r"outer\.either: float is not"),
    ({"ids": [], "flag": 1}, r"outer\.flag: expected bool"),
])
def test_bad_fields_are_refused_with_where_they_are(fields: dict, error: str) -> None:
    with pytest.raises(WireError, match=error):
        P.decode(_raw(type="outer", **fields))


def test_deep_errors_and_unsupported_types_are_wire_errors() -> None:
    with pytest.raises(WireError, match=r"tree\.children\[0\]\.children\[0\]: expected a map"):
        P.decode(_raw(type="tree", label="r", children=[{"label": "a", "children": [5]}]))
    assert P.decode(_raw(type="odd")) == Odd()  # the odd field absent: nothing to check
    with pytest.raises(WireError, match=r"odd\.pair: list is not"):
        P.decode(_raw(type="odd", pair=[1, "a"]))
    with pytest.raises(WireError, match="unknown test message type 'nope'"):
        P.decode(_raw(type="nope"))
