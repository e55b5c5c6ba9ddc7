"""Placement per request (pdserve/router/placement.py): which prompts a decode worker computes
itself. tests/cluster/test_server_e2e.py serves placed prompts through `pdserve up`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.router.placement import LocalPrefill
from pdserve.router.policies import RouteContext


def _decode(address: str, inflight: int = 0, waiting: int = 0, limit: int = 8,
            accepting: bool = True) -> SimpleNamespace:
    return SimpleNamespace(address=address, num_inflight=inflight, accepting=accepting,
                           status=SimpleNamespace(num_waiting=waiting, max_num_seqs=limit))


@pytest.mark.parametrize("prompt,cached,workers,expected", [
    (30, {}, [_decode("a", 2), _decode("b", 1)], "b"),  # short: the least busy
    (300, {}, [_decode("a"), _decode("b")], None),  # long and cached nowhere: remote
    (300, {"b": 272}, [_decode("a"), _decode("b", 3)], "b"),  # 28 left where it is held
    (300, {"b": 200}, [_decode("a"), _decode("b")], None),  # 100 left: remote
    (30, {}, [_decode("a", waiting=1), _decode("b", inflight=6)], None),  # no headroom
    (30, {}, [_decode("a", inflight=5), _decode("b", accepting=False)], "a"),  # 5 < 0.75 x 8
    (30, {"b": 16}, [_decode("a"), _decode("b", inflight=5)], "b"),  # fewest uncached first
])
def test_local_prefill_choice(prompt, cached, workers, expected):
    ctx = RouteContext(prompt, 0, cached)
    chosen = LocalPrefill(max_local_tokens=32).choose(workers, ctx)
    assert (chosen.address if chosen is not None else None) == expected


def test_off_places_nothing_and_bad_values_are_refused():
    assert LocalPrefill(0).choose([_decode("a")], RouteContext(1)) is None
    with pytest.raises(ValueError):
        LocalPrefill(-1)
