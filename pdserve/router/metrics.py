"""Prometheus metrics of the router, with vLLM's names (prefix `pdserve:`) where the meaning is
the same. Latencies are observed at the router, i.e. as the client sees them; queue lengths,
KV usage and prefix-cache counts come from the workers' status heartbeats at scrape time, and
the goodput controller's estimate from its last tick.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pdserve.router.controller import GoodputController
from pdserve.router.worker_client import WorkerClient

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 2.5, 5.0)


class RouterMetrics:
    def __init__(self, model_name: str, controller: GoodputController | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()
                 ) -> Histogram:
            return Histogram(name, doc, labels + list(extra), buckets=buckets,
                             registry=self.registry)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        self.ttft = hist("pdserve:time_to_first_token_seconds", "Time to first token",
                         LATENCY_BUCKETS_S)
        self.tpot = hist("pdserve:request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request",
                         TOKEN_BUCKETS_S)
        self.itl = hist("pdserve:inter_token_latency_seconds", "Time between output deltas",
                        TOKEN_BUCKETS_S)
        self.e2e = hist("pdserve:e2e_request_latency_seconds", "End-to-end request latency",
                        LATENCY_BUCKETS_S)
        # pdserve/router/phases.py: the first-token path's phases add up to the TTFT above
        self.request_phase = hist(
            "pdserve:request_phase_seconds",
            "Time of a request in each phase of its first-token path (pdserve/router/phases.py)",
            PHASE_BUCKETS_S, ["phase"])
        self.router_added = hist(
            "pdserve:first_token_router_added_seconds",
            "Time to first token less the first worker's own phases (queue, prefill, saves): "
            "routing, the sockets both ways and the token's way out (pdserve/router/phases.py "
            "ROUTER_PHASES)", PHASE_BUCKETS_S)
        self.handover_phase = hist(
            "pdserve:request_handover_phase_seconds",
            "Time of a request in each phase of the prefill -> decode hand-over, after the "
            "first token (pdserve/router/phases.py)", PHASE_BUCKETS_S, ["phase"])
        self.prompt_tokens = counter("pdserve:prompt_tokens_total", "Prompt tokens")
        self.generation_tokens = counter("pdserve:generation_tokens_total", "Generated tokens")
        self.cached_tokens = counter("pdserve:prompt_tokens_cached_total",
                                     "Prompt tokens served from a prefix cache")
        self.external_queries = counter("pdserve:external_prefix_cache_queries_total",
                                        "Prompt tokens looked up in the KV store")
        self.external_hits = counter("pdserve:external_prefix_cache_hits_total",
                                     "Prompt tokens the KV store already held")
        self.success = counter("pdserve:request_success_total", "Finished requests",
                               ["finished_reason"])
        self.rejected = counter("pdserve:request_rejected_total",
                                "Requests refused by admission control or for lack of workers",
                                ["reason"])
        self.migrations = counter(
            "pdserve:request_migrations_total",
            "Requests moved off a worker that died or hung (pdserve/router/dispatch.py); resumed: "
            "whether it had streamed outputs, which the next worker recomputed",
            ["role", "resumed"])
        self.placements = counter(
            "pdserve:request_placements_total",
            "Disaggregated requests by where their prompt was computed: local (on the decode "
            "worker, pdserve/router/placement.py) or remote (on a prefill worker)",
            ["placement"])
        self._workers: Sequence[WorkerClient] = ()
        self.registry.register(_WorkerCollector(self))
        if controller is not None:
            self.registry.register(_ControllerCollector(model_name, controller))

    def labels(self, metric, *extra: str):
        return metric.labels(self.model_name, *extra)

    def render(self, workers: Sequence[WorkerClient]) -> bytes:
        self._workers = workers
        return generate_latest(self.registry)


class _WorkerCollector(Collector):
    """Metrics the workers report in their status heartbeats, read at scrape time."""

    def __init__(self, owner: RouterMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "worker", "role"]

        def family(kind, name: str, doc: str, extra: Sequence[str] = ()):
            return kind(name, doc, labels=labels + list(extra))

        running = family(GaugeMetricFamily, "pdserve:num_requests_running",
                         "Requests in the worker's running batch")
        waiting = family(GaugeMetricFamily, "pdserve:num_requests_waiting",
                         "Requests queued on the worker (incl. those loading KV)")
        usage = family(GaugeMetricFamily, "pdserve:kv_cache_usage_perc",
                       "Fraction of the worker's KV blocks held by requests")
        queries = family(CounterMetricFamily, "pdserve:prefix_cache_queries",
                         "Prompt tokens looked up in the worker's prefix cache")
        hits = family(CounterMetricFamily, "pdserve:prefix_cache_hits",
                      "Prompt tokens found in the worker's prefix cache")
        preemptions = family(CounterMetricFamily, "pdserve:num_preemptions",
                             "Requests preempted (KV freed, recomputed later)")
        kv_bytes = family(CounterMetricFamily, "pdserve:kv_transfer_bytes",
                          "KV bytes moved through the KV store", ["direction"])
        kv_seconds = family(SummaryMetricFamily, "pdserve:kv_transfer_seconds",
                            "Time from starting a KV save/load to its completion",
                            ["direction"])
        # the tiers below each worker's pool (pdserve/serve/engine/kv_tiers.py)
        tier_hits = family(CounterMetricFamily, "pdserve:prefix_cache_hit_tokens",
                           "Prompt tokens whose KV was found, by tier (device: the worker's "
                           "pool; host: its DRAM; store: the fleet store)", ["tier"])
        tier_read = family(CounterMetricFamily, "pdserve:kv_tier_read_bytes",
                           "KV bytes loaded back from a tier below the pool", ["tier"])
        tier_written = family(CounterMetricFamily, "pdserve:kv_tier_written_bytes",
                              "KV bytes written down into a tier", ["tier"])
        tier_evictions = family(CounterMetricFamily, "pdserve:kv_tier_evictions",
                                "Blocks a tier evicted (to the tier below, if any)", ["tier"])
        tier_dropped = family(CounterMetricFamily, "pdserve:kv_tier_writes_dropped",
                              "Write-downs dropped (queue full, block evicted meanwhile)",
                              ["tier"])
        handoff_bytes = family(CounterMetricFamily, "pdserve:kv_handoff_bytes",
                               "KV bytes hand-offs moved into a decode worker's pool")
        handoff_reused = family(CounterMetricFamily, "pdserve:kv_handoff_reused_bytes",
                                "KV bytes of hand-offs not moved: the decode worker held those "
                                "blocks (its pool or host tier)")
        # a decode worker's choice per hand-off over a link, and what each link gave
        # (pdserve/handoff/link_policy.py)
        source_choices = family(CounterMetricFamily, "pdserve:kv_handoff_source_choices",
                                "Hand-offs over a link by where their KV came from: moved "
                                "(transfer), the fleet store, or recomputed, by predicted "
                                "time", ["source"])
        link_rates = family(GaugeMetricFamily, "pdserve:kv_link_bytes_per_second",
                            "KV bytes per second a decode worker measured from each peer "
                            "(store: the fleet store)", ["peer"])
        tier_blocks = family(GaugeMetricFamily, "pdserve:kv_tier_blocks",
                             "Blocks a worker's host tier holds", ["tier"])
        tier_choices = family(CounterMetricFamily, "pdserve:kv_tier_load_decisions",
                              "Prefixes found below the pool: loaded, or recomputed because "
                              "loading was measured slower", ["decision"])
        # vLLM's spec-decode counters (pdserve/serve/engine/spec_decode.py), from workers that
        # speculate
        spec_drafts = family(CounterMetricFamily, "pdserve:spec_decode_num_drafts",
                             "Verify steps of a sequence that carried drafts")
        spec_draft_tokens = family(CounterMetricFamily, "pdserve:spec_decode_num_draft_tokens",
                                   "Draft tokens proposed")
        spec_accepted = family(CounterMetricFamily, "pdserve:spec_decode_num_accepted_tokens",
                               "Draft tokens accepted")
        spec_per_pos = family(CounterMetricFamily,
                              "pdserve:spec_decode_num_accepted_tokens_per_pos",
                              "Draft tokens accepted, by draft position", ["position"])
        # MoE load (pdserve/serve/models/moe.py): per-expert assignments, and those dropped past
        # the expert capacity, summed over the worker's MoE layers
        moe_tokens = family(CounterMetricFamily, "pdserve:moe_expert_tokens",
                            "(token, expert) assignments each routed expert computed",
                            ["expert"])
        moe_dropped = family(CounterMetricFamily, "pdserve:moe_dropped_tokens",
                             "(token, expert) assignments dropped past the expert capacity")
        for worker in self._owner._workers:
            status = worker.status
            if status is None:
                continue
            key = [self._owner.model_name, worker.worker_id, worker.role]
            if status.moe_expert_tokens:
                for expert, count in enumerate(status.moe_expert_tokens):
                    moe_tokens.add_metric(key + [str(expert)], count)
                moe_dropped.add_metric(key, status.moe_dropped_tokens)
            spec = status.spec_decode
            if spec:
                spec_drafts.add_metric(key, spec.get("num_drafts", 0.0))
                spec_draft_tokens.add_metric(key, spec.get("num_draft_tokens", 0.0))
                spec_accepted.add_metric(key, spec.get("num_accepted_tokens", 0.0))
                for name, count in spec.items():
                    if name.startswith("accepted_pos_"):
                        spec_per_pos.add_metric(key + [name.removeprefix("accepted_pos_")],
                                                count)
            running.add_metric(key, status.num_running)
            waiting.add_metric(key, status.num_waiting)
            used = status.num_total_blocks - status.num_free_blocks
            usage.add_metric(key, used / max(status.num_total_blocks, 1))
            queries.add_metric(key, status.num_prefix_queried_tokens)
            hits.add_metric(key, status.num_prefix_hit_tokens)
            preemptions.add_metric(key, status.num_preemptions)
            _tier_metrics(status.kv_tiers, key, tier_hits, tier_read, tier_written,
                          tier_evictions, tier_dropped, tier_blocks, tier_choices)
            totals = status.kv_transfer
            if "handoff_bytes" in totals:
                handoff_bytes.add_metric(key, totals["handoff_bytes"])
                handoff_reused.add_metric(key, totals.get("handoff_reused_bytes", 0.0))
            for name, value in totals.items():
                if name.startswith("handoff_source_"):
                    source_choices.add_metric(key + [name.removeprefix("handoff_source_")],
                                              value)
                elif name.startswith("link_bytes_per_s:"):
                    link_rates.add_metric(key + [name.removeprefix("link_bytes_per_s:")],
                                          value)
            for direction, verb in (("save", "saved"), ("load", "loaded")):
                if f"{direction}_count" not in totals:
                    continue
                kv_bytes.add_metric(key + [direction], totals[f"{verb}_bytes"])
                kv_seconds.add_metric(key + [direction], count_value=totals[f"{direction}_count"],
                                      sum_value=totals[f"{direction}_seconds"])
        yield from (running, waiting, usage, queries, hits, preemptions, kv_bytes, kv_seconds,
                    spec_drafts, spec_draft_tokens, spec_accepted, spec_per_pos, moe_tokens,
                    moe_dropped, tier_hits, tier_read, tier_written, tier_evictions,
                    tier_dropped, tier_blocks, tier_choices, handoff_bytes, handoff_reused,
                    source_choices, link_rates)


def _tier_metrics(tiers: dict[str, float], key: list[str], hits, read, written, evictions,
                  dropped, blocks, choices) -> None:
    """One worker's WorkerStatus.kv_tiers into the tier families."""
    for tier in ("device", "host", "store"):
        for family, counter in ((hits, "hit_tokens"), (read, "read_bytes"),
                                (written, "written_bytes"), (evictions, "evictions"),
                                (dropped, "writes_dropped")):
            value = tiers.get(f"{tier}_{counter}")
            if value is not None:
                family.add_metric(key + [tier], value)
    if "host_blocks" in tiers:
        blocks.add_metric(key + ["host"], tiers["host_blocks"])
    for decision, name in (("load", "loads_chosen"), ("recompute", "recomputes_chosen")):
        if name in tiers:
            choices.add_metric(key + [decision], tiers[name])


class _ControllerCollector(Collector):
    """The goodput controller's last estimate: recommended workers per role (the split of
    this fleet), the workers per role the load needs (the fleet's size), and the estimated
    goodput of each split (by its number of prefill workers)."""

    def __init__(self, model_name: str, controller: GoodputController) -> None:
        self._model_name = model_name
        self._controller = controller

    def collect(self) -> Iterable[Metric]:
        name = [self._model_name]
        flips = CounterMetricFamily("pdserve:controller_role_flips",
                                    "Workers the controller moved between prefill and decode",
                                    labels=["model_name"])
        flips.add_metric(name, self._controller.num_flips)
        yield flips
        estimate = self._controller.estimate
        if estimate is None:
            return
        recommended = GaugeMetricFamily("pdserve:controller_recommended_workers",
                                        "Workers per role the controller recommends",
                                        labels=["model_name", "role"])
        best = estimate.best_prefill
        recommended.add_metric(name + ["prefill"], best)
        recommended.add_metric(name + ["decode"], estimate.num_workers - best)
        needed = GaugeMetricFamily("pdserve:controller_needed_workers",
                                   "Workers per role the smallest fleet predicted to meet the "
                                   "SLOs on the current load needs (absent: none arrives, or "
                                   "no fleet meets them)", labels=["model_name", "role"])
        if estimate.needed is not None:
            needed.add_metric(name + ["prefill"], estimate.needed[0])
            needed.add_metric(name + ["decode"], estimate.needed[1])
        goodput = GaugeMetricFamily("pdserve:controller_estimated_goodput",
                                    "Estimated goodput (req/s meeting the SLOs) of a split",
                                    labels=["model_name", "num_prefill", "num_decode"])
        for p, value in estimate.goodput.items():
            goodput.add_metric(name + [str(p), str(estimate.num_workers - p)], value)
        yield from (recommended, needed, goodput)


class SupervisorCollector(Collector):
    """Restarts of each process `pdserve up` supervises, from the JSON file the launcher
    rewrites on every restart ({"restarts": {"decode-0": 1, ...}}; app/launcher/supervision.py).
    Read at scrape time, so the count survives a restart of the router itself."""

    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self) -> Iterable[Metric]:
        restarts = CounterMetricFamily(
            "pdserve:process_restarts",
            "Times `pdserve up` restarted a process of this cluster after it died",
            labels=["process"])
        try:
            with open(self._path) as f:
                counts = json.load(f).get("restarts", {})
        except (OSError, ValueError, AttributeError):
            counts = {}  # not written yet, or mid-replace: nothing to report this scrape
        for process, count in sorted(counts.items()):
            if isinstance(count, int):
                restarts.add_metric([str(process)], count)
        yield restarts
