"""The controller's latency fits and its prefill/decode simulation, against hand-computed
values and a step-by-step reference."""

from __future__ import annotations

import random

import pytest

from pdserve.planner.goodput_model import (
    MIN_SAMPLES,
    LinearLatency,
    PhaseModels,
    RequestShape,
    SimulationConfig,
    _decode_worker,
    _simulate_prefill,
    attainment,
    decode_capacity_rps,
    estimate_goodput,
    fit_nonnegative,
    fleet_size,
    goodput_by_split,
    poisson_arrivals,
    simulate,
    ttft_overhead_s,
)

PREFILL = LinearLatency(0.01, (1e-4, 1e-8), 0, 0.0)  # a + b·N + c·A
DECODE = LinearLatency(0.003, (1e-6, 1e-4), 0, 0.0)  # a + b·C + c·B
MODELS = PhaseModels(PREFILL, DECODE)


def test_fit_recovers_coefficients_from_noisy_samples():
    rng = random.Random(0)
    features, seconds = [], []
    for _ in range(400):
        lengths = [rng.randint(16, 1024) for _ in range(rng.randint(1, 4))]
        n, a = sum(lengths), sum(x * x for x in lengths)
        features.append((n, a))
        seconds.append((0.005 + 2e-5 * n + 3e-9 * a) * rng.uniform(0.98, 1.02))
    fit = fit_nonnegative(features, seconds)
    assert fit is not None and fit.num_samples == 400
    # 2% multiplicative noise over 400 samples: each coefficient lands within 15%.
    assert fit.intercept == pytest.approx(0.005, rel=0.15)
    assert fit.coefs[0] == pytest.approx(2e-5, rel=0.15)
    assert fit.coefs[1] == pytest.approx(3e-9, rel=0.15)
    assert fit.rel_error < 0.02


def test_fit_never_returns_a_negative_cost():
    """Decode time that does not grow with context: plain least squares may give the context
    term a small negative slope from noise; the fit must pin it at zero instead."""
    rng = random.Random(1)
    features, seconds = [], []
    for _ in range(200):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(10, 2000)
        features.append((context, batch))
        seconds.append(0.004 + 2e-4 * batch - 1e-9 * context + rng.gauss(0, 1e-4))
    fit = fit_nonnegative(features, seconds)
    assert fit is not None
    assert fit.intercept >= 0 and all(c >= 0 for c in fit.coefs)
    assert fit.coefs[1] == pytest.approx(2e-4, rel=0.1)


def test_fit_needs_enough_samples():
    assert fit_nonnegative([(1, 1)] * (MIN_SAMPLES - 1), [0.1] * (MIN_SAMPLES - 1)) is None
    assert fit_nonnegative([(1, 1)] * MIN_SAMPLES, [0.1] * MIN_SAMPLES) is not None


def test_requests_alone_take_exactly_their_model_times():
    """At a rate where requests never overlap, TTFT is one prefill of the uncached prompt plus
    the fixed overhead, and TPOT the hand-off plus the decode steps over a context growing by
    one per step, per token."""
    shape = RequestShape(prompt_tokens=300, cached_tokens=100, output_tokens=20)
    config = SimulationConfig(ttft_slo_s=1, tpot_slo_s=1, num_requests=32, handoff_s=0.002,
                              ttft_overhead_s=0.004)
    results = simulate([shape], 1e-5, 2, 3, MODELS, config)
    new = 200
    ttft = PREFILL(new, new * 300) + config.ttft_overhead_s
    steps = [DECODE(301 + k, 1) for k in range(19)]
    tpot = (config.handoff_s + sum(steps)) / 19
    # Arrival times run to ~1e6 s at this rate: differences of them keep ~1e-10 s.
    for got_ttft, got_tpot in results:
        assert got_ttft == pytest.approx(ttft, abs=1e-9)
        assert got_tpot == pytest.approx(tpot, abs=1e-9)


def _decode_step_by_step(ready_at, shapes, model, max_num_seqs):
    """The decode worker one step at a time: the reference for the event-jumping version."""
    finish = [0.0] * len(ready_at)
    now, nxt, running = 0.0, 0, []
    while nxt < len(ready_at) or running:
        if not running:
            now = max(now, ready_at[nxt])
        while nxt < len(ready_at) and ready_at[nxt] <= now and len(running) < max_num_seqs:
            running.append([nxt, shapes[nxt].output_tokens - 1, shapes[nxt].prompt_tokens + 1])
            nxt += 1
        now += model(sum(r[2] for r in running), len(running))
        for r in running:
            r[1] -= 1
            r[2] += 1
            if r[1] == 0:
                finish[r[0]] = now
        running = [r for r in running if r[1] > 0]
    return finish


@pytest.mark.parametrize("max_num_seqs", [3, 256])
def test_decode_event_jumps_match_stepping(max_num_seqs):
    rng = random.Random(2)
    ready, t = [], 0.0
    for _ in range(60):
        t += rng.expovariate(40.0)
        ready.append(t)
    shapes = [RequestShape(rng.randint(1, 500), 0, rng.randint(2, 80)) for _ in ready]
    got = _decode_worker(ready, shapes, DECODE, max_num_seqs)
    want = _decode_step_by_step(ready, shapes, DECODE, max_num_seqs)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_prefill_goes_to_the_worker_holding_the_fewest_requests():
    """The router's least-load score counts requests (ties take turns), blind to how long
    they take: the fourth request joins the worker running one long prompt rather than the
    one holding two short ones, which is free far sooner. The simulation used to send each
    request to the worker expected free first, a router that knows every worker's remaining
    work, and so queued prompts less than served (or DistServe's simulator, which counts
    too): the fourth request then ended at 2.03 s."""
    model = LinearLatency(1.0, (1e-3, 0.0), 0, 0.0)  # 1 s a batch + 1 ms a prompt token
    config = SimulationConfig(1, 1, max_batched_tokens=10_000)
    short, long = RequestShape(10, 0, 2), RequestShape(4000, 0, 2)
    done = _simulate_prefill([0.0, 0.001, 0.002, 0.003], [short, long, short, short], 2,
                             model, config)
    # worker 0: request 0 at 0 s, then 2 (a tie with worker 1, worker 0's turn) at 1.01 s;
    # worker 1: the long request 1 from 0.001 s to 5.001 s, then 3 (1 request against 2)
    assert done == pytest.approx([1.01, 5.001, 2.02, 6.011])


def test_decode_capacity_is_what_full_batches_complete():
    """Waves of max_num_seqs identical requests, all ready at once: the step simulation
    ends them exactly at num / decode_capacity_rps (the context grows linearly, so a wave's
    steps average the model at the mean context)."""
    config = SimulationConfig(1, 1, max_num_seqs=8)
    shape = RequestShape(100, 0, 33)
    capacity = decode_capacity_rps([shape], DECODE, config)
    assert capacity == pytest.approx(8 / (32 * DECODE(8 * 116.5, 8)))
    finish = _decode_worker([0.0] * 40, [shape] * 40, DECODE, 8)
    assert max(finish) == pytest.approx(40 / capacity, rel=1e-9)
    assert decode_capacity_rps([RequestShape(100, 0, 1)], DECODE, config) == float("inf")


def test_a_rate_over_the_decode_pools_capacity_misses_every_tpot():
    """2% over the decode pool's capacity, 1000 requests only queue ~20 deep by the end of
    the run, and that wait is spread over 63 tokens: the step simulation alone met the TPOT
    SLO there (goodput above capacity, +7% against DistServe's simulator on its OPT-13B
    profile with one decode worker). No fleet sustains such a rate: every TPOT is now
    infinite over capacity, and the goodput stays within it."""
    config = SimulationConfig(10.0, 0.05, max_num_seqs=32, num_requests=1000)
    shape = RequestShape(64, 0, 64)
    capacity = decode_capacity_rps([shape], DECODE, config)
    for num_decode in (1, 2):
        pool = num_decode * capacity
        under = simulate([shape], 0.98 * pool, 8, num_decode, MODELS, config)
        assert attainment(under, config) >= 0.9
        over = simulate([shape], 1.02 * pool, 8, num_decode, MODELS, config)
        assert all(tpot == float("inf") for _, tpot in over)
        assert attainment(over, config) == 0.0
        assert estimate_goodput([shape], 8, num_decode, MODELS, config) <= pool


def test_poisson_arrivals_are_the_simulations_own():
    """Another simulator fed poisson_arrivals sees simulate()'s requests: requests alone
    (no queueing) end their prefill exactly one prefill after these arrival times."""
    shape = RequestShape(100, 0, 1)
    config = SimulationConfig(1, 1, num_requests=50, seed=7)
    arrivals = poisson_arrivals(50, 1e-3, 7)
    assert len(arrivals) == 50 and arrivals == sorted(arrivals)
    results = simulate([shape], 1e-3, 1, 1, MODELS, config)
    assert [ttft for ttft, _ in results] == pytest.approx([PREFILL(100, 100 * 100)] * 50)
    assert poisson_arrivals(50, 2e-3, 7) == pytest.approx([a / 2 for a in arrivals])


def test_goodput_is_where_attainment_crosses_the_target():
    workload = [RequestShape(256, 0, 64), RequestShape(512, 128, 16)]
    config = SimulationConfig(ttft_slo_s=0.3, tpot_slo_s=0.02)
    goodput = estimate_goodput(workload, 1, 2, MODELS, config)
    assert goodput > 0
    assert attainment(simulate(workload, goodput, 1, 2, MODELS, config), config) >= 0.9
    assert attainment(simulate(workload, 2 * goodput, 1, 2, MODELS, config), config) < 0.9


def test_unreachable_slo_gives_zero_goodput():
    config = SimulationConfig(ttft_slo_s=0.001, tpot_slo_s=1)  # below one prefill step
    assert estimate_goodput([RequestShape(256, 0, 8)], 1, 1, MODELS, config) == 0.0


def test_the_bottleneck_phase_gets_the_workers():
    prefill_heavy = [RequestShape(2000, 0, 2)]
    decode_heavy = [RequestShape(32, 0, 512)]
    config = SimulationConfig(ttft_slo_s=0.5, tpot_slo_s=0.02)
    by_split = goodput_by_split(prefill_heavy, 4, MODELS, config)
    assert max(by_split, key=by_split.get) == 3 and by_split[3] > 2 * by_split[1]
    by_split = goodput_by_split(decode_heavy, 4, MODELS, config)
    assert max(by_split, key=by_split.get) == 1 and by_split[1] > 2 * by_split[3]


def test_ttft_overhead_is_what_the_least_queued_requests_add():
    shape = RequestShape(100, 0, 4)
    alone = PREFILL(100, 100 * 100)
    observed = [(shape, alone + 0.03)] * 20 + [(shape, alone + 2.0)] * 5  # 5 queued ones
    assert ttft_overhead_s(PREFILL, observed) == pytest.approx(0.03)
    assert ttft_overhead_s(PREFILL, []) == 0.0
    assert ttft_overhead_s(PREFILL, [(shape, alone / 2)] * 3) == 0.0  # never negative


def test_a_decode_pool_serves_no_more_than_its_batches_hold():
    """Little's law: D decode workers of B sequences, each request decoding for T seconds at
    least, serve at most D·B/T requests a second. A 256-request simulation never filled a
    batch at such rates and put a decode-heavy split's goodput at hundreds of req/s; the
    simulation now runs until arrivals span three requests' decode."""
    sim = SimulationConfig(1.0, 0.05, max_num_seqs=32)
    shape = RequestShape(64, 0, 512)
    # each decode step of a full batch takes at least the model at 32 sequences of 64 tokens
    min_request_s = (shape.output_tokens - 1) * DECODE(32 * 64, 32)
    for num_decode in (1, 3):
        bound = num_decode * 32 / min_request_s
        goodput = estimate_goodput([shape], 1, num_decode, MODELS, sim)
        assert 0 < goodput <= 1.05 * bound, (num_decode, goodput, bound)


@pytest.mark.parametrize("shape,rate", [((1500, 0, 2), 6.0), ((50, 0, 1000), 6.0),
                                        ((512, 0, 64), 20.0), ((800, 0, 200), 10.0)])
def test_fleet_size_is_the_smallest_fleet_a_sweep_finds(shape, rate):
    workload = [RequestShape(*shape)]
    models, config = PhaseModels(PREFILL, DECODE), SimulationConfig(0.5, 0.05)
    meets = {(p, d): attainment(simulate(workload, rate, p, d, models, config), config)
             >= config.attainment for p in range(1, 9) for d in range(1, 9)}
    smallest = min(p + d for (p, d), ok in meets.items() if ok)
    prefill, decode = fleet_size(workload, rate, models, config, max_pool_workers=8)
    assert meets[(prefill, decode)]
    assert prefill + decode == smallest  # this model's pools are separable: exact


def test_no_fleet_meets_an_slo_a_lone_request_misses():
    models = PhaseModels(PREFILL, DECODE)
    workload = [RequestShape(1500, 0, 2)]  # its prefill alone takes 0.17 s
    assert fleet_size(workload, 1.0, models, SimulationConfig(0.1, 0.05)) is None
    assert fleet_size(workload, 0.0, models, SimulationConfig(0.5, 0.05)) is None


def test_a_backlog_waits_at_the_start_and_delays_the_arrivals_behind_it():
    workload = [RequestShape(1000, 0, 4)]
    models, config = PhaseModels(PREFILL, DECODE), SimulationConfig(0.5, 0.05)
    plain = simulate(workload, 2.0, 1, 1, models, config)
    queued = simulate(workload, 2.0, 1, 1, models, config, backlog=20)
    assert len(queued) == len(plain) + 20
    # the queued requests wait their turn (one prefill worker: ~0.12 s a prompt) ...
    assert queued[19][0] > 15 * PREFILL(1000, 1000 * 1000)
    # ... and the arrivals behind them are later than without them, never sooner
    assert all(q[0] >= p[0] for q, p in zip(queued[20:], plain, strict=True))
    assert attainment(queued, config) < attainment(plain, config)
