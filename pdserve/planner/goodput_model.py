"""Goodput of a prefill:decode split, estimated from measured step times (DistServe, §4).

Two step-latency models, fitted by non-negative least squares to the workers' step samples:

    prefill step   t = a + b·N + c·A      N: prompt tokens computed, A: Σ q_len·k_len
    decode step    t = a + b·C + c·B      C: context tokens read, B: sequences in the batch

For one fresh prompt of L tokens A = L², which is DistServe's a + b·L + c·L²; with a cached
prefix or a batch of prompts, A counts each sequence's attention work on its own.

`estimate_goodput` replays a workload (the lengths of recently finished requests) through a
small discrete-event simulation of P prefill and D decode workers driven by those models:

    Poisson arrivals ─► least-loaded prefill worker: FCFS batches up to a token budget
                     ─► (+ measured TTFT overhead: first token out; + KV load time)
                     ─► decode worker, round robin: continuous batching

and finds the highest arrival rate at which at least `attainment` of requests meet both SLOs
(TTFT and TPOT); a rate over the decode pool's full-batch capacity never does. Arrivals
are one fixed sequence of unit-rate gaps scaled by 1/rate (common random numbers), so every
split and every rate sees the same requests in the same order.
Everything here is plain numbers: no sockets, no clocks, no randomness beyond `seed`.

The offline planner (pdserve/planner/search.py, `pdserve plan`) runs this same simulation on models
read from a latency profile (pdserve/planner/latency_profile.py), one per phase and TP degree.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_SAMPLES = 8


@dataclass(frozen=True)
class LinearLatency:
    """t = intercept + Σ coef_i · feature_i, every term >= 0."""

    intercept: float
    coefs: tuple[float, ...]
    num_samples: int
    rel_error: float
    """Mean absolute error of the fit over the samples, relative to their mean time."""

    def __call__(self, *features: float) -> float:
        return self.intercept + sum(c * f for c, f in zip(self.coefs, features, strict=True))


def fit_nonnegative(features: Sequence[Sequence[float]], seconds: Sequence[float]
                    ) -> LinearLatency | None:
    """Least squares of seconds on [1, features...] with every coefficient >= 0.

    With three columns, exact NNLS is cheap: solve each subset of columns, keep the
    solutions with no negative coefficient, take the one with the smallest residual. A
    negative fitted cost would make a bigger batch look faster, which the simulation could
    then exploit. Returns None with fewer than MIN_SAMPLES samples."""
    y = np.asarray(seconds, dtype=np.float64)
    if len(y) < MIN_SAMPLES:
        return None
    x = np.column_stack([np.ones(len(y)), np.asarray(features, dtype=np.float64)])
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # conditioning: N^2 dwarfs 1
    xs = x / scale
    best: tuple[float, np.ndarray] | None = None
    columns = range(x.shape[1])
    for size in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(columns, size):
            solution, *_ = np.linalg.lstsq(xs[:, subset], y, rcond=None)
            if (solution < 0).any():
                continue
            residual = float(np.sum((xs[:, subset] @ solution - y) ** 2))
            if best is None or residual < best[0] - 1e-15:
                full = np.zeros(x.shape[1])
                full[list(subset)] = solution
                best = (residual, full)
    if best is None:  # every subset went negative: only possible if all times are <= 0
        return None
    coefs = best[1] / scale
    mean_abs = float(np.mean(np.abs(x @ coefs - y)))
    return LinearLatency(float(coefs[0]), tuple(float(c) for c in coefs[1:]), len(y),
                         mean_abs / max(float(np.mean(y)), 1e-12))


@dataclass(frozen=True)
class RequestShape:
    """One request of the workload, as the router saw it finish."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class SimulationConfig:
    ttft_slo_s: float
    tpot_slo_s: float
    attainment: float = 0.9
    """Fraction of requests that must meet both SLOs (DistServe's 90%)."""
    max_batched_tokens: int = 2048
    """A prefill worker's token budget per step (the engine's max_num_batched_tokens)."""
    max_num_seqs: int = 64
    """A decode worker's batch limit (the engine's max_num_seqs)."""
    handoff_s: float = 0.0
    """Time from a prompt's end on prefill to its first decode step (the KV transfer's
    fixed part)."""
    kv_transfer_s_per_token: float = 0.0
    """The KV transfer's part that grows with the prompt: KV bytes per token over the
    transfer rate between the pools (a latency profile's kv_transfer_bytes_per_s)."""
    ttft_overhead_s: float = 0.0
    """Time from a prompt's last step to its first token at the client (the hand-off's save
    tail, the router, HTTP); the hand-off reaches decode as late."""
    num_requests: int = 256
    """Requests simulated at least..."""
    max_num_requests: int = 2048
    """...and at most: in between, enough that the arrivals span three times a request's
    decode at a full batch (_num_simulated)."""
    seed: int = 0


@dataclass(frozen=True)
class PhaseModels:
    prefill: LinearLatency  # features (N, A)
    decode: LinearLatency  # features (C, B)


def simulate(workload: Sequence[RequestShape], rate: float, num_prefill: int, num_decode: int,
             models: PhaseModels, config: SimulationConfig, backlog: int = 0
             ) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of each of the requests arriving at `rate` per second (_num_simulated:
    config.num_requests, or more to reach the decode pool's steady state), after `backlog`
    requests already waiting at time 0 (a queue the fleet holds now: a burst, not a rate).
    Where the rate is over what the decode pool completes at full batches
    (decode_capacity_rps), every TPOT is infinite: its queue grows for as long as the load
    lasts, however few requests a run simulates."""
    rng = random.Random(config.seed)
    num = _num_simulated(workload, rate, models, config)
    arrivals = [0.0] * backlog + _arrivals(rng, num, rate)
    shapes = [workload[rng.randrange(len(workload))] for _ in range(num + backlog)]
    prompt_done = _simulate_prefill(arrivals, shapes, num_prefill, models.prefill, config)
    first_token_at = [t + config.ttft_overhead_s for t in prompt_done]
    if rate > num_decode * decode_capacity_rps(workload, models.decode, config):
        return [(first - arrival, math.inf)
                for arrival, first in zip(arrivals, first_token_at, strict=True)]
    finish_at = _simulate_decode(first_token_at, shapes, num_decode, models.decode, config)
    results = []
    for arrival, first, finish, shape in zip(arrivals, first_token_at, finish_at, shapes,
                                             strict=True):
        decoded = shape.output_tokens - 1
        results.append((first - arrival, (finish - first) / decoded if decoded > 0 else 0.0))
    return results


def decode_capacity_rps(workload: Sequence[RequestShape], model: LinearLatency,
                        config: SimulationConfig) -> float:
    """Requests per second one decode worker completes, at most: its batch full
    (config.max_num_seqs) of sequences at the workload's mean context, weighted by decode
    steps (a request of prompt L and output O decodes O - 1 steps at contexts L+1 .. L+O-1).

    A rate over it cannot be sustained, and a finite run does not show it: a waiting
    request's wait is spread over its output's tokens, so a pool a few percent over its
    capacity only misses the TPOT SLO after minutes of backlog, longer than the thousand
    requests a run simulates."""
    steps = sum(s.output_tokens - 1 for s in workload)
    if steps <= 0:
        return math.inf
    context = sum((s.output_tokens - 1) * (s.prompt_tokens + s.output_tokens / 2)
                  for s in workload) / steps
    batch = config.max_num_seqs
    tokens_per_s = batch / model(batch * context, batch)
    return tokens_per_s * len(workload) / steps


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """The arrival times simulate() gives its first `num` requests with config.seed = seed
    (so another simulator can be fed the same ones)."""
    return _arrivals(random.Random(seed), num, rate)


def _arrivals(rng: random.Random, num: int, rate: float) -> list[float]:
    """One seeded sequence of unit-rate exponential gaps, scaled by 1/rate: every rate sees
    the same requests in the same order (common random numbers)."""
    gaps = [rng.expovariate(1.0) for _ in range(num)]
    return list(itertools.accumulate(g / rate for g in gaps))


def _num_simulated(workload: Sequence[RequestShape], rate: float, models: PhaseModels,
                   config: SimulationConfig) -> int:
    """config.num_requests, or more (at most config.max_num_requests): enough that the
    arrivals span three times a request's decode at a full batch. Fewer, and the decode batch
    never grows to what the rate keeps running (256 requests at 800 req/s fit in one batch
    of each of a few decode workers), so decode-heavy splits looked unbounded."""
    outputs = sum(s.output_tokens for s in workload) / len(workload)
    context = sum(s.prompt_tokens for s in workload) / len(workload) + outputs / 2
    batch = config.max_num_seqs
    request_s = outputs * models.decode(batch * context, batch)
    wanted = math.ceil(rate * 3 * request_s)
    return max(config.num_requests, min(config.max_num_requests, wanted))


def ttft_overhead_s(prefill: LinearLatency,
                    observed: Sequence[tuple[RequestShape, float]]) -> float:
    """What requests' measured TTFTs add to their modelled prefill time, taken at the 10th
    percentile: the least-queued requests show the fixed part (save tail, router, HTTP)
    rather than the queueing that the simulation models itself."""
    if not observed:
        return 0.0
    residuals = [ttft - prefill(*_prefill_cost(shape)) for shape, ttft in observed]
    return max(0.0, float(np.quantile(residuals, 0.1)))


def _prefill_cost(shape: RequestShape) -> tuple[int, int]:
    """(N, A) of a request's whole prompt: the tokens past the cached prefix, attending to
    themselves and the prefix."""
    new = max(shape.prompt_tokens - shape.cached_tokens, 1)
    return new, new * shape.prompt_tokens


def _simulate_prefill(arrivals: list[float], shapes: Sequence[RequestShape], num_workers: int,
                      model: LinearLatency, config: SimulationConfig) -> list[float]:
    """When each request's first token is out. A request goes to the worker with the fewest
    requests on it (its running batch and its queue), ties taking turns: the router's
    least-load score, which counts requests and cannot see how far a batch has got. Each
    worker runs FCFS batches of the requests that have arrived, up to the token budget (a
    longer prompt runs alone, in budget-sized chunks)."""
    workers = [_PrefillWorker(model, config.max_batched_tokens, shapes)
               for _ in range(num_workers)]
    num_held = [0] * num_workers  # requests on each worker: running and queued
    ends: list[tuple[float, int]] = []  # heap: (when the running batch ends, worker)
    done = [0.0] * len(arrivals)

    def end_batch() -> None:
        at, k = heapq.heappop(ends)
        for i in workers[k].running:
            done[i] = at
        num_held[k] -= len(workers[k].running)
        if workers[k].start(at):  # everything queued arrived before `at`: one batch
            heapq.heappush(ends, (workers[k].free_at, k))

    for i, arrival in enumerate(arrivals):
        while ends and ends[0][0] <= arrival:
            end_batch()
        least = min(num_held)
        tied = [k for k, held in enumerate(num_held) if held == least]
        k = tied[i % len(tied)]
        workers[k].queue.append(i)
        num_held[k] += 1
        if num_held[k] == 1 and workers[k].start(arrival):  # it was idle: starts now
            heapq.heappush(ends, (workers[k].free_at, k))
    while ends:
        end_batch()
    return done


class _PrefillWorker:
    """One prefill worker's queue and running batch (the dispatch above drives the clock)."""

    def __init__(self, model: LinearLatency, budget: int,
                 shapes: Sequence[RequestShape]) -> None:
        self.model, self.budget, self.shapes = model, budget, shapes
        self.queue: collections.deque[int] = collections.deque()
        self.running: list[int] = []
        self.free_at = 0.0

    def start(self, now: float) -> bool:
        """Start the next FCFS batch at `now`, up to the token budget; False if none waits."""
        self.running = []
        tokens = attention = 0
        while self.queue:
            n, a = _prefill_cost(self.shapes[self.queue[0]])
            if self.running and tokens + n > self.budget:
                break
            self.running.append(self.queue.popleft())
            tokens, attention = tokens + n, attention + a
        if not self.running:
            return False
        if tokens <= self.budget:
            self.free_at = now + self.model(tokens, attention)
        else:  # one long prompt, chunked: each chunk attends to everything before it
            chunks = math.ceil(tokens / self.budget)
            self.free_at = now + chunks * self.model(tokens / chunks, attention / chunks)
        return True


def _simulate_decode(starts: list[float], shapes: Sequence[RequestShape], num_workers: int,
                     model: LinearLatency, config: SimulationConfig) -> list[float]:
    """When each request's last token is out. Requests reach the decode workers in
    first-token order, round robin, each once its KV is there; each worker steps its whole
    running batch, one token per sequence per step, and admits arrivals between steps."""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    ready = [start + config.handoff_s + config.kv_transfer_s_per_token * shape.prompt_tokens
             for start, shape in zip(starts, shapes, strict=True)]
    finish = list(starts)  # single-token requests end with their first token
    for w in range(num_workers):
        mine = sorted((i for i in order[w::num_workers] if shapes[i].output_tokens > 1),
                      key=lambda i: ready[i])
        ends = _decode_worker([ready[i] for i in mine],
                              [shapes[i] for i in mine], model, config.max_num_seqs)
        for i, end in zip(mine, ends, strict=True):
            finish[i] = end
    return finish


def _decode_worker(ready_at: list[float], shapes: Sequence[RequestShape],
                   model: LinearLatency, max_num_seqs: int) -> list[float]:
    """One decode worker, event to event: between two events (an arrival joining, a request
    finishing) the batch is fixed, so k steps take k·(a + c·B + b·C0) + b·B·k(k-1)/2 (each
    step reads B more context tokens) and the simulation jumps over them in one go."""
    a, (b, c) = model.intercept, model.coefs
    finish = [0.0] * len(ready_at)
    now, nxt = 0.0, 0
    running: list[list[int]] = []  # [index, tokens left to generate, context length]
    while nxt < len(ready_at) or running:
        if not running:
            now = max(now, ready_at[nxt])
        while nxt < len(ready_at) and ready_at[nxt] <= now and len(running) < max_num_seqs:
            s = shapes[nxt]
            running.append([nxt, s.output_tokens - 1, s.prompt_tokens + 1])
            nxt += 1
        batch = len(running)
        context = sum(r[2] for r in running)
        per_step = a + c * batch + b * context

        def elapsed(k: int, per_step=per_step, batch=batch) -> float:
            return k * per_step + b * batch * k * (k - 1) / 2

        steps = min(r[1] for r in running)
        if nxt < len(ready_at) and len(running) < max_num_seqs:
            # Stop at the first step boundary at or after the next arrival (it joins there).
            wait = ready_at[nxt] - now
            if elapsed(steps) > wait:
                steps = max(1, bisect.bisect_left(range(steps + 1), wait, key=elapsed))
        now += elapsed(steps)
        for r in running:
            r[1] -= steps
            r[2] += steps
            if r[1] == 0:
                finish[r[0]] = now
        running = [r for r in running if r[1] > 0]
    return finish


def attainment(results: Sequence[tuple[float, float]], config: SimulationConfig) -> float:
    ok = sum(1 for ttft, tpot in results
             if ttft <= config.ttft_slo_s and tpot <= config.tpot_slo_s)
    return ok / max(len(results), 1)


def estimate_goodput(workload: Sequence[RequestShape], num_prefill: int, num_decode: int,
                     models: PhaseModels, config: SimulationConfig,
                     max_rate: float = 1e5) -> float:
    """The highest arrival rate (req/s) at which the split meets the attainment target; 0 if
    it misses it even with requests arriving alone."""

    def meets(rate: float) -> bool:
        results = simulate(workload, rate, num_prefill, num_decode, models, config)
        return attainment(results, config) >= config.attainment

    low = 1e-3
    if not meets(low):
        return 0.0
    high = low * 2
    while high < max_rate and meets(high):
        low, high = high, high * 2
    if high >= max_rate:
        return max_rate
    for _ in range(12):  # to within 2^-12 of the bracket, on a log scale
        mid = math.sqrt(low * high)
        low, high = (mid, high) if meets(mid) else (low, mid)
    return low


def goodput_by_split(workload: Sequence[RequestShape], num_workers: int, models: PhaseModels,
                     config: SimulationConfig) -> dict[int, float]:
    """Estimated goodput for each split of num_workers into P >= 1 prefill and D >= 1 decode
    workers, keyed by P."""
    return {p: estimate_goodput(workload, p, num_workers - p, models, config)
            for p in range(1, num_workers)}


def fleet_size(workload: Sequence[RequestShape], rate: float, models: PhaseModels,
               config: SimulationConfig, max_pool_workers: int = 128
               ) -> tuple[int, int] | None:
    """The smallest fleet, (prefill, decode) workers, whose predicted attainment of `rate`
    arrivals of `workload` meets config.attainment; None where no fleet of at most
    `max_pool_workers` a pool does (an SLO that even a lone request misses, say).

    Each pool is sized first with the other as large as allowed (the least it can be in any
    fleet that meets the target), by bisection: attainment grows with a pool's size. The
    two together may still miss it (each pool spends some of the SLO's slack), so the pair
    then grows by the one worker that raises attainment most, until it meets the target."""
    target = config.attainment

    def attained(num_prefill: int, num_decode: int) -> float:
        return attainment(simulate(workload, rate, num_prefill, num_decode, models, config),
                          config)

    big = max_pool_workers
    if rate <= 0 or big < 1 or attained(big, big) < target:
        return None

    def least(pool_size: Callable[[int], tuple[int, int]]) -> int:
        low, high = 1, big  # high meets the target
        while low < high:
            mid = (low + high) // 2
            if attained(*pool_size(mid)) >= target:
                high = mid
            else:
                low = mid + 1
        return low

    prefill = least(lambda n: (n, big))
    decode = least(lambda n: (big, n))
    current = attained(prefill, decode)
    while current < target and (prefill < big or decode < big):
        more_prefill = attained(prefill + 1, decode) if prefill < big else -1.0
        more_decode = attained(prefill, decode + 1) if decode < big else -1.0
        if more_prefill >= more_decode:
            prefill, current = prefill + 1, more_prefill
        else:
            decode, current = decode + 1, more_decode
    return (prefill, decode) if current >= target else None
