"""Multi-turn chat with more conversations than a worker's pool holds: how much of each
turn's history comes back from the tiers below the pool instead of being recomputed.

    python -m benchmarks.kv_offload [--model DIR] [--modes colocated disagg]

LMCache's multi-round QA shape: C conversations x T turns, each turn the whole history plus
`--new-tokens` fresh tokens, conversations interleaved (turn 1 of every conversation, then
turn 2 of every one, ...), one request at a time, so the KV of a conversation has left the
pool (`--num-kv-blocks`) by the time its next turn comes. Each mode runs twice under
`pdserve up`: with prefix caching (the pool, its host DRAM tier, the store) and with
`--no-prefix-caching` (every turn recomputed: the baseline). Prompts are fresh random tokens
per run. It prints, per run, the cached prompt tokens the server reported against the ideal
(every earlier turn of the conversation), the mean TTFT of turns 2..T and its ratio to the
baseline, per tier (device / host / store) the hit tokens the workers counted, and for the
disaggregated runs the bytes hand-offs moved into decode against those decode already held
(decode-side reuse); writes kv_offload.json and a plot of mean TTFT per turn.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

import httpx

from pdserve.benchmarks import server_process
from pdserve.benchmarks.output import add_output_dir, output_dir

PORT = 18760


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: step_roofline's llama-mid-like model)")
    parser.add_argument("--modes", nargs="+", default=["colocated", "disagg"],
                        choices=["colocated", "disagg"])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="fresh tokens each turn adds to the history")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=128,
                        help="each worker's pool (the conversations must not fit in it)")
    parser.add_argument("--up-args", default="", help="extra `pdserve up` flags")
    parser.add_argument("--seed", type=int, default=0)
    add_output_dir(parser, "kv_offload")


def start(model: Path, mode: str, caching: bool, args: argparse.Namespace, log: Path
          ) -> subprocess.Popen:
    pdserve = shutil.which("pdserve") or "pdserve"
    command = [pdserve, "up", "--model", str(model), "--mode", mode, "--port", str(PORT),
               "--worker-base-port", str(PORT + 10), "--store-port", str(PORT + 30),
               "--num-kv-blocks", str(args.num_kv_blocks), *args.up_args.split()]
    if not caching:
        command.append("--no-prefix-caching")
    return server_process.start(command, log, f"http://127.0.0.1:{PORT}/health", 300)


def send(client: httpx.Client, model: str, prompt: list[int], output_len: int
         ) -> tuple[float, int]:
    """One streamed completion: (TTFT in seconds, cached prompt tokens reported)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    ttft, cached = None, None
    with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:200]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - sent
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if ttft is None or cached is None:
        raise RuntimeError("a stream without a token or without usage")
    return ttft, cached


def tiers(client: httpx.Client) -> dict[str, float]:
    """The workers' kv_tiers counters and hand-off bytes, summed over workers."""
    summed: dict[str, float] = {}
    for worker in client.get(f"http://127.0.0.1:{PORT}/status").json()["workers"]:
        counters = {**(worker.get("kv_tiers") or {}),
                    **{k: v for k, v in (worker.get("kv_transfer") or {}).items()
                       if k.startswith("handoff_")}}
        for name, value in counters.items():
            if name.endswith(("_hit_tokens", "_read_bytes", "_written_bytes", "_evictions",
                              "_writes_dropped", "_chosen", "handoff_bytes",
                              "handoff_reused_bytes")):
                summed[name] = summed.get(name, 0.0) + value
    return summed


def run_one(model: Path, mode: str, caching: bool, args: argparse.Namespace, out: Path,
            seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    histories = [[] for _ in range(args.conversations)]
    process = start(model, mode, caching, args, out / f"serve-{mode}-{caching}.log")
    rows = []
    try:
        with httpx.Client(timeout=120) as client:
            warm = [rng.randrange(vocab) for _ in range(args.new_tokens)]
            send(client, model.name, warm, args.output_len)  # unmeasured
            for turn in range(1, args.turns + 1):
                for conversation, history in enumerate(histories):
                    ideal = len(history)
                    history += [rng.randrange(vocab) for _ in range(args.new_tokens)]
                    ttft, cached = send(client, model.name, history, args.output_len)
                    rows.append({"turn": turn, "conversation": conversation,
                                 "prompt_tokens": len(history), "ideal_cached": ideal,
                                 "cached": cached, "ttft_s": ttft})
                print(f"  {mode:9s} caching={caching!s:5s} turn {turn}: mean TTFT "
                      f"{1e3 * mean(r['ttft_s'] for r in rows if r['turn'] == turn):.1f} ms",
                      flush=True)
            time.sleep(1.5)  # a status heartbeat after the last request
            counted = tiers(client)
    finally:
        server_process.stop(process)
    later = [r for r in rows if r["turn"] > 1]
    return {"mode": mode, "caching": caching, "rows": rows, "tiers": counted,
            "cached": sum(r["cached"] for r in later),
            "ideal": sum(r["ideal_cached"] for r in later),
            "mean_ttft_later_s": mean(r["ttft_s"] for r in later)}


def summarize(runs: list[dict[str, Any]]) -> None:
    print(f"\n{'mode':10s} {'caching':8s} {'cached / ideal':>22s} {'TTFT 2..T':>10s} "
          f"{'x no-cache':>10s}  hit tokens by tier")
    baseline = {r["mode"]: r["mean_ttft_later_s"] for r in runs if not r["caching"]}
    for r in runs:
        ratio = r["mean_ttft_later_s"] / baseline[r["mode"]] if r["mode"] in baseline else None
        r["ttft_ratio_to_no_caching"] = ratio
        share = r["cached"] / max(r["ideal"], 1)
        by_tier = ", ".join(f"{tier} {r['tiers'].get(f'{tier}_hit_tokens', 0):.0f}"
                            for tier in ("device", "host", "store"))
        print(f"{r['mode']:10s} {'on' if r['caching'] else 'off':8s} "
              f"{r['cached']:>7d} / {r['ideal']:>6d} = {share:4.2f} "
              f"{1e3 * r['mean_ttft_later_s']:8.1f}ms "
              f"{'' if ratio is None else f'{ratio:9.2f}x'}  {by_tier}")
    for r in runs:  # decode-side reuse: what the hand-offs moved of the whole prompts
        moved = r["tiers"].get("handoff_bytes", 0.0)
        reused = r["tiers"].get("handoff_reused_bytes", 0.0)
        if moved or reused:
            print(f"{r['mode']} caching={'on' if r['caching'] else 'off'}: hand-offs moved "
                  f"{moved / 2**20:.1f} MiB, reused {reused / 2**20:.1f} MiB held by decode, "
                  f"of {(moved + reused) / 2**20:.1f} MiB of whole prompts "
                  f"({moved / max(moved + reused, 1):.2f} moved)")


def plot(runs: list[dict[str, Any]], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in runs:
        turns = sorted({row["turn"] for row in r["rows"]})
        ttft = [1e3 * mean(row["ttft_s"] for row in r["rows"] if row["turn"] == t)
                for t in turns]
        ax.plot(turns, ttft, marker="o", linestyle="-" if r["caching"] else "--",
                label=f"{r['mode']}, prefix caching {'on' if r['caching'] else 'off'}")
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("Multi-turn chat past the pool: TTFT per turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def machine() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run(args: argparse.Namespace) -> int:
    if args.model:
        model = Path(args.model)
    else:
        from pdserve.benchmarks.offline import mid_model_dir

        model = mid_model_dir()
    out = output_dir(args, "kv_offload")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, mode in enumerate(args.modes):
        for j, caching in enumerate((True, False)):
            runs.append(run_one(model, mode, caching, args, out, args.seed + 10 * i + j))
            time.sleep(2)
    summarize(runs)
    result = {"machine": machine(), "model": str(model), "args": {
        k: v for k, v in vars(args).items() if k != "output_dir"}, "runs": runs}
    (out / "kv_offload.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out / 'kv_offload.json'} and {plot(runs, out / 'kv_offload.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
