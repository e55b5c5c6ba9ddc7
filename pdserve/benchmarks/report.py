"""`pdserve bench` results: what one load level and one server produced, the terminal
summary (vLLM's table layout), the JSON document (vLLM's field names) and the plots."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.benchmarks.client import EndpointConfig, RequestOutcome
from pdserve.benchmarks.goodput_search import SearchSummary
from pdserve.benchmarks.metrics import SLOConfig, request_tpot_s
from pdserve.benchmarks.output import default_dir


@dataclass
class RunResult:
    """One load level against one server."""

    label: str
    request_rate: float
    summary: dict[str, Any]
    outcomes: list[RequestOutcome]
    output_tokens: list[int]
    # Sent at a trace's timestamps (request_rate is then meaningless).
    is_trace: bool = False
    # Seed of this run's prompts and arrivals.
    seed: int | None = None
    # Which repeat of a goodput search made this run (None outside a search).
    repeat: int | None = None

    @property
    def rate_text(self) -> str:
        return "trace" if self.is_trace else f"{self.request_rate:g}"

    def ttfts_ms(self) -> list[float]:
        return [o.ttft_s * 1000.0 for o in self.outcomes if o.success]

    def tpots_ms(self) -> list[float]:
        tpots = (request_tpot_s(o, n) for o, n in zip(self.outcomes, self.output_tokens,
                                                      strict=True))
        return [t * 1000.0 for t in tpots if t is not None]


@dataclass
class ServerResult:
    label: str
    endpoint: EndpointConfig
    runs: list[RunResult] = field(default_factory=list)
    goodput_rate: float | None = None
    # Set by --goodput-search: every repeat's rate and bracket.
    search: SearchSummary | None = None

    @property
    def goodput_is_lower_bound(self) -> bool:
        """Even the highest rate tried met the target: the true goodput rate may be higher."""
        if self.search is not None:
            return any(failing is None and passing is not None
                       for passing, failing in self.search.brackets)
        return self.goodput_rate is not None and \
            self.goodput_rate >= max(r.request_rate for r in self.runs)

    def attainment_points(self) -> list[tuple[float, float]]:
        """(rate, attainment) of every run at a finite rate (traces have none)."""
        return [(r.request_rate, r.summary["slo_attainment"]) for r in self.runs
                if not r.is_trace and math.isfinite(r.request_rate)]


def _rate_json(rate: float) -> float | str:
    return rate if math.isfinite(rate) else "inf"


def run_json(run: RunResult, server: ServerResult, args: argparse.Namespace,
             slo: SLOConfig, tokenizer_id: str | None) -> dict[str, Any]:
    """One run in vLLM's result layout (plus slo, slo_attainment, dataset fields)."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if server.endpoint.is_chat else "openai",
        "backend": "openai-chat" if server.endpoint.is_chat else "openai",
        "label": server.label,
        "base_url": server.endpoint.base_url,
        "endpoint": server.endpoint.endpoint,
        "model_id": server.endpoint.model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(run.outcomes),
        "dataset_name": args.dataset_name,
        "seed": run.seed if run.seed is not None else args.seed,
        "search_repeat": run.repeat,
        "request_rate": "trace" if run.is_trace else _rate_json(run.request_rate),
        "time_scale": args.time_scale if run.is_trace else None,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput_slo_ms": slo.as_dict() or None,
    }
    result.update(run.summary)
    # Aligned with the requests ("" = success), as vLLM's --save-detailed saves it; kept even
    # without --save-detailed, so a failed run always says why.
    result["errors"] = [o.error for o in run.outcomes]
    if args.save_detailed:
        result.update({
            "input_lens": [o.prompt_len for o in run.outcomes],
            "cached_lens": [o.cached_tokens for o in run.outcomes],
            "output_lens": run.output_tokens,
            "ttfts": [o.ttft_s for o in run.outcomes],
            "itls": [o.itl_s for o in run.outcomes],
            "latencies": [o.latency_s for o in run.outcomes],
            "start_times": [o.start_time_s for o in run.outcomes],
        })
    return result


def print_run(run: RunResult, percentiles: Sequence[float]) -> None:
    s = run.summary
    rows: list[tuple[str, str]] = [
        ("Server", run.label),
        ("Request rate (req/s)", run.rate_text),
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        *((f"  {cause}", str(count)) for cause, count in s.get("error_counts", {}).items()),
        ("Benchmark duration (s)", f"{s['duration']:.2f}"),
        ("Total input tokens", str(s["total_input_tokens"])),
        ("Total generated tokens", str(s["total_output_tokens"])),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
    ]
    if s["request_goodput"] is not None:
        rows += [("Request goodput (req/s)", f"{s['request_goodput']:.2f}"),
                 ("SLO attainment (%)", f"{100 * s['slo_attainment']:.1f}")]
    rows += [("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows += [(f"Mean {title} (ms)", f"{s[f'mean_{key}_ms']:.2f}"),
                 (f"Median {title} (ms)", f"{s[f'median_{key}_ms']:.2f}")]
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            rows.append((f"P{word} {title} (ms)", f"{s[f'p{word}_{key}_ms']:.2f}"))
    print("{:=^54}".format(" Serving Benchmark Result "))
    for name, value in rows:
        print(f"{name + ':':<40} {value:>13}")
    print("=" * 54)
    print_first_errors(run.outcomes)


def print_first_errors(outcomes: Sequence[RequestOutcome], max_messages: int = 3) -> None:
    """The first message of each of the first `max_messages` causes, request index included."""
    shown: set[str] = set()
    for index, outcome in enumerate(outcomes):
        if outcome.success or outcome.error_cause in shown:
            continue
        if len(shown) == max_messages:
            break
        shown.add(outcome.error_cause)
        message = " ".join(outcome.error.split())[:200]
        print(f"request {index} failed ({outcome.error_cause}): {message}")


def print_sweep(server: ServerResult, args: argparse.Namespace) -> None:
    header = (f"{'rate':>8} {'done':>5} {'req/s':>7} {'goodput':>8} {'attain%':>8} "
              f"{'TTFT mean':>10} {'TTFT p99':>9} {'TPOT mean':>10} {'TPOT p99':>9}")
    print(f"\n{server.label}: {server.endpoint.url}  (times in ms)")
    print(("rep " if server.search else "") + header)
    for run in server.runs:
        s = run.summary
        if server.search:
            print(f"{(run.repeat or 0) + 1:>3} ", end="")
        print(f"{run.request_rate:>8g} {s['completed']:>5} {s['request_throughput']:>7.2f} "
              f"{s['request_goodput'] or 0.0:>8.2f} {100 * s['slo_attainment']:>8.1f} "
              f"{s['mean_ttft_ms']:>10.1f} {s['p99_ttft_ms']:>9.1f} "
              f"{s['mean_tpot_ms']:>10.1f} {s['p99_tpot_ms']:>9.1f}")
    rate = server.goodput_rate
    per_worker = "" if rate is None else f" ({rate / args.num_workers:g} per worker, " \
        f"{args.num_workers} workers)"
    flag = "--search-max-rate" if server.search else "--sweep-rates"
    ceiling = f" - the highest rate tried: raise {flag} to find the limit" \
        if server.goodput_is_lower_bound else ""
    spread = ""
    if server.search is not None and server.search.spread is not None:
        low, high = server.search.spread
        spread = (f" (median of {len(server.search.rates)} searches; spread {low:.3g}-"
                  f"{high:.3g} req/s)")
    print(f"goodput rate (>= {100 * args.target_attainment:.0f}% attainment): "
          f"{'none (the lowest rate misses)' if rate is None else f'{rate:.3g} req/s'}"
          f"{spread}{per_worker}{ceiling}")
    for run in server.runs:
        print_first_errors(run.outcomes, max_messages=1)


def compare_ratios(first: ServerResult, second: ServerResult) -> dict[str, float | None]:
    """first / second for goodput rate and, at the lowest common rate, latency means."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b not in (None, 0) else None

    ratios: dict[str, float | None] = {"goodput_rate": ratio(first.goodput_rate,
                                                             second.goodput_rate)}
    a, b = first.runs[0].summary, second.runs[0].summary
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                "p99_ttft_ms", "p99_tpot_ms"):
        ratios[key] = ratio(a[key], b[key])
    return ratios


def save_results(servers: list[ServerResult], args: argparse.Namespace, slo: SLOConfig,
          tokenizer_id: str | None, ratios: dict[str, float | None] | None) -> list[Path]:
    from pdserve.benchmarks import plots

    result_dir = Path(args.result_dir) if args.result_dir else default_dir("bench")
    result_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    filename = args.result_filename or \
        f"pdserve-bench-{servers[0].label}-{args.dataset_name}-{stamp}.json"
    json_path = result_dir / filename
    is_single = len(servers) == 1 and len(servers[0].runs) == 1 and not args.sweep_rates \
        and not args.goodput_search
    if is_single:
        document: dict[str, Any] = run_json(servers[0].runs[0], servers[0], args, slo,
                                            tokenizer_id)
    else:
        document = {
            "date": stamp,
            "target_attainment": args.target_attainment,
            "num_workers": args.num_workers,
            "goodput_slo_ms": slo.as_dict() or None,
            "servers": [{
                "label": s.label,
                "base_url": s.endpoint.base_url,
                "goodput_rate": s.goodput_rate,
                "goodput_rate_per_worker": None if s.goodput_rate is None
                else s.goodput_rate / args.num_workers,
                "goodput_rate_is_lower_bound": s.goodput_is_lower_bound,
                "goodput_search": None if s.search is None else s.search.as_dict(),
                "runs": [run_json(r, s, args, slo, tokenizer_id) for r in s.runs],
            } for s in servers],
        }
        if ratios is not None:
            document["ratio"] = ratios
    with open(json_path, "w") as f:
        json.dump(document, f, indent=2)
    written = [json_path]
    if args.no_plots:
        return written
    stem = json_path.with_suffix("")
    # Attainment vs rate needs rates on an axis: trace replays and "inf" have none.
    attainment = {s.label: s.attainment_points() for s in servers}
    if not slo.is_empty and any(attainment.values()):
        spreads = {s.label: s.search.spread for s in servers
                   if s.search is not None and s.search.spread is not None}
        written.append(plots.plot_attainment(
            attainment, f"{stem}-attainment.png", args.target_attainment,
            {s.label: s.goodput_rate for s in servers}, spreads))
    for metric, values, slo_ms in (("TTFT", RunResult.ttfts_ms, slo.ttft_ms),
                                   ("TPOT", RunResult.tpots_ms, slo.tpot_ms)):
        series = {f"{r.label} @ {r.rate_text} req/s": values(r)
                  for s in servers for r in s.runs}
        written.append(plots.plot_cdf(series, f"{stem}-{metric.lower()}-cdf.png", metric,
                                      slo_ms))
    return written
