"""The hand-off adapts to the link (pdserve/handoff/link_policy.py, pdserve/serve/worker/
kv_source.py): each peer's measured rate, and per request the choice between moving the KV,
reading it from the store and recomputing it, on stubbed rates and prefill speeds."""

from __future__ import annotations

import pytest

from pdserve.handoff.link_policy import (
    MARGIN,
    MAX_STALE_S,
    MIN_SAMPLE_BYTES,
    STALE_S,
    KVSourcePolicy,
    LinkMeter,
    Prediction,
    choose_from,
)
from pdserve.protocol.worker import StepSample
from pdserve.serve.worker.kv_source import KVSources, prefill_s_per_token

MB = 1 << 20
PEER = "tcp://10.213.0.2:7000"


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _meter(rates: dict[str, float], clock: Clock | None = None) -> LinkMeter:
    """A meter that measured each peer's `rates` (bytes per second) once."""
    meter = LinkMeter(clock or Clock())
    for peer, rate in rates.items():
        meter.note(peer, 8 * MB, 8 * MB / rate)
    return meter


# 2,000 prompt tokens, 64 MiB of KV (32 KiB a token)
TOKENS, KV_BYTES = 2000, 64 * MB


@pytest.mark.parametrize(("link", "store", "prefill_s_per_token", "has_store", "expected"), [
    # nothing measured: transfer (today's path, and it measures the link)
    (None, None, None, True, "transfer"),
    (None, 1e9, 1e-6, True, "transfer"),
    # a 10 Gbit/s link (1.25 GB/s: 0.05 s) beats a 1 ms/token recompute (2 s)
    (1.25e9, None, 1e-3, True, "transfer"),
    # 100 Mbit/s (12.5 MB/s: 5.4 s) loses to 2 s of recompute
    (12.5e6, None, 1e-3, True, "recompute"),
    # ... and to a store read at 1 GB/s (0.067 s), which beats the recompute too
    (12.5e6, 1e9, 1e-3, True, "store"),
    # the store measured but the transport has none: recompute
    (12.5e6, 1e9, 1e-3, False, "recompute"),
    # the prefill speed unknown (decode never computed a prompt): a transfer over EXPLORE_S
    # is worth one recompute, which measures it; a shorter one transfers
    (12.5e6, None, None, True, "recompute"),
    (1e9, None, None, True, "transfer"),
    # within MARGIN: no switch (5.4 s transfer vs 4.5 s recompute)
    (12.5e6, None, 4.5 / TOKENS, True, "transfer"),
    # just past MARGIN: switch
    (12.5e6, None, 5.3687 / TOKENS / MARGIN / 1.01, True, "recompute"),
])
def test_the_choice_on_stubbed_rates(link, store, prefill_s_per_token, has_store,
                                     expected) -> None:
    rates = {**({PEER: link} if link else {}), **({"": store} if store else {})}
    policy = KVSourcePolicy(_meter(rates), has_store=has_store)
    assert policy.choose(TOKENS, KV_BYTES, PEER, prefill_s_per_token) == expected
    assert policy.choose(TOKENS, KV_BYTES, PEER, prefill_s_per_token,
                         can_recompute=False) in ("transfer", "store")


def test_the_choice_is_side_effect_free_and_predicts_each_source() -> None:
    meter = _meter({PEER: 12.5e6, "": 1e9})
    before = meter.as_status()
    policy = KVSourcePolicy(meter, has_store=True)
    for _ in range(3):
        assert policy.choose(TOKENS, KV_BYTES, PEER, 1e-3) == "store"
    assert meter.as_status() == before
    predicted = policy.predict(TOKENS, KV_BYTES, PEER, 1e-3)
    assert predicted.transfer_s == pytest.approx(KV_BYTES / 12.5e6)
    assert predicted.store_s == pytest.approx(KV_BYTES / 1e9)
    assert predicted.recompute_s == pytest.approx(2.0)
    # a hand-off through the store ("" is its source): the store is the transfer
    assert policy.predict(TOKENS, KV_BYTES, "", 1e-3).store_s is None


def test_ties_prefer_the_store_and_unknown_links_transfer() -> None:
    assert choose_from(Prediction(10.0, 1.0, 1.0)) == "store"
    assert choose_from(Prediction(None, 1.0, 1.0)) == "transfer"
    assert choose_from(Prediction(10.0, None, None)) == "transfer"


def test_the_store_is_read_first_only_where_predicted_faster() -> None:
    policy = KVSourcePolicy(_meter({PEER: 12.5e6, "": 1e9}), has_store=True)
    assert policy.reads_store_first(KV_BYTES, PEER)
    assert not KVSourcePolicy(_meter({PEER: 1e10, "": 1e9}), True).reads_store_first(
        KV_BYTES, PEER)
    assert not KVSourcePolicy(_meter({"": 1e9}), True).reads_store_first(KV_BYTES, PEER)


def test_the_meter_smooths_ignores_small_reads_and_forgets_stale_links() -> None:
    clock = Clock()
    meter = LinkMeter(clock)
    meter.note(PEER, MIN_SAMPLE_BYTES - 1, 1e-6)  # latency, not bandwidth
    assert meter.bytes_per_s(PEER) is None
    meter.note(PEER, 10 * MB, 1.0)
    assert meter.bytes_per_s(PEER) == pytest.approx(10 * MB)
    meter.note(PEER, 20 * MB, 1.0)
    assert meter.bytes_per_s(PEER) == pytest.approx(10 * MB + 0.3 * 10 * MB)  # EMA 0.3
    # a pull's round trip may have waited for the layer: it only raises the estimate
    meter.note(PEER, 1 * MB, 1.0, lower_bound=True)
    assert meter.bytes_per_s(PEER) == pytest.approx(13 * MB)
    meter.note(PEER, 113 * MB, 1.0, lower_bound=True)
    assert meter.bytes_per_s(PEER) == pytest.approx(13 * MB + 0.3 * 100 * MB)
    assert meter.as_status() == {f"link_bytes_per_s:{PEER}": pytest.approx(43 * MB)}
    clock.now_s += STALE_S + 1  # stale: the next hand-off transfers and measures again
    assert meter.bytes_per_s(PEER) is None
    assert KVSourcePolicy(meter, True).choose(TOKENS, KV_BYTES, PEER, 1.0) == "transfer"
    # the link slowed: a pull's lower bound now replaces the stale rate (and is fresh)
    meter.note(PEER, 1 * MB, 1.0, lower_bound=True)
    assert meter.bytes_per_s(PEER) == pytest.approx(1 * MB)


def test_a_link_found_no_faster_is_re_measured_less_and_less_often() -> None:
    clock = Clock()
    meter = LinkMeter(clock)
    meter.note(PEER, 10 * MB, 10.0)  # 1 MB/s: trusted STALE_S
    clock.now_s += STALE_S + 1
    for window_s in (2 * STALE_S, 4 * STALE_S, 8 * STALE_S, MAX_STALE_S, MAX_STALE_S):
        assert meter.bytes_per_s(PEER) is None  # stale: the next hand-off probes
        meter.note(PEER, 10 * MB, 10.0)  # the probe finds it no faster
        clock.now_s += window_s - 1
        assert meter.bytes_per_s(PEER) == pytest.approx(1 * MB)  # trusted twice as long
        clock.now_s += 2
    assert meter.bytes_per_s(PEER) is None
    meter.note(PEER, 100 * MB, 10.0)  # faster: trusted STALE_S again
    clock.now_s += STALE_S - 1
    assert meter.bytes_per_s(PEER) == pytest.approx(10 * MB)
    clock.now_s += 2
    assert meter.bytes_per_s(PEER) is None


def test_a_timed_out_read_bounds_the_rate_from_above() -> None:
    clock = Clock()
    meter = LinkMeter(clock)
    meter.note(PEER, 24 * MB, 3.0, upper_bound=True)  # 24 MiB asked, nothing in 3 s
    assert meter.bytes_per_s(PEER) == pytest.approx(8 * MB)  # at most that: the estimate
    meter.note(PEER, 24 * MB, 0.01, upper_bound=True)  # refused at once: no bound
    meter.note(PEER, 24 * MB, 1.0, upper_bound=True)  # "at most 24 MB/s" says nothing new
    assert meter.bytes_per_s(PEER) == pytest.approx(8 * MB)
    meter.note(PEER, 3 * MB, 3.0, upper_bound=True)  # one layer did not come in 3 s
    assert meter.bytes_per_s(PEER) == pytest.approx(1 * MB)
    meter.note(PEER, 20 * MB, 1.0)  # a read that completed: the smoothed mean again
    assert meter.bytes_per_s(PEER) == pytest.approx(1 * MB + 0.3 * 19 * MB)


def test_a_read_that_times_out_is_measured_as_an_upper_bound(monkeypatch) -> None:
    """The transport's side: a peer whose read times out (a link too slow for the 3 s peer
    timeout) leaves the rate it must be below, where a failure used to leave nothing."""
    from pdserve.handoff import store as store_module
    from pdserve.handoff.registry import make_transport

    now = [0.0]
    monkeypatch.setattr(store_module.time, "perf_counter", lambda: now[0])

    class SlowPeer:
        def get_many(self, keys):
            now[0] += 3.0
            raise TimeoutError("UCX transfer did not finish within 3.0 s")

    decode = make_transport("store", None, lambda address: SlowPeer())
    assert decode.receive([bytes(16)] * 8, PEER, 1 * MB) == []
    assert decode.links.bytes_per_s(PEER) == pytest.approx(8 * MB / 3.0)
    assert decode.peers.recently_failed(PEER)


def _sample(seq: int, prefill: int, decode: int, seconds: float) -> StepSample:
    return StepSample(seq, prefill, prefill * prefill, decode, decode * 100, seconds)


def test_the_prefill_speed_from_the_engine_s_steps() -> None:
    assert prefill_s_per_token([]) is None
    assert prefill_s_per_token([_sample(1, 0, 4, 0.01)]) is None  # decode only
    assert prefill_s_per_token([_sample(1, 8, 0, 0.5)]) is None  # too few tokens to tell
    assert prefill_s_per_token([_sample(1, 100, 0, 0.2)]) == pytest.approx(0.002)
    # a recompute inside a decode batch: the decode step's part taken out
    samples = [_sample(1, 0, 4, 0.01), _sample(2, 0, 4, 0.01), _sample(3, 200, 4, 0.41)]
    assert prefill_s_per_token(samples) == pytest.approx(0.002)
    assert prefill_s_per_token(samples, measured=0.005) == 0.005  # the host tier's


def test_kv_sources_counts_what_was_taken_and_reports_the_links() -> None:
    speed = [None]
    sources = KVSources(KVSourcePolicy(_meter({PEER: 12.5e6}), has_store=False),
                        block_bytes=MB, prefill_speed=lambda: speed[0])
    assert sources.choose(TOKENS, 4, PEER) == "transfer"  # 0.3 s, the prefill speed unknown
    assert sources.choose(TOKENS, 64, PEER) == "recompute"  # 5.4 s: worth learning the speed
    speed[0] = 1e-2  # 20 s to recompute: the transfer
    assert sources.choose(TOKENS, 64, PEER) == "transfer"
    speed[0] = 1e-3
    assert sources.choose(TOKENS, 64, PEER) == "recompute"
    # as the prefill starts (a follow), its forward (2 s at this speed) hides as much of
    # the transfer: 3.4 s left, still more than 1.25 x 2 s of recompute
    assert sources.choose(TOKENS, 64, PEER, during_prefill=True) == "recompute"
    speed[0] = 2e-3  # 4 s to recompute: 1.25 x 4 s < 5.4 s of transfer...
    assert sources.choose(TOKENS, 64, PEER) == "recompute"
    # ...but a follow's 4 s forward hides all but 1.4 s of it
    assert sources.choose(TOKENS, 64, PEER, during_prefill=True) == "transfer"
    speed[0] = 1e-3
    assert sources.counts == {"transfer": 0, "store": 0, "recompute": 0}  # choose counts not
    sources.note("recompute")
    totals = sources.totals()
    assert totals["handoff_source_recompute"] == 1.0
    assert totals["handoff_source_transfer"] == 0.0
    assert totals["recompute_prefill_tokens_per_s"] == pytest.approx(1000.0)
    assert totals[f"link_bytes_per_s:{PEER}"] == pytest.approx(12.5e6)


def test_the_choices_and_the_links_reach_the_router_s_metrics() -> None:
    """A decode worker's totals cross in WorkerStatus.kv_transfer (over the wire codec) and
    the router's /metrics shows the choice counts and each peer's rate."""
    from types import SimpleNamespace

    from pdserve.protocol.worker import WORKER_PROTOCOL, WorkerStatus
    from pdserve.router.metrics import RouterMetrics

    sources = KVSources(KVSourcePolicy(_meter({PEER: 12.5e6}), has_store=True),
                        block_bytes=MB, prefill_speed=lambda: None)
    sources.note("transfer")
    sources.note("recompute")
    sources.note("recompute")
    status = WorkerStatus(worker_id="d0", role="decode", model="m", max_model_len=64,
                          is_ready=True, num_running=0, num_waiting=0, num_free_blocks=8,
                          num_total_blocks=8, block_size=8, kv_transfer=sources.totals())
    status = WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(status))
    worker = SimpleNamespace(status=status, worker_id="d0", role="decode")
    text = RouterMetrics("m").render([worker]).decode()
    labels = 'model_name="m",role="decode"'
    assert (f'pdserve:kv_handoff_source_choices_total{{{labels},source="recompute",'
            f'worker="d0"}} 2.0') in text
    assert (f'pdserve:kv_handoff_source_choices_total{{{labels},source="store",'
            f'worker="d0"}} 0.0') in text
    assert (f'pdserve:kv_link_bytes_per_second{{model_name="m",peer="{PEER}",role="decode",'
            f'worker="d0"}} 1.25e+07') in text


def test_the_engine_s_prefill_speed_is_kept_once_its_steps_age_out() -> None:
    from collections import deque
    from types import SimpleNamespace

    from pdserve.serve.worker.kv_source import EnginePrefillSpeed

    engine = SimpleNamespace(kv_offload=None, step_samples=deque(maxlen=4))
    speed = EnginePrefillSpeed(engine)
    assert speed() is None
    engine.step_samples.append(_sample(1, 100, 0, 0.2))
    assert speed() == pytest.approx(0.002)
    engine.step_samples.extend(_sample(i, 0, 4, 0.01) for i in range(2, 6))  # aged out
    assert prefill_s_per_token(engine.step_samples) is None
    assert speed() == pytest.approx(0.002)
    engine.kv_offload = SimpleNamespace(costs=SimpleNamespace(prefill_s_per_token=0.003))
    assert speed() == 0.003  # the host tier's measure, where it has one
