"""Where a request's time to first token goes, colocated beside disaggregated (issue #14).

    python -m benchmarks.ttft_breakdown [--model DIR] [--prompt-len 256]
        [--sequential 20] [--rate 2] [--num-requests 40]

It starts a colocated system and then a disaggregated one (1 prefill + 1 decode over the KV
store) with `pdserve up`'s launcher, each on its own ports, and sends each fresh random prompts
(never repeated, so no prefix cache serves them) of --prompt-len tokens asking for
--max-tokens: first --sequential requests one at a time, then --num-requests Poisson arrivals
at --rate. For each, it reads the router's `pdserve:request_phase_seconds` histogram before
and after (pdserve/router/phases.py: the phases add up to the router's TTFT), and the client's own
TTFT, whose excess over the router's is HTTP, parsing and tokenizing (`http`). For reference it
also times the offline prefill of a fresh prompt of the same length (LLM.generate,
max_tokens=1) in this process, at each worker's thread count.

Prints a table (mean ms per phase), writes JSON and a stacked-bar plot to --out-dir.

Every worker gets --cpu-threads threads (default: the CPUs this process may run on, split
over the workers' ranks; `pdserve up` splits os.cpu_count(), which under `taskset` would put
several threads on one core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.benchmarks.arrivals import ArrivalConfig, arrival_offsets_s
from pdserve.benchmarks.bench_serve import run_load
from pdserve.benchmarks.client import EndpointConfig, RequestOutcome, list_models
from pdserve.benchmarks.datasets import BenchRequest, TokenCodec
from pdserve.benchmarks.output import default_dir
from pdserve.benchmarks.plots import pyplot, save_figure
from pdserve.benchmarks.vllm_datasets import random_requests

PHASE_METRIC = "pdserve:request_phase_seconds"
HANDOVER_METRIC = "pdserve:request_handover_phase_seconds"
TTFT_METRIC = "pdserve:time_to_first_token_seconds"
# pdserve/router/phases.py's names (not imported: a benchmark reads the server over HTTP only)
TTFT_PHASES = ("router", "queue", "prefill", "layer_save", "kv_save", "transport",
               "first_token_out")
HANDOVER_PHASES = ("second_dispatch", "kv_load", "first_decode", "decode_transport")
HTTP_PHASE = "http"
"""Client TTFT less the router's: HTTP both ways, body parsing, tokenizing, SSE delivery."""
SETUPS = ("colocated", "disagg", "disagg-no-store", "disagg-no-lending")
"""What `--setups` may name: `pdserve up --mode colocated`, `--mode disagg` (1 prefill + 1
decode with the KV store), `--mode disagg --no-store` (the same without the fleet store) and
`--mode disagg --no-core-lending` (prefill never runs on an idle decode worker's cores)."""
NUM_WARMUP_REQUESTS = 2
NUM_OFFLINE_PROMPTS = 5


@dataclass(frozen=True)
class BreakdownConfig:
    """One run of the benchmark."""

    model: str | None = None
    """Checkpoint directory; None: the embedded default model."""
    prompt_len: int = 256
    """Tokens per prompt."""
    max_tokens: int = 4
    """Tokens generated per request (ignore_eos, so a disaggregated request always reaches
    its decode worker)."""
    num_sequential: int = 20
    """Requests sent one at a time."""
    request_rate: float = 2.0
    """Poisson arrival rate of the loaded run (req/s)."""
    num_requests: int = 40
    """Requests in the loaded run."""
    setups: tuple[str, ...] = ("colocated", "disagg")
    """Systems to measure, in order (names from SETUPS)."""
    seed: int = 0
    base_port: int = 18700
    """The i-th setup's router listens at base + 20 i, its workers from base + 20 i + 10, its
    store at base + 20 i + 15 and + 16."""
    cpu_threads: int | None = None
    """Threads per worker rank on CPU; None: this process's CPUs split over the ranks."""
    device: str | None = None
    """cuda | cpu; None: as `pdserve up` decides."""
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 120.0
    """Longest wait for a request's next bytes."""
    out_dir: str | None = None
    """Where ttft_breakdown.json and .png go; None: the default results folder, outside the
    checkout (pdserve/benchmarks/output.py)."""

    def __post_init__(self) -> None:
        if min(self.prompt_len, self.max_tokens, self.num_sequential, self.num_requests) < 1:
            raise ValueError("prompt length, max tokens and request counts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("--rate must be > 0")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("--cpu-threads must be >= 1")
        if not self.setups or any(s not in SETUPS for s in self.setups):
            raise ValueError(f"--setups must name some of {SETUPS}")
        if not 0 < self.base_port < 65536 - 20 * len(SETUPS):
            raise ValueError("--base-port must leave room for the setups' ports after it")


# ---- metrics: histogram deltas -> mean ms per phase ------------------------------------------
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+"
                     r"(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Histograms = dict[tuple[str, str], tuple[float, float]]
"""(metric, phase) -> (sum of seconds, count); the TTFT histogram under phase ''."""


def parse_histograms(metrics_text: str) -> Histograms:
    """The phase and TTFT histograms' sums and counts from a Prometheus text exposition,
    added over any other labels (model name)."""
    found: dict[tuple[str, str], list[float]] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match["name"]
        for metric in (PHASE_METRIC, HANDOVER_METRIC, TTFT_METRIC):
            for index, suffix in enumerate(("_sum", "_count")):
                if name == metric + suffix:
                    labels = dict(_LABEL.findall(match["labels"] or ""))
                    entry = found.setdefault((metric, labels.get("phase", "")), [0.0, 0.0])
                    entry[index] += float(match["value"])
    return {key: (total, count) for key, (total, count) in found.items()}


def _mean_ms(before: Histograms, after: Histograms, key: tuple[str, str]
             ) -> tuple[float, int] | None:
    total_after, count_after = after.get(key, (0.0, 0.0))
    total_before, count_before = before.get(key, (0.0, 0.0))
    count = count_after - count_before
    if count <= 0:
        return None
    return 1000.0 * (total_after - total_before) / count, int(round(count))


def analyze(before_text: str, after_text: str, client_ttfts_s: Sequence[float]
            ) -> dict[str, Any]:
    """One measured run from the /metrics texts before and after it and the client's TTFTs:
    mean ms per TTFT phase (the phases that occurred; their sum, `sum_of_phases_ms`, is the
    router's TTFT), `http` (the client's TTFT less the router's), the hand-over phases, and
    the counts."""
    before, after = parse_histograms(before_text), parse_histograms(after_text)
    phases_ms, handover_ms, counts = {}, {}, {}
    for metric, names, into in ((PHASE_METRIC, TTFT_PHASES, phases_ms),
                                (HANDOVER_METRIC, HANDOVER_PHASES, handover_ms)):
        for name in names:
            mean = _mean_ms(before, after, (metric, name))
            if mean is not None:
                into[name], counts[name] = mean
    router_ttft = _mean_ms(before, after, (TTFT_METRIC, ""))
    client = np.asarray(client_ttfts_s, dtype=np.float64) * 1000.0
    result: dict[str, Any] = {
        "phases_ms": phases_ms,
        "handover_ms": handover_ms,
        "phase_counts": counts,
        "sum_of_phases_ms": sum(phases_ms.values()),
        "router_ttft_ms": router_ttft[0] if router_ttft else None,
        "num_requests": len(client),
        "client_ttft_ms": {"mean": float(client.mean()), "p50": float(np.percentile(client, 50)),
                           "p99": float(np.percentile(client, 99))} if client.size else None,
    }
    if router_ttft and client.size:
        result["phases_ms"][HTTP_PHASE] = max(0.0, float(client.mean()) - router_ttft[0])
    return result


def format_table(results: Mapping[str, Mapping[str, Any]],
                 offline_prefill_ms: Mapping[str, float] | None = None) -> str:
    """Phases as rows, runs ('<setup> <load>') as columns, mean ms; a last column with the
    disaggregated minus the colocated one-at-a-time run when both are there."""
    runs = list(results)
    pair = ("disagg sequential", "colocated sequential")
    has_delta = all(run in results for run in pair)
    width = 22
    header = f"{'phase (mean ms)':<{width}}" + "".join(f"{run:>{width}}" for run in runs)
    if has_delta:
        header += f"{'disagg - coloc (seq)':>{width}}"
    lines = [header, "-" * len(header)]
    rows = [(name, name) for name in (*TTFT_PHASES, HTTP_PHASE)]
    rows += [("= client TTFT", "client_mean"), ("  router TTFT", "router_ttft"),
             ("  client TTFT p50", "client_p50"), ("after the first token:", None)]
    rows += [(f"  {name}", name) for name in HANDOVER_PHASES]
    for label, key in rows:
        if key is None:
            lines.append(label)
            continue
        values = [_lookup(results[run], key) for run in runs]
        cells = "".join(f"{'-':>{width}}" if v is None else f"{v:{width}.2f}" for v in values)
        if has_delta:
            d, c = (_lookup(results[run], key) for run in pair)
            cells += (f"{'-':>{width}}" if d is None and c is None
                      else f"{(d or 0.0) - (c or 0.0):{width}.2f}")
        lines.append(f"{label:<{width}}{cells}")
    for threads, ms in (offline_prefill_ms or {}).items():
        lines.append(f"offline prefill, {threads}: {ms:.2f} ms (LLM.generate, max_tokens=1)")
    return "\n".join(lines)


def _lookup(run: Mapping[str, Any], key: str) -> float | None:
    client = run.get("client_ttft_ms") or {}
    if key == "client_mean":
        return client.get("mean")
    if key == "client_p50":
        return client.get("p50")
    if key == "router_ttft":
        return run.get("router_ttft_ms")
    return run["phases_ms"].get(key, run["handover_ms"].get(key))


# ---- clusters ----------------------------------------------------------------------------
def _threads_per_rank(config: BreakdownConfig, num_ranks: int) -> int:
    if config.cpu_threads is not None:
        return config.cpu_threads
    return max(1, len(os.sched_getaffinity(0)) // num_ranks)


@dataclass
class RunningCluster:
    """A `pdserve up` cluster this benchmark started (launcher.plan's children)."""

    setup: str
    base_url: str
    cluster: Any
    """pdserve.app.launcher.Cluster."""
    threads: int
    run_dir: Path
    """The cluster key and the decode workers' idle flags (removed on stop)."""

    def stop(self) -> None:
        self.cluster.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def start_cluster(setup: str, model_dir: str, config: BreakdownConfig) -> RunningCluster:
    """`pdserve up --mode <setup>` on this benchmark's ports, ready; stopped on failure."""
    from pdserve.app import launcher

    port = config.base_port + 20 * SETUPS.index(setup)
    argv = ["--model", model_dir, "--mode", "colocated" if setup == "colocated" else "disagg",
            "--port", str(port), "--worker-base-port", str(port + 10),
            "--store-port", str(port + 15)]
    if setup == "disagg-no-store":
        argv.append("--no-store")
    if setup == "disagg-no-lending":
        argv.append("--no-core-lending")
    if config.device is not None:
        argv += ["--device", config.device]
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-ttft-"))
    launcher.provide_cluster_key(args, run_dir)
    cluster = launcher.plan(args, model_dir, run_dir=run_dir)
    workers = [c for c in cluster.children if c.role not in ("router", "store")]
    threads = _threads_per_rank(config, len(workers))  # TP 1 each
    for child in cluster.children:
        child.env["PDSERVE_LOG_LEVEL"] = "WARNING"  # keep the progress lines readable
        if "--cpu-threads" in child.argv:
            child.argv[child.argv.index("--cpu-threads") + 1] = str(threads)
    running = RunningCluster(setup, f"http://127.0.0.1:{port}", cluster, threads, run_dir)
    try:
        for child in cluster.children:
            child.start()
        _wait_ready(running, config.ready_timeout_s)
    except BaseException:
        running.stop()
        raise
    return running


def _wait_ready(running: RunningCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        dead = [c for c in running.cluster.children if c.exited]
        if dead:
            raise RuntimeError(f"{running.setup}: {dead[0].role} exited with code "
                               f"{dead[0].process.returncode} while starting")
        try:
            if httpx.get(f"{running.base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{running.setup} not ready within {timeout_s:.0f}s")
        time.sleep(0.5)


# ---- measuring -----------------------------------------------------------------------------
@dataclass
class Workload:
    """Fresh prompts for every run, none repeated (distinct seeds)."""

    codec: TokenCodec
    config: BreakdownConfig
    num_drawn: int = field(default=0)

    def draw(self, num_prompts: int) -> list[BenchRequest]:
        self.num_drawn += 1
        return random_requests(self.codec, num_prompts, self.config.prompt_len,
                               self.config.max_tokens, seed=self.config.seed * 1000
                               + self.num_drawn)


async def _metrics_text(http: httpx.AsyncClient, base_url: str) -> str:
    response = await http.get(f"{base_url}/metrics", timeout=10.0)
    response.raise_for_status()
    return response.text


async def _measure(http: httpx.AsyncClient, endpoint: EndpointConfig,
                   requests: Sequence[BenchRequest], offsets_s: Sequence[float],
                   max_concurrency: int | None, desc: str, timeout_s: float
                   ) -> dict[str, Any]:
    before = await _metrics_text(http, endpoint.base_url)
    outcomes, duration_s = await asyncio.wait_for(
        run_load(http, endpoint, requests, offsets_s, max_concurrency, disable_tqdm=False,
                 desc=desc), timeout_s)
    after = await _metrics_text(http, endpoint.base_url)
    failed = [o for o in outcomes if not o.success]
    if failed:
        raise RuntimeError(f"{desc}: {len(failed)} requests failed, e.g. {failed[0].error}")
    result = analyze(before, after, [o.ttft_s for o in outcomes])
    result["duration_s"] = duration_s
    result["num_cached_prompt_tokens"] = sum(_cached(o) for o in outcomes)
    return result


def _cached(outcome: RequestOutcome) -> int:
    return outcome.cached_tokens or 0


async def measure_setup(running: RunningCluster, workload: Workload, config: BreakdownConfig
                        ) -> dict[str, dict[str, Any]]:
    """One-at-a-time and Poisson runs against one cluster (after a warm-up)."""
    async with httpx.AsyncClient(timeout=config.request_timeout_s) as http:
        model = (await list_models(http, running.base_url))[0]
        endpoint = EndpointConfig(running.base_url, model, ignore_eos=True,
                                  request_timeout_s=config.request_timeout_s,
                                  extra_body={"temperature": 0})
        per_request_s = config.request_timeout_s
        warmup = workload.draw(NUM_WARMUP_REQUESTS)
        await _measure(http, endpoint, warmup, [0.0] * len(warmup), 1,
                       f"{running.setup} warm-up", per_request_s * len(warmup))
        sequential = workload.draw(config.num_sequential)
        seq = await _measure(http, endpoint, sequential, [0.0] * len(sequential), 1,
                             f"{running.setup} one at a time",
                             per_request_s * len(sequential))
        loaded = workload.draw(config.num_requests)
        offsets = arrival_offsets_s(len(loaded), ArrivalConfig(config.request_rate,
                                                               seed=config.seed))
        load = await _measure(http, endpoint, loaded, offsets, None,
                              f"{running.setup} Poisson {config.request_rate:g} req/s",
                              float(offsets[-1]) + per_request_s * 2)
    return {"sequential": seq, f"poisson {config.request_rate:g} req/s": load}


def offline_prefill_ms(model_dir: str, config: BreakdownConfig, thread_counts: Sequence[int]
                       ) -> dict[str, float]:
    """Mean time of LLM.generate(max_tokens=1) on a fresh prompt of --prompt-len tokens, per
    thread count (one warm-up prompt first)."""
    import torch

    from pdserve.serve import LLM, SamplingParams

    rng = np.random.default_rng(config.seed + 7)
    vocab_size = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=1)
    found = {}
    llm = LLM(model_dir, device=config.device)
    try:
        for threads in sorted(set(thread_counts)):
            torch.set_num_threads(threads)
            times_s = []
            for i in range(NUM_OFFLINE_PROMPTS + 1):
                prompt = [int(t) for t in rng.integers(0, vocab_size, config.prompt_len)]
                start_s = time.perf_counter()
                llm.generate([prompt], params)
                if i > 0:  # the first is the warm-up
                    times_s.append(time.perf_counter() - start_s)
            found[f"{threads} thread{'s' if threads > 1 else ''}"] = \
                1000.0 * float(np.mean(times_s))
    finally:
        llm.shutdown()
    return found


# ---- plot --------------------------------------------------------------------------------
def plot_breakdown(results: Mapping[str, Mapping[str, Any]], path: str | Path,
                   offline_ms: Mapping[str, float] | None = None) -> Path:
    """One stacked bar per run: the TTFT phases and `http` (mean ms); a dot marks the
    client's mean TTFT, dashed lines the offline prefill."""
    plt = pyplot()
    runs = list(results)
    fig, ax = plt.subplots(figsize=(1.9 * len(runs) + 3.0, 4.8))
    colours = plt.get_cmap("tab10").colors
    bottoms = np.zeros(len(runs))
    for index, name in enumerate((*TTFT_PHASES, HTTP_PHASE)):
        values = np.array([results[r]["phases_ms"].get(name, 0.0) for r in runs])
        if not values.any():
            continue
        ax.bar(range(len(runs)), values, bottom=bottoms, label=name,
               color=colours[index % len(colours)], width=0.6)
        bottoms += values
    client = [(results[r].get("client_ttft_ms") or {}).get("mean", math.nan) for r in runs]
    ax.plot(range(len(runs)), client, "k.", markersize=10, label="client TTFT")
    for (label, ms), style in zip((offline_ms or {}).items(), (":", "--", "-."),
                                  strict=False):
        ax.axhline(ms, color="grey", linestyle=style, linewidth=1,
                   label=f"offline prefill ({label})")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([r.replace(" ", "\n", 1) for r in runs], fontsize="small")
    ax.set_ylabel("mean time (ms)")
    ax.set_title("Where the time to first token goes")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, plt, path)


# ---- entry point -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BreakdownConfig()
    add = parser.add_argument
    add("--model", default=d.model, help="checkpoint dir (default: the embedded tiny model)")
    add("--prompt-len", type=int, default=d.prompt_len)
    add("--max-tokens", type=int, default=d.max_tokens)
    add("--sequential", type=int, default=d.num_sequential,
        help="requests sent one at a time")
    add("--rate", type=float, default=d.request_rate, help="Poisson rate of the loaded run")
    add("--num-requests", type=int, default=d.num_requests, help="requests of the loaded run")
    add("--setups", nargs="+", choices=SETUPS, default=list(d.setups),
        help="systems to measure, in order")
    add("--seed", type=int, default=d.seed)
    add("--base-port", type=int, default=d.base_port,
        help="the clusters take ports from here on (20 per setup)")
    add("--cpu-threads", type=int, default=d.cpu_threads,
        help="threads per worker (default: this process's CPUs split over the workers)")
    add("--device", choices=("cuda", "cpu"), default=d.device)
    add("--ready-timeout-s", type=float, default=d.ready_timeout_s)
    add("--request-timeout-s", type=float, default=d.request_timeout_s)
    add("--output-dir", "--out-dir", dest="out_dir", default=d.out_dir,
        help="where ttft_breakdown.json and .png go (default: $PDSERVE_RESULTS_DIR/"
             "ttft_breakdown, else ~/.cache/pdserve/results/ttft_breakdown)")
    add("--skip-offline", action="store_true", help="skip the offline prefill reference")


def config_from_args(args: argparse.Namespace) -> BreakdownConfig:
    return BreakdownConfig(
        model=args.model, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        num_sequential=args.sequential, request_rate=args.rate,
        num_requests=args.num_requests, setups=tuple(args.setups), seed=args.seed,
        base_port=args.base_port, cpu_threads=args.cpu_threads, device=args.device,
        ready_timeout_s=args.ready_timeout_s, request_timeout_s=args.request_timeout_s,
        out_dir=args.out_dir)


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"ttft_breakdown: {exc}", file=sys.stderr)
        return 2
    if config.model is None:
        from pdserve.serve.default_model import default_model_dir

        model_dir = str(default_model_dir())
    else:
        model_dir = config.model
    # SIGTERM stops the clusters as Ctrl-C does (their processes are in sessions of their own)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    workload = Workload(TokenCodec.load(model_dir), config)
    results: dict[str, dict[str, Any]] = {}
    threads: dict[str, int] = {}
    offline: dict[str, float] = {}
    try:
        if not args.skip_offline:  # first: it also builds the CPU kernels the workers load
            print("[offline] prefill reference ...", file=sys.stderr, flush=True)
            offline = offline_prefill_ms(model_dir, config, [
                _threads_per_rank(config, 1 if setup == "colocated" else 2)
                for setup in config.setups])
        for setup in config.setups:
            print(f"[{setup}] starting the cluster ...", file=sys.stderr, flush=True)
            start_s = time.monotonic()
            running = start_cluster(setup, model_dir, config)
            try:
                threads[setup] = running.threads
                print(f"[{setup}] ready in {time.monotonic() - start_s:.1f}s "
                      f"({running.threads} thread(s) per worker)", file=sys.stderr, flush=True)
                for load, result in asyncio.run(measure_setup(running, workload,
                                                              config)).items():
                    results[f"{setup} {load}"] = result
            finally:
                print(f"[{setup}] stopping the cluster", file=sys.stderr, flush=True)
                running.stop()
    except KeyboardInterrupt:
        print("ttft_breakdown: interrupted; clusters stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, asyncio.TimeoutError, httpx.HTTPError) as exc:
        print(f"ttft_breakdown: {exc}", file=sys.stderr)
        return 1
    print(format_table(results, offline))
    out_dir = Path(config.out_dir) if config.out_dir else default_dir("ttft_breakdown")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"config": asdict(config), "model_dir": model_dir, "threads_per_worker": threads,
              "cpu_affinity": sorted(os.sched_getaffinity(0)), "offline_prefill_ms": offline,
              "runs": results}
    json_path = out_dir / "ttft_breakdown.json"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    png_path = plot_breakdown(results, out_dir / "ttft_breakdown.png", offline)
    print(f"wrote {json_path} and {png_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
