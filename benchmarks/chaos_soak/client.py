"""The load's clients: processes of their own, each sending its share of the planned requests
at their planned times and parsing their answers, apart from the supervisor that kills and
restarts the fleet (and apart from each other, so that one client's parsing does not delay
another's sends). A client tries router-0 and, where the connection is refused, router-1, as
a load balancer in front of both would.

    python -m benchmarks.chaos_soak.client --plan PLAN.json --out OUT.json

The supervisor (run_clients) writes each client's plan, waits until every client has started
and says "ready", then sends the schedule's start (a time.monotonic() value: CLOCK_MONOTONIC is
one clock for every process of the machine) on each client's stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos_soak.workload import Outcome, PlannedRequest, from_json, to_json

REPO = Path(__file__).resolve().parents[2]


async def send(client: httpx.AsyncClient, urls: list[str], planned: PlannedRequest,
               t0: float) -> Outcome:
    outcome = Outcome(planned.index, planned.kind, time.monotonic() - t0, at_s=planned.at_s)
    for router, url in enumerate(urls):  # the next router only where this one refuses
        outcome.router = router
        try:
            await _send_to(client, f"{url}{planned.path}", planned.body, outcome)
            break
        except httpx.ConnectError as exc:
            outcome.cause, outcome.error = "no_router", f"ConnectError: {exc}"[:200]
        except httpx.TimeoutException as exc:
            outcome.cause, outcome.error = "timeout", f"{type(exc).__name__}: {exc}"[:200]
            break
        except httpx.HTTPError as exc:  # the connection broke: RemoteProtocolError, ReadError
            outcome.cause, outcome.error = "transport", f"{type(exc).__name__}: {exc}"[:200]
            break
        except (ValueError, KeyError, TypeError) as exc:  # not the JSON an answer is
            outcome.cause, outcome.error = "bad_response", f"{type(exc).__name__}: {exc}"[:200]
            break
    outcome.end_s = time.monotonic() - t0
    if outcome.ok:
        outcome.cause = outcome.error = None
    return outcome


async def _send_to(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                   outcome: Outcome) -> None:
    start = time.monotonic()
    num_choices = body.get("n", 1)
    outcome.texts = [""] * num_choices
    outcome.finish_reasons = [None] * num_choices
    if not body.get("stream"):
        r = await client.post(url, json=body)
        if r.status_code != 200:
            outcome.cause, outcome.error = f"http_{r.status_code}", r.text[:160]
            return
        answer = r.json()
        outcome.ttft_s = time.monotonic() - start  # the whole answer: its first token too
        outcome.num_tokens = answer["usage"]["completion_tokens"]
        for choice in answer["choices"]:
            outcome.texts[choice["index"]] = choice["text"]
            outcome.finish_reasons[choice["index"]] = choice["finish_reason"]
            if body.get("logprobs") is not None:
                logprobs = choice.get("logprobs") or {}
                outcome.token_logprobs = logprobs.get("token_logprobs")
                outcome.top_logprobs = logprobs.get("top_logprobs")
        outcome.ok = None not in outcome.finish_reasons
        if not outcome.ok:
            outcome.cause, outcome.error = "stream_incomplete", "an answer with no finish_reason"
        return
    if num_choices > 1:
        outcome.pieces = [[] for _ in range(num_choices)]
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            outcome.cause = f"http_{r.status_code}"
            outcome.error = f"{(await r.aread())[:160]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                outcome.cause = "stream_error"
                outcome.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                return
            for choice in chunk.get("choices", []):
                index = choice.get("index", 0)
                text = choice.get("text", choice.get("delta", {}).get("content"))
                if text:
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - start
                    outcome.num_tokens += 1
                    outcome.texts[index] += text
                    if outcome.pieces is not None:
                        outcome.pieces[index].append(text)
                if choice.get("finish_reason") is not None:
                    outcome.finish_reasons[index] = choice["finish_reason"]
    finished = sum(reason is not None for reason in outcome.finish_reasons)
    outcome.ok = finished == num_choices
    if not outcome.ok:
        outcome.cause = "stream_incomplete"
        outcome.error = f"stream ended with {finished}/{num_choices} choices finished"


async def dispatch(urls: list[str], planned: list[PlannedRequest], t0: float,
                   timeout_s: float) -> list[Outcome]:
    """Send each request at t0 + its at_s (at once where that has passed: a late client
    catches up rather than thinning the load) and gather what every one came to."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                 limits=limits) as client:
        tasks = []
        for request in sorted(planned, key=lambda p: p.at_s):
            delay = t0 + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, urls, request, t0)))
        return list(await asyncio.gather(*tasks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one chaos-soak load client")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    planned = [from_json(entry) for entry in plan["requests"]]
    print("ready", flush=True)
    t0 = float(sys.stdin.readline())
    outcomes = asyncio.run(dispatch(plan["urls"], planned, t0, plan["timeout_s"]))
    # a non-finite logprob goes as NaN / Infinity, which Python's json reads back as it was
    args.out.write_text(json.dumps([asdict(outcome) for outcome in outcomes]))
    return 0


def run_clients(urls: list[str], planned: list[PlannedRequest], num_clients: int,
                work_dir: Path, timeout_s: float, during=None) -> tuple[float, list[Outcome]]:
    """Send `planned` from `num_clients` client processes (request i from client i mod n):
    (the schedule's start, a time.monotonic() value; every outcome). `during(t0)`, when
    given, runs in this process while the clients send (the kills)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    clients = []
    try:
        for k in range(num_clients):
            plan_path, out = work_dir / f"plan-{k}.json", work_dir / f"outcomes-{k}.json"
            share = [to_json(p) for p in planned[k::num_clients]]
            plan_path.write_text(json.dumps({"urls": urls, "timeout_s": timeout_s,
                                             "requests": share}))
            out.unlink(missing_ok=True)
            clients.append((subprocess.Popen(
                [sys.executable, "-m", "benchmarks.chaos_soak.client", "--plan",
                 str(plan_path), "--out", str(out)], cwd=REPO, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True), out))
        for process, _ in clients:  # imports done, plan read: start the clock
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError("a load client did not start")
        t0 = time.monotonic() + 0.2
        for process, _ in clients:
            process.stdin.write(f"{t0!r}\n")
            process.stdin.flush()
        if during is not None:
            during(t0)
        outcomes: list[Outcome] = []
        for process, out in clients:
            if process.wait() != 0:
                raise RuntimeError(f"a load client failed (exit {process.returncode})")
            outcomes += [Outcome(**row) for row in json.loads(out.read_text())]
    finally:
        for process, _ in clients:
            if process.poll() is None:
                process.kill()
                process.wait()
    return t0, sorted(outcomes, key=lambda o: o.index)


if __name__ == "__main__":
    sys.exit(main())
