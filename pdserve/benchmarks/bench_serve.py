"""`pdserve bench`: goodput benchmark of any OpenAI-compatible server (pdserve, vLLM, SGLang).

Flags that mean the same as `vllm bench serve`'s carry the same names, and the JSON result
uses vLLM's field names, so a vLLM user needs nothing new. For `--dataset-name random` and
`prefix_repetition` with Poisson / gamma arrivals it sends the very prompts at the very times
`vllm bench serve` 0.32 sends for the same flags and seed (vllm_datasets.py, arrivals.py), so
the two clients can be checked against each other request by request. On top of vLLM it adds
shared-prefix and Mooncake-trace workloads, SLO attainment, failures counted by cause, a rate
sweep and a goodput search (DistServe: the highest rate with >= 90% of requests meeting every
SLO, goodput_search.py), a compare mode against a second server, and PNG plots.

    pdserve bench --base-url http://127.0.0.1:8000 --model tiny --tokenizer DIR \\
        --dataset-name random --random-input-len 128 --random-output-len 32 --ignore-eos \\
        --num-prompts 64 --goodput ttft:500 tpot:50 --sweep-rates 1 2 4 8 --save-result

It measures over HTTP only: no torch, no other pdserve part is imported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from pdserve.benchmarks.arrivals import ArrivalConfig, arrival_offsets_s
from pdserve.benchmarks.client import (
    EndpointConfig,
    RequestOutcome,
    ServerUnreachableError,
    list_models,
    send_request,
)
from pdserve.benchmarks.datasets import (
    BenchRequest,
    DatasetError,
    TokenCodec,
    TraceScaling,
    load_mooncake_trace,
    mooncake_requests,
    shared_prefix_requests,
)
from pdserve.benchmarks.goodput_search import RateSearch, SearchConfig, summarize_searches
from pdserve.benchmarks.metrics import (
    DEFAULT_TARGET_ATTAINMENT,
    SLOConfig,
    goodput_rate,
    next_sweep_rate,
    output_token_counts,
    parse_goodput,
    summarize,
)
from pdserve.benchmarks.report import (
    RunResult,
    ServerResult,
    compare_ratios,
    print_run,
    print_sweep,
    save_results,
)
from pdserve.benchmarks.vllm_datasets import prefix_repetition_requests, random_requests

DATASETS = ("random", "prefix_repetition", "shared-prefix", "mooncake")
# vLLM turns --ignore-eos on for these (its random prompts would otherwise end at random).
IGNORE_EOS_DATASETS = ("random",)


class BenchError(RuntimeError):
    """The benchmark cannot proceed (server refused the test request, ...)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default=None,
                        help="/v1/completions (default) or /v1/chat/completions")
    server.add_argument("--backend", choices=("openai", "openai-chat", "vllm"), default=None,
                        help="vLLM-style API choice; openai-chat implies the chat endpoint")
    server.add_argument("--model", default=None,
                        help="model name to request (default: the server's first model)")
    server.add_argument("--tokenizer", default=None,
                        help="tokenizer name or dir for prompt lengths and token counting "
                             "(default: --model when it is a local dir, else synthetic words)")
    server.add_argument("--trust-remote-code", action="store_true")
    server.add_argument("--request-timeout", type=float,
                        default=EndpointConfig.request_timeout_s,
                        help="seconds a request may wait for its next bytes before it fails")

    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="Mooncake JSONL trace (mooncake)")
    data.add_argument("--num-prompts", type=int, default=None,
                      help="requests to send (random: default 1000; mooncake: the first N "
                           "lines, default all; shared-prefix: prefixes x suffixes)")
    data.add_argument("--seed", type=int, default=ArrivalConfig.seed)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", default="0.0",
                      help='a float, or JSON {"input": a, "output": b}; lengths are uniform '
                           "in [len * (1 - r), len * (1 + r)]")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one random prefix every random prompt starts with")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--disable-shuffle", action="store_true",
                      help="prefix_repetition: keep prompts grouped by prefix")
    data.add_argument("--shared-prefix-num-prefixes", type=int, default=8)
    data.add_argument("--shared-prefix-num-suffixes", type=int, default=8)
    data.add_argument("--shared-prefix-len", type=int, default=256)
    data.add_argument("--shared-suffix-len", type=int, default=64)
    data.add_argument("--shared-prefix-output-len", type=int, default=64)
    data.add_argument("--time-scale", type=float, default=TraceScaling.time_scale,
                      help="multiplies trace timestamps (0.1 = replay 10x faster)")
    data.add_argument("--length-scale", type=float, default=None,
                      help="multiplies trace input/output lengths and the block size")
    data.add_argument("--block-size", type=int, default=None,
                      help="tokens per trace block after scaling (sets --length-scale to "
                           "block-size / trace-block-size)")
    data.add_argument("--trace-block-size", type=int, default=TraceScaling.trace_block_size)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=ArrivalConfig.request_rate,
                      help="mean requests/s (inf = all at once)")
    load.add_argument("--burstiness", type=float, default=ArrivalConfig.burstiness,
                      help="gamma shape of arrivals: 1 = Poisson, <1 burstier, inf even")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=0,
                      help="unmeasured copies of the first prompt sent before measuring")
    load.add_argument("--ready-check-timeout-sec", type=float, default=0,
                      help="send the first prompt, unmeasured, until it succeeds or this "
                           "many seconds pass (0: no test request, as in vLLM)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="always on for --dataset-name random, as in vLLM")
    load.add_argument("--temperature", type=float, default=None)
    load.add_argument("--extra-body", default=None, help="JSON merged into every request")

    slo = parser.add_argument_group("SLOs and goodput")
    slo.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    slo.add_argument("--sweep-rates", nargs="+", type=float, default=None, metavar="RATE",
                     help="run each request rate; report the highest with enough attainment")
    slo.add_argument("--sweep-refine-steps", type=int, default=0,
                     help="bisection steps between the last passing and first failing rate")
    slo.add_argument("--sweep-fresh-prompts", action="store_true",
                     help="new prompts at each sweep rate (seed + rate index), so a prefix "
                          "cache does not serve later rates from the earlier ones")
    slo.add_argument("--target-attainment", type=float, default=DEFAULT_TARGET_ATTAINMENT)
    slo.add_argument("--goodput-search", action="store_true",
                     help="find the highest rate meeting --target-attainment: double from "
                          "--search-min-rate, then bisect; repeated --search-repeats times "
                          "with fresh seeds (median and spread reported)")
    slo.add_argument("--search-min-rate", type=float, default=SearchConfig.min_rate)
    slo.add_argument("--search-max-rate", type=float, default=SearchConfig.max_rate)
    slo.add_argument("--search-tolerance", type=float, default=SearchConfig.rel_tolerance,
                     help="stop when the bracket is narrower than this fraction of its rate")
    slo.add_argument("--search-max-runs", type=int, default=SearchConfig.max_runs,
                     help="load runs per repeat")
    slo.add_argument("--search-repeats", type=int, default=SearchConfig.num_repeats)
    slo.add_argument("--search-max-time", type=float, default=SearchConfig.max_time_s,
                     help="seconds for all repeats on one server; no run starts after it")
    slo.add_argument("--num-workers", type=int, default=1,
                     help="serving workers behind the URL, for goodput per worker")

    cmp = parser.add_argument_group("compare")
    cmp.add_argument("--compare-base-url", default=None, help="second server, same workload")
    cmp.add_argument("--compare-model", default=None)
    cmp.add_argument("--label", default=None)
    cmp.add_argument("--compare-label", default=None)

    out = parser.add_argument_group("output")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true",
                     help="also save per-request ttfts, itls, lengths, errors")
    out.add_argument("--result-dir", "--output-dir", dest="result_dir", default=None,
                     help="folder for --save-result's JSON and plots (default: "
                          "$PDSERVE_RESULTS_DIR/bench, else ~/.cache/pdserve/results/bench)")
    out.add_argument("--result-filename", default=None)
    out.add_argument("--no-plots", action="store_true", help="skip PNG plots on --save-result")
    out.add_argument("--metric-percentiles", default="99")
    out.add_argument("--percentile-metrics", default=None,
                     help="accepted for vLLM's command lines; ttft, tpot, itl and e2el are "
                          "always reported")
    out.add_argument("--disable-tqdm", action="store_true")


# -- setting up ------------------------------------------------------------------------------


def _endpoint_path(args: argparse.Namespace) -> str:
    if args.endpoint is not None:
        return args.endpoint
    return "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from e
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    return extra


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_warmups < 0 or args.ready_check_timeout_sec < 0:
        raise ValueError("--num-warmups and --ready-check-timeout-sec must be >= 0")
    if args.num_workers < 1:
        raise ValueError("--num-workers must be >= 1")
    if args.sweep_refine_steps < 0:
        raise ValueError("--sweep-refine-steps must be >= 0")
    if args.sweep_fresh_prompts and args.sweep_rates is None:
        raise ValueError("--sweep-fresh-prompts needs --sweep-rates")
    if args.goodput_search:
        _search_config(args)  # validates the bounds
        if args.sweep_rates is not None:
            raise ValueError("--goodput-search and --sweep-rates exclude each other")
        if not args.goodput:
            raise ValueError("--goodput-search needs SLOs: add --goodput ttft:MS tpot:MS")
        if args.dataset_name == "mooncake":
            raise ValueError("--goodput-search varies the rate: a trace has its own times")
    if args.sweep_rates is not None:
        if any(not r > 0 for r in args.sweep_rates):
            raise ValueError("--sweep-rates must all be > 0 (inf allowed)")
        if not args.goodput:
            raise ValueError("--sweep-rates needs SLOs: add --goodput ttft:MS tpot:MS")
    if args.dataset_name == "mooncake":
        if not args.dataset_path:
            raise ValueError("--dataset-name mooncake needs --dataset-path TRACE.jsonl")
        if args.sweep_rates is not None or not math.isinf(args.request_rate):
            raise ValueError("a trace replays its own timestamps: use --time-scale, not "
                             "--request-rate / --sweep-rates")


def _trace_scaling(args: argparse.Namespace) -> TraceScaling:
    length_scale = args.length_scale
    if args.block_size is not None:
        if args.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        from_block = args.block_size / args.trace_block_size
        if length_scale is not None and not math.isclose(length_scale, from_block):
            raise ValueError(f"--block-size {args.block_size} implies --length-scale "
                             f"{from_block:g}, but --length-scale {length_scale:g} was given")
        length_scale = from_block
    return TraceScaling(time_scale=args.time_scale, length_scale=length_scale or 1.0,
                        trace_block_size=args.trace_block_size)


def _search_config(args: argparse.Namespace) -> SearchConfig:
    return SearchConfig(args.target_attainment, args.search_min_rate, args.search_max_rate,
                        args.search_tolerance, args.search_max_runs, args.search_repeats,
                        args.search_max_time)


@dataclass(frozen=True)
class Workload:
    """The prompts of one run and where its arrival gaps are drawn from."""

    requests: list[BenchRequest]
    # State of the legacy numpy RNG the gaps come from: vLLM seeds its global one with --seed
    # and a dataset may draw from it first (prefix_repetition), so gaps continue from there.
    arrival_rng_state: tuple[Any, ...]

    def arrival_rng(self) -> np.random.RandomState:
        rng = np.random.RandomState()
        rng.set_state(self.arrival_rng_state)
        return rng


def build_workload(args: argparse.Namespace, codec: TokenCodec) -> Workload:
    """The workload the flags describe (same seed -> same prompts and arrival gaps)."""
    legacy_rng = np.random.RandomState(args.seed)
    num_prompts = args.num_prompts or 1000
    if args.dataset_name == "random":
        requests = random_requests(codec, num_prompts, args.random_input_len,
                                   args.random_output_len, args.random_range_ratio, args.seed,
                                   args.random_prefix_len)
    elif args.dataset_name == "prefix_repetition":
        requests = prefix_repetition_requests(
            codec, num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, legacy_rng,
            None if args.disable_shuffle else args.seed)
    elif args.dataset_name == "shared-prefix":
        requests = shared_prefix_requests(
            codec, args.shared_prefix_num_prefixes, args.shared_prefix_num_suffixes,
            args.shared_prefix_len, args.shared_suffix_len, args.shared_prefix_output_len,
            args.seed)
        requests = requests[: args.num_prompts] if args.num_prompts else requests
    else:
        entries = load_mooncake_trace(args.dataset_path, args.num_prompts)
        requests = mooncake_requests(codec, entries, _trace_scaling(args), args.seed)
    return Workload(requests, legacy_rng.get_state())


def build_requests(args: argparse.Namespace, codec: TokenCodec) -> list[BenchRequest]:
    """The prompts the flags describe (same seed -> same prompts)."""
    return build_workload(args, codec).requests


def _with_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "seed": seed})


def _tokenizer_name(args: argparse.Namespace) -> str | None:
    if args.tokenizer is not None:
        return args.tokenizer
    if args.model is not None and Path(args.model).is_dir():
        return args.model
    return None


# -- running load ----------------------------------------------------------------------------


async def run_load(http: httpx.AsyncClient, endpoint: EndpointConfig,
                   requests: Sequence[BenchRequest], offsets_s: Sequence[float],
                   max_concurrency: int | None = None, disable_tqdm: bool = True,
                   desc: str = "") -> tuple[list[RequestOutcome], float]:
    """Send request i at offsets_s[i] after the start (open loop); returns outcomes, seconds.

    With max_concurrency, a request whose time has come waits for a free slot (as vLLM does),
    so the offered rate is capped by the server's speed.
    """
    from tqdm.asyncio import tqdm

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(requests), disable=disable_tqdm, desc=desc, file=sys.stderr)
    start_s = time.perf_counter()

    async def one(request: BenchRequest, offset_s: float) -> RequestOutcome:
        delay_s = start_s + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if semaphore is None:
            outcome = await send_request(http, endpoint, request)
        else:
            async with semaphore:
                outcome = await send_request(http, endpoint, request)
        progress.update(1)
        return outcome

    try:
        outcomes = await asyncio.gather(*(one(r, float(o)) for r, o in
                                          zip(requests, offsets_s, strict=True)))
    finally:
        progress.close()
    return list(outcomes), time.perf_counter() - start_s


def _offsets(workload: Workload, rate: float, args: argparse.Namespace) -> np.ndarray:
    requests = workload.requests
    if requests and requests[0].arrival_offset_s is not None:
        return np.array([r.arrival_offset_s for r in requests])
    return arrival_offsets_s(len(requests), ArrivalConfig(rate, args.burstiness, args.seed),
                             workload.arrival_rng())


async def _run_level(http: httpx.AsyncClient, server: ServerResult, workload: Workload,
                     rate: float, slo: SLOConfig, codec: TokenCodec, args: argparse.Namespace,
                     percentiles: Sequence[float]) -> RunResult:
    requests = workload.requests
    outcomes, duration_s = await run_load(
        http, server.endpoint, requests, _offsets(workload, rate, args), args.max_concurrency,
        args.disable_tqdm, desc=f"{server.label} @ {rate:g} req/s")
    output_tokens = output_token_counts(outcomes, codec.count)
    summary = summarize(outcomes, output_tokens, duration_s, slo, percentiles)
    is_trace = bool(requests) and requests[0].arrival_offset_s is not None
    run = RunResult(server.label, rate, summary, outcomes, output_tokens, is_trace, args.seed)
    server.runs.append(run)
    return run


async def _check_reachable(http: httpx.AsyncClient, base_url: str) -> None:
    """Fails fast when nothing answers at `base_url` (any HTTP answer will do)."""
    try:
        await http.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ServerUnreachableError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from e


async def _ready_check(http: httpx.AsyncClient, endpoint: EndpointConfig,
                       request: BenchRequest, timeout_s: float) -> None:
    """vLLM's --ready-check-timeout-sec: the first prompt, unmeasured, until it succeeds."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        outcome = await send_request(http, endpoint, request)
        if outcome.success:
            return
        if time.monotonic() >= deadline_s:
            raise BenchError(f"test request to {endpoint.url} failed: {outcome.error}")
        await asyncio.sleep(1.0)


async def _warm_up(http: httpx.AsyncClient, endpoint: EndpointConfig, request: BenchRequest,
                   num_warmups: int, max_concurrency: int | None) -> None:
    """vLLM's --num-warmups: the first prompt, unmeasured, num_warmups times at once."""
    semaphore = asyncio.Semaphore(max_concurrency or num_warmups or 1)

    async def one() -> None:
        async with semaphore:
            await send_request(http, endpoint, request)

    await asyncio.gather(*(one() for _ in range(num_warmups)))


async def _search_server(http: httpx.AsyncClient, server: ServerResult, slo: SLOConfig,
                         codec: TokenCodec, args: argparse.Namespace,
                         percentiles: Sequence[float], deadline_s: float) -> None:
    """Repeated bracketing searches; every run gets fresh prompts and arrivals (its own seed),
    so a prefix cache never serves a run from an earlier one."""
    config = _search_config(args)
    searches = []
    for repeat in range(config.num_repeats):
        search = RateSearch(config)
        searches.append(search)
        while (rate := search.next_rate()) is not None and time.monotonic() < deadline_s:
            run_args = _with_seed(args, args.seed + 1000 * repeat + len(search.points))
            run = await _run_level(http, server, build_workload(run_args, codec), rate, slo,
                                   codec, run_args, percentiles)
            run.repeat = repeat
            search.record(rate, run.summary["slo_attainment"])
            print(f"{server.label}: search {repeat + 1}/{config.num_repeats}: {rate:g} req/s "
                  f"-> attainment {100 * run.summary['slo_attainment']:.1f}%", file=sys.stderr)
    server.search = summarize_searches(searches)
    server.goodput_rate = server.search.median_rate


async def _bench_server(http: httpx.AsyncClient, server: ServerResult, workload: Workload,
                        slo: SLOConfig, codec: TokenCodec, args: argparse.Namespace,
                        percentiles: Sequence[float], deadline_s: float) -> None:
    if args.goodput_search:
        await _search_server(http, server, slo, codec, args, percentiles, deadline_s)
        return

    def level_workload() -> tuple[Workload, argparse.Namespace]:
        if not args.sweep_fresh_prompts or not server.runs:
            return workload, args
        level_args = _with_seed(args, args.seed + len(server.runs))
        return build_workload(level_args, codec), level_args

    rates = sorted(args.sweep_rates) if args.sweep_rates else [args.request_rate]
    for rate in rates:
        level, level_args = level_workload()
        await _run_level(http, server, level, rate, slo, codec, level_args, percentiles)
    if not args.sweep_rates:
        return
    points = [(r.request_rate, r.summary["slo_attainment"]) for r in server.runs]
    best = goodput_rate(points, args.target_attainment)
    for _ in range(args.sweep_refine_steps):
        mid = next_sweep_rate(points, args.target_attainment)
        if mid is None:
            break
        level, level_args = level_workload()
        run = await _run_level(http, server, level, mid, slo, codec, level_args, percentiles)
        points.append((mid, run.summary["slo_attainment"]))
        best = goodput_rate(points, args.target_attainment)
    server.runs.sort(key=lambda r: r.request_rate)
    server.goodput_rate = best


async def _resolve_model(http: httpx.AsyncClient, base_url: str, model: str | None) -> str:
    if model is not None:
        return model
    models = await list_models(http, base_url)
    if not models:
        raise BenchError(f"{base_url} serves no model; pass --model")
    return models[0]


# -- entry point -----------------------------------------------------------------------------


async def _main(args: argparse.Namespace) -> int:
    slo = parse_goodput(args.goodput) if args.goodput else SLOConfig()
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be in (0, 100]")
    tokenizer_id = _tokenizer_name(args)
    codec = TokenCodec.load(tokenizer_id, args.trust_remote_code)
    if tokenizer_id is None:
        print("pdserve bench: no --tokenizer: prompts use synthetic words, input lengths are "
              "nominal; output tokens come from the server's usage", file=sys.stderr)
    workload = build_workload(args, codec)
    requests = workload.requests
    base_urls = [args.base_url or f"http://{args.host}:{args.port}"]
    models, labels = [args.model], [args.label]
    if args.compare_base_url:
        base_urls.append(args.compare_base_url)
        models.append(args.compare_model or args.model)
        labels.append(args.compare_label)
    limits = httpx.Limits(max_connections=args.max_concurrency,
                          max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=args.request_timeout) as http:
        servers = []
        for base_url, model, label in zip(base_urls, models, labels, strict=True):
            EndpointConfig(base_url, model or "-")  # validates the URL before any network
            model = await _resolve_model(http, base_url, model)
            ignore_eos = args.ignore_eos or args.dataset_name in IGNORE_EOS_DATASETS
            endpoint = EndpointConfig(base_url, model, _endpoint_path(args), ignore_eos,
                                      args.request_timeout, _extra_body(args))
            servers.append(ServerResult(label or urlsplit(base_url).netloc, endpoint))
        # Every server must answer before any is measured, so a wrong second URL fails in
        # seconds, not after the first server's whole sweep. Like `vllm bench serve` (0.32),
        # no completion is sent before the measured ones unless asked for: the server sees
        # exactly the requests vLLM's client would send.
        for server in servers:
            await _check_reachable(http, server.endpoint.base_url)
            if args.ready_check_timeout_sec > 0:
                await _ready_check(http, server.endpoint, requests[0],
                                   args.ready_check_timeout_sec)
        for server in servers:
            await _warm_up(http, server.endpoint, requests[0], args.num_warmups,
                           args.max_concurrency)
            # Each server of a compare gets the whole --search-max-time.
            deadline_s = time.monotonic() + args.search_max_time
            await _bench_server(http, server, workload, slo, codec, args, percentiles,
                                deadline_s)
    for server in servers:
        if not args.goodput_search:
            for run in server.runs:
                print_run(run, percentiles)
        if args.sweep_rates or args.goodput_search:
            print_sweep(server, args)
    ratios = compare_ratios(servers[0], servers[1]) if len(servers) == 2 else None
    if ratios is not None:
        print(f"\n{servers[0].label} / {servers[1].label}:")
        for key, value in ratios.items():
            print(f"  {key:<20} {'n/a' if value is None else f'{value:.3f}'}")
    if args.save_result:
        for path in save_results(servers, args, slo, tokenizer_id, ratios):
            print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """`pdserve bench`: 0 on success, 2 on bad flags or workload, 1 when the server fails."""
    # httpx logs every request at INFO: thousands of lines that would bury the summary.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        _validate(args)
        return asyncio.run(_main(args))
    except (ValueError, DatasetError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    except (ServerUnreachableError, BenchError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 1
