"""The chaos soak's accounting (benchmarks/chaos_soak.py): goodput per window counts
only requests within both SLOs, in the window they completed; a request router-0 held when it
was killed is counted apart from the failures; a greedy stream whose text differs from the
offline engine's is counted; every kind of request has a well-formed body."""

from __future__ import annotations

import argparse
import random

import pytest

from benchmarks import chaos_soak
from benchmarks.chaos_soak import Kill, Outcome, Soak


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chaos_soak.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_goodput_counts_requests_within_both_slos_where_they_completed() -> None:
    args = _args(duration_s=20.0, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    outcomes = [
        Outcome("plain", 0.0, end_s=2.0, ok=True, ttft_s=0.5, num_tokens=1),  # window 0
        Outcome("stream", 1.0, end_s=6.0, ok=True, ttft_s=0.5, num_tokens=51),  # 0.09 s: ok
        Outcome("stream", 1.0, end_s=7.0, ok=True, ttft_s=0.5, num_tokens=11),  # 0.55 s: slow
        Outcome("plain", 3.0, end_s=8.0, ok=True, ttft_s=1.5, num_tokens=1),  # TTFT too long
        Outcome("n2", 4.0, end_s=9.0, ok=False, ttft_s=0.1, num_tokens=3),  # failed
    ]
    windows = chaos_soak.goodput_windows(outcomes, args)
    assert len(windows) == 5
    assert windows[0] == pytest.approx(1 / 5)
    assert windows[1] == pytest.approx(1 / 5)
    assert sum(windows[2:]) == 0


def test_failures_are_split_from_the_streams_the_killed_router_held() -> None:
    args = _args(duration_s=60.0)
    kills = [Kill("router-0", at_s=10.0, dead_at_s=10.2, ready_after_s=2.0),
             Kill("decode-0", at_s=30.0)]
    outcomes = [
        Outcome("stream", 5.0, end_s=10.5, router=0, error="RemoteProtocolError"),  # lost
        Outcome("plain", 10.1, end_s=10.2, router=0, error="ReadError"),  # lost: sent as it died
        Outcome("stream", 5.0, end_s=10.5, router=1, error="ReadError"),  # another router
        Outcome("n2", 28.0, end_s=33.0, router=0, error="HTTP 503"),  # a real failure
        Outcome("stream", 40.0, end_s=41.0, ok=True, ttft_s=0.1, num_tokens=5, text="a b"),
        Outcome("stream", 42.0, end_s=43.0, ok=True, ttft_s=0.1, num_tokens=5, text="x"),
    ]
    soak = Soak(kills=kills, outcomes=outcomes)
    result = chaos_soak.summarise(soak, {4: "a b", 5: "y"}, {}, rate=1.0, capacity=2.0,
                                  args=args)
    assert result["lost_with_killed_router"] == 2
    assert result["failed"] == 2
    assert result["failed_by_kind"] == {"stream": 1, "n2": 1}
    assert result["greedy_streams_compared"] == 2
    assert result["greedy_streams_differing"] == 1
    assert result["capacity_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("kind", chaos_soak.KINDS)
def test_every_kind_of_request_is_fresh_and_well_formed(kind: str) -> None:
    args = _args()
    rng = random.Random(3)
    path, body = chaos_soak.make_request(kind, rng, args)
    _, again = chaos_soak.make_request(kind, rng, args)
    assert path == ("/v1/chat/completions" if kind == "json-schema" else "/v1/completions")
    assert args.max_tokens[0] <= body["max_tokens"] <= args.max_tokens[1]
    text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    other = again["messages"][0]["content"] if "messages" in again else again["prompt"]
    assert text != other  # fresh: nothing served from a prefix cache
    assert body.get("n", 1) == (2 if kind == "n2" else 1)
    assert ("logprobs" in body) == (kind == "logprobs")
    assert body.get("stream", False) == (kind in ("stream", "n2", "json-schema"))
