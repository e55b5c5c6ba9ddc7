"""Open-loop load from client processes of their own: each sends Poisson arrivals at its share
of the rate, on its own event loop, and reports every request (and the rate it really sent
at, which a client short of CPU falls below). Several processes, so that at hundreds of
requests a second the client is not what saturates first.

    python -m benchmarks.sim_fleet client --base-url URL --model M --rate R --duration-s D \\
        --seed S --out FILE [--prompts FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks.client import EndpointConfig, send_request
from pdserve.benchmarks.datasets import BenchRequest

WORDS = [a + b for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze")
         for b in ("b", "d", "g", "l", "m", "n", "r", "s", "t", "x")]


def fresh_prompt(rng: random.Random, num_words: int) -> str:
    """Words no other request shares (a prefix cache finds nothing to reuse)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", required=True)
    add("--model", required=True)
    add("--rate", type=float, required=True, help="requests a second this client sends")
    add("--duration-s", type=float, required=True)
    add("--seed", type=int, default=0)
    add("--prompt-words", type=int, default=48)
    add("--max-tokens", type=int, default=16)
    add("--prompts", default=None, help="JSON list of prompts to cycle through (with their "
                                        "index in each result); default: fresh prompts")
    add("--each-once", action="store_true",
        help="send every prompt of --prompts once, in order, then stop")
    add("--out", required=True)


async def _client(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    endpoint = EndpointConfig(args.base_url, args.model, ignore_eos=True,
                              request_timeout_s=120.0, extra_body={"temperature": 0})
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as http:

        async def one(index: int, prompt_index: int | None, prompt: str) -> None:
            request = BenchRequest(prompt, args.prompt_words, args.max_tokens)
            outcome = await send_request(http, endpoint, request)
            results.append({"i": index, "prompt": prompt_index, "ok": outcome.success,
                            "cause": outcome.error_cause, "error": outcome.error[:200],
                            "start_s": outcome.start_time_s, "ttft_s": outcome.ttft_s,
                            "latency_s": outcome.latency_s, "text": outcome.generated_text,
                            "tokens": outcome.output_tokens})

        tasks = []
        start = time.perf_counter()
        next_s = 0.0
        index = 0
        while next_s < args.duration_s or args.each_once:
            if args.each_once and index == len(prompts):
                break
            delay = start + next_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if prompts is not None:
                prompt_index = index if args.each_once else rng.randrange(len(prompts))
                prompt = prompts[prompt_index]
            else:
                prompt_index, prompt = None, fresh_prompt(rng, args.prompt_words)
            tasks.append(asyncio.create_task(one(index, prompt_index, prompt)))
            index += 1
            next_s += rng.expovariate(args.rate)
        sent_s = time.perf_counter() - start
        await asyncio.gather(*tasks)
    for result in results:
        result["start_s"] -= start
    return {"sent": index, "send_seconds": sent_s, "offered_rate": args.rate,
            "sent_rate": index / max(sent_s, 1e-9), "results": results}


def run_client(args: argparse.Namespace) -> int:
    report = asyncio.run(_client(args))
    Path(args.out).write_text(json.dumps(report))
    return 0


def run_load(base_url: str | list[str], model: str, rate: float, duration_s: float,
             out_dir: Path, num_clients: int, seed: int = 0, prompt_words: int = 48,
             max_tokens: int = 16, prompts: Path | None = None,
             each_once: bool = False) -> dict[str, Any]:
    """`num_clients` client processes at rate / num_clients each (over the routers of
    `base_url`, in turn); their reports merged."""
    urls = [base_url] if isinstance(base_url, str) else base_url
    procs = []
    for k in range(num_clients):
        base_url = urls[k % len(urls)]
        out = out_dir / f"client-{seed}-{k}.json"
        argv = [sys.executable, "-m", "benchmarks.sim_fleet", "client", "--base-url", base_url,
                "--model", model, "--rate", str(rate / num_clients), "--duration-s",
                str(duration_s), "--seed", str(seed * 1000 + k), "--prompt-words",
                str(prompt_words), "--max-tokens", str(max_tokens), "--out", str(out)]
        if prompts is not None:
            argv += ["--prompts", str(prompts)] + (["--each-once"] if each_once else [])
        procs.append((subprocess.Popen(argv), out))
    merged: dict[str, Any] = {"sent": 0, "results": [], "sent_rates": []}
    for proc, out in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"a load client failed (exit {proc.returncode})")
        report = json.loads(out.read_text())
        merged["sent"] += report["sent"]
        merged["results"] += report["results"]
        merged["sent_rates"].append(report["sent_rate"])
        out.unlink()
    merged["sent_rate"] = sum(merged["sent_rates"])
    return merged
