"""Is ready ready? The first requests after `pdserve up` says so, against later ones.

    python -m benchmarks.first_requests [--model DIR] [--requests 40] [--rounds 2]

Starts `pdserve up` (disaggregated, the defaults), and the moment it prints that it is ready
sends --requests one-at-a-time completions of fresh prompts (--prompt-len words, --max-tokens
out), timing each. Whatever the cluster still does in the background right after "ready" (the
standbys' imports, a path measurement) shows as the first requests taking longer than the
later ones. Each round runs once with standbys and once without (--no-standby), alternated.
Prints the medians of the first --head requests and of the rest per run, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks import server_process
from pdserve.benchmarks.output import add_output_dir, output_path

READY_LINE = "pdserve is ready"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint dir (default: the embedded tiny random model)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--head", type=int, default=8,
                        help="the first requests, compared with the rest")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64, help="words per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: first_requests.json in --output-dir)")
    add_output_dir(parser, "first_requests")


def start_up(args: argparse.Namespace, standby: bool, log: Path) -> subprocess.Popen:
    """`pdserve up`, returned the moment it prints that it is ready."""
    command = [sys.executable, "-m", "pdserve.app.cli", "up", "--port", str(args.port),
               "--worker-base-port", str(args.port + 10), "--store-port", str(args.port + 20)]
    command += (["--model", args.model] if args.model else []) + \
        ([] if standby else ["--no-standby"])
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + args.ready_timeout_s
    while READY_LINE not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            server_process.stop(process)
            raise RuntimeError(f"pdserve up did not get ready: see {log}")
        time.sleep(0.05)
    return process


def latencies(args: argparse.Namespace, rng: random.Random) -> list[float]:
    """Seconds per request, one at a time, each prompt fresh."""
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    seconds = []
    with httpx.Client(timeout=120) as client:
        for _ in range(args.requests):
            prompt = " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(args.prompt_len))
            start = time.perf_counter()
            r = client.post(url, json={"prompt": prompt, "max_tokens": args.max_tokens,
                                       "ignore_eos": True, "temperature": 0})
            r.raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds


def summary(seconds: list[float], head: int) -> dict[str, float]:
    return {"head_median_ms": 1e3 * statistics.median(seconds[:head]),
            "rest_median_ms": 1e3 * statistics.median(seconds[head:]),
            "head_max_ms": 1e3 * max(seconds[:head]),
            "ratio": statistics.median(seconds[:head]) / statistics.median(seconds[head:])}


def run(args: argparse.Namespace) -> int:
    if args.requests <= args.head:
        print("--requests must exceed --head", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), "unknown")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-first-") as tmp:
        for round_index in range(args.rounds):
            for standby in (True, False):
                process = start_up(args, standby, Path(tmp) / f"up-{round_index}-{standby}.log")
                try:
                    seconds = latencies(args, rng)
                finally:
                    server_process.stop(process)
                row = {"round": round_index, "standby": standby, **summary(seconds, args.head),
                       "seconds": seconds}
                runs.append(row)
                print(f"round {round_index} standbys {'on ' if standby else 'off'}: first "
                      f"{args.head} median {row['head_median_ms']:.1f} ms (max "
                      f"{row['head_max_ms']:.1f}), the rest {row['rest_median_ms']:.1f} ms: "
                      f"{row['ratio']:.2f}x", flush=True)
    result = {"cpu": cpu, "requests": args.requests, "head": args.head,
              "prompt_words": args.prompt_len, "max_tokens": args.max_tokens, "runs": runs}
    output = output_path(args, "first_requests", "first_requests.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    print(f"wrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
