"""Prometheus metrics of the router, with vLLM's names (prefix `pdserve:`) where the meaning is
the same. Latencies are observed at the router, i.e. as the client sees them; queue lengths,
KV usage and prefix-cache counts come from the workers' status heartbeats at scrape time.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.router.worker_client import WorkerClient

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 2.5, 5.0)


class RouterMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(name, doc, labels + list(extra), registry=self.registry)

        self.ttft = hist("pdserve:time_to_first_token_seconds", "Time to first token",
                         LATENCY_BUCKETS_S)
        self.tpot = hist("pdserve:request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request",
                         TOKEN_BUCKETS_S)
        self.itl = hist("pdserve:inter_token_latency_seconds", "Time between output deltas",
                        TOKEN_BUCKETS_S)
        self.e2e = hist("pdserve:e2e_request_latency_seconds", "End-to-end request latency",
                        LATENCY_BUCKETS_S)
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
        self.running = gauge("pdserve:num_requests_running", "Requests running on workers",
                             ["worker", "role"])
        self.waiting = gauge("pdserve:num_requests_waiting", "Requests queued on workers",
                             ["worker", "role"])
        self.kv_usage = gauge("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              ["worker", "role"])
        self.prefix_queries = gauge("pdserve:prefix_cache_queries",
                                    "Prompt tokens looked up in the worker's prefix cache",
                                    ["worker", "role"])
        self.prefix_hits = gauge("pdserve:prefix_cache_hits",
                                 "Prompt tokens found in the worker's prefix cache",
                                 ["worker", "role"])
        self.preemptions = gauge("pdserve:num_preemptions", "Preemptions on the worker",
                                 ["worker", "role"])
        self.kv_transfer_bytes = counter("pdserve:kv_transfer_bytes_total",
                                         "KV bytes handed from prefill to decode", ["direction"])
        self.kv_transfer_seconds = hist("pdserve:kv_transfer_seconds",
                                        "Time from prefill hand-off to the decode's first delta",
                                        LATENCY_BUCKETS_S)

    def labels(self, metric, *extra: str):
        return metric.labels(self._model, *extra)

    def render(self, workers: Sequence[WorkerClient]) -> bytes:
        for worker in workers:
            status = worker.status
            if status is None:
                continue
            key = (worker.worker_id, worker.role)
            self.labels(self.running, *key).set(status.num_running)
            self.labels(self.waiting, *key).set(status.num_waiting)
            used = status.num_total_blocks - status.num_free_blocks
            self.labels(self.kv_usage, *key).set(used / max(status.num_total_blocks, 1))
            self.labels(self.prefix_queries, *key).set(status.num_prefix_queries_tokens)
            self.labels(self.prefix_hits, *key).set(status.num_prefix_hit_tokens)
            self.labels(self.preemptions, *key).set(status.num_preemptions)
        return generate_latest(self.registry)
