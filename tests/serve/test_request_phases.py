"""Request-phase timings: the worker's Output.phase_seconds on the wire (round trip, what is
refused, old peers without it), the router's per-request phases from them, and the
ttft_breakdown benchmark's analysis of /metrics texts. No timing is asserted."""

from __future__ import annotations

import math

import msgpack
import pytest

from benchmarks.ttft_breakdown import (
    HANDOVER_METRIC,
    PHASE_METRIC,
    analyze,
    format_table,
    parse_histograms,
)
from pdserve.protocol.codec import WireError
from pdserve.protocol.worker import WORKER_PHASES, WORKER_PROTOCOL, Output
from pdserve.router.phases import HANDOVER_PHASES, TTFT_PHASES, RequestPhases


def _output(**phase_seconds) -> Output:
    return Output("r1", [5], "x", phase_seconds=phase_seconds)


def _wire(phase_seconds) -> bytes:
    """An Output on the wire with any phase_seconds value, bypassing __post_init__."""
    return msgpack.packb({"type": "output", "request_id": "r1", "token_ids": [5], "text": "x",
                          "phase_seconds": phase_seconds}, use_bin_type=True)


def test_phase_seconds_round_trip():
    output = _output(queue=0.001, prefill=0.04, kv_save=0.0)
    decoded = WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(output))
    assert decoded == output and decoded.phase_seconds == {"queue": 0.001, "prefill": 0.04,
                                                           "kv_save": 0.0}
    every = {name: 0.5 for name in WORKER_PHASES}
    assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(_output(**every))) == _output(**every)
    # an integer number of seconds is a number too
    assert WORKER_PROTOCOL.decode(_wire({"prefill": 1})).phase_seconds == {"prefill": 1.0}


def test_output_from_a_peer_without_phase_seconds_decodes():
    raw = msgpack.packb({"type": "output", "request_id": "r1", "token_ids": [5], "text": "x"},
                        use_bin_type=True)
    assert WORKER_PROTOCOL.decode(raw).phase_seconds == {}


@pytest.mark.parametrize("phase_seconds", [
    {"warmup": 0.1},          # not a phase
    {"queue": -0.001},        # negative
    {"queue": "0.1"},         # not a number
    {"queue": True},          # a bool is not a number here
    {"queue": None},
    {"queue": math.inf},
    {"queue": math.nan},
    [0.1],                    # not a map
    {1: 0.1},                 # not a name
])
def test_bad_phase_seconds_are_refused(phase_seconds):
    with pytest.raises(WireError):
        WORKER_PROTOCOL.decode(_wire(phase_seconds))
    if isinstance(phase_seconds, dict):  # and at the source
        with pytest.raises(ValueError):
            Output("r1", [5], "x", phase_seconds=phase_seconds)


def _disagg_phases() -> RequestPhases:
    """A disaggregated request: arrived at 10.000, prefill leg 10.002 -> 10.062 (worker 50 ms),
    decode leg 10.063 -> 10.093 (worker 25 ms)."""
    phases = RequestPhases(arrival_s=10.0)
    phases.first.on_sent(10.002)
    phases.first.on_output(_output(queue=0.001, prefill=0.03, layer_save=0.01, kv_save=0.009),
                           10.062)
    phases.first.on_output(_output(queue=9.0), 10.07)  # a later Output changes nothing
    phases.decode.on_sent(10.063)
    phases.decode.on_output(_output(kv_load=0.015, first_decode=0.01), 10.093)
    return phases


def test_router_phases_add_up_to_the_ttft():
    phases = _disagg_phases()
    ttft = phases.ttft_phases(first_token_s=10.0625)
    assert list(ttft) == list(TTFT_PHASES)
    expected = {"router": 0.002, "queue": 0.001, "prefill": 0.03, "layer_save": 0.01,
                "kv_save": 0.009,
                "transport": 0.01, "first_token_out": 0.0005}
    assert ttft == pytest.approx(expected)
    assert sum(ttft.values()) == pytest.approx(0.0625)  # the TTFT
    handover = phases.handover_phases()
    assert list(handover) == list(HANDOVER_PHASES)
    assert handover == pytest.approx({"second_dispatch": 0.001, "kv_load": 0.015,
                                      "first_decode": 0.01, "decode_transport": 0.005})


def test_router_phases_of_a_colocated_or_unanswered_request():
    phases = RequestPhases(arrival_s=1.0)
    assert phases.ttft_phases(2.0) == {} and phases.handover_phases() == {}
    phases.first.on_sent(1.001)
    phases.first.on_output(_output(queue=0.0, prefill=0.02), 1.03)
    assert set(phases.ttft_phases(1.031)) == set(TTFT_PHASES) - {"layer_save", "kv_save"}
    assert phases.handover_phases() == {}


def _metrics(counts: int, sums: dict[str, float], ttft_sum: float) -> str:
    """A /metrics text as the router writes it, every phase seen `counts` times."""
    lines = ["# HELP pdserve:request_phase_seconds Time ...",
             "# TYPE pdserve:request_phase_seconds histogram"]
    for name, total in sums.items():
        metric = HANDOVER_METRIC if name in HANDOVER_PHASES else PHASE_METRIC
        labels = f'model_name="tiny",phase="{name}"'
        lines += [f'{metric}_bucket{{{labels},le="0.1"}} {counts}.0',
                  f"{metric}_count{{{labels}}} {counts}.0",
                  f"{metric}_sum{{{labels}}} {total}",
                  f"{metric}_created{{{labels}}} 1.7e9"]
    lines += [f'pdserve:time_to_first_token_seconds_count{{model_name="tiny"}} {counts}.0',
              f'pdserve:time_to_first_token_seconds_sum{{model_name="tiny"}} {ttft_sum}',
              'pdserve:num_requests_running{model_name="tiny",worker="p",role="prefill"} 0.0']
    return "\n".join(lines) + "\n"


def test_analysis_of_metrics_deltas():
    before = _metrics(2, {"router": 0.004, "queue": 0.002, "prefill": 0.08, "kv_save": 0.02,
                          "transport": 0.002, "first_token_out": 0.0002,
                          "second_dispatch": 0.002, "kv_load": 0.02}, ttft_sum=0.11)
    # four more requests: each 1 ms router, 0.5 queue, 40 prefill, 10 kv_save, 1 transport,
    # 0.1 first_token_out (sum 52.6 ms), and 1 + 5 ms of hand-over
    after = _metrics(6, {"router": 0.008, "queue": 0.004, "prefill": 0.24, "kv_save": 0.06,
                         "transport": 0.006, "first_token_out": 0.0006,
                         "second_dispatch": 0.006, "kv_load": 0.04}, ttft_sum=0.3204)
    histograms = parse_histograms(after)
    assert histograms[(PHASE_METRIC, "prefill")] == (0.24, 6.0)
    result = analyze(before, after, client_ttfts_s=[0.0546, 0.0546, 0.0546, 0.0546])
    assert result["phases_ms"] == pytest.approx({
        "router": 1.0, "queue": 0.5, "prefill": 40.0, "kv_save": 10.0, "transport": 1.0,
        "first_token_out": 0.1, "http": 2.0})
    assert result["handover_ms"] == pytest.approx({"second_dispatch": 1.0, "kv_load": 5.0})
    assert result["phase_counts"]["prefill"] == 4
    assert result["router_ttft_ms"] == pytest.approx(52.6)
    assert result["sum_of_phases_ms"] == pytest.approx(52.6)  # the router's phases: its TTFT
    assert result["client_ttft_ms"]["mean"] == pytest.approx(54.6)
    colocated = analyze(_metrics(0, {"prefill": 0.0}, 0.0), _metrics(1, {"prefill": 0.03}, 0.031),
                        [0.032])
    assert "kv_save" not in colocated["phases_ms"]
    table = format_table({"colocated sequential": colocated, "disagg sequential": result},
                         {"1 thread": 39.5})
    prefill_row = next(line for line in table.splitlines() if line.startswith("prefill"))
    assert prefill_row.split()[1:] == ["30.00", "40.00", "10.00"]  # last: disagg - coloc
    assert "offline prefill, 1 thread: 39.50 ms" in table
