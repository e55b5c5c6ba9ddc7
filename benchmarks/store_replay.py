"""Trace replay through the tiered KV store: token hit ratio against the infinite-cache ideal.

Each request of a Mooncake trace names its 512-token prefix blocks by `hash_ids`; equal leading
ids are a shared prefix. Replayed in arrival order through a TieredStore (DRAM + disk, given
capacities, blocks of --block-bytes scaled bytes):

    n = lookup_prefix(keys)        leading blocks cached: the request's reusable prefix
    get(keys[:n])                  a hit promotes (disk -> DRAM) and refreshes LRU order
    put(keys[n:])                  the recomputed blocks are saved (demoting LRU blocks)

Token hit ratio = sum(min(n * 512, input_length)) / sum(input_length), the same measure as the
ideal (an infinite cache), which for the conversation trace is 0.374. A sweep over DRAM-only
capacities (fractions of the working set) draws hit ratio against capacity.

    python -m benchmarks.store_replay --trace FILE --dram-blocks N \\
        --disk-blocks M
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.kvstore.tiered_store import TieredStore

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block size


@dataclass(frozen=True)
class TraceRequest:
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str, max_requests: int | None = None) -> list[TraceRequest]:
    requests = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            requests.append(TraceRequest(int(record["input_length"]),
                                         tuple(int(h) for h in record["hash_ids"])))
            if max_requests is not None and len(requests) >= max_requests:
                break
    return requests


def _key(hash_id: int) -> bytes:
    return hash_id.to_bytes(16, "little")


def ideal_hit_ratio(requests: Sequence[TraceRequest]) -> float:
    """Token hit ratio of an infinite cache."""
    seen: set[int] = set()
    hit_tokens = 0
    for r in requests:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        hit_tokens += min(n * TRACE_BLOCK_TOKENS, r.input_length)
        seen.update(r.hash_ids)
    return hit_tokens / max(1, sum(r.input_length for r in requests))


def replay(requests: Sequence[TraceRequest], store: TieredStore, block_bytes: int) -> float:
    """Token hit ratio of the trace through `store`."""
    payload = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    hit_tokens = 0
    for r in requests:
        keys = [_key(h) for h in r.hash_ids]
        n = store.lookup_prefix(keys)
        got = store.get_many(keys[:n])
        n = next((i for i, block in enumerate(got) if block is None), n)  # a corrupt block
        hit_tokens += min(n * TRACE_BLOCK_TOKENS, r.input_length)
        for k in keys[n:]:
            store.put(k, payload)
    return hit_tokens / max(1, sum(r.input_length for r in requests))


def plot_sweep(points: Sequence[tuple[int, float]], ideal: float, working_set: int,
               measured: tuple[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([c for c, _ in points], [h for _, h in points], marker="o", label="DRAM only (LRU)")
    ax.plot([measured[0]], [measured[1]], marker="*", markersize=12, linestyle="",
            label="DRAM + disk run")
    ax.axhline(ideal, color="grey", linestyle="--", label=f"infinite cache {ideal:.3f}")
    ax.axvline(working_set, color="grey", linestyle=":", label="working set")
    ax.set_xscale("log")
    ax.set_xlabel("store capacity (blocks)")
    ax.set_ylabel("token hit ratio")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="../shared/traces/mooncake_conversation_trace.jsonl")
    parser.add_argument("--dram-blocks", type=int, default=20_000)
    parser.add_argument("--disk-blocks", type=int, default=180_000)
    parser.add_argument("--block-bytes", type=int, default=1024,
                        help="scaled bytes per 512-token block")
    parser.add_argument("--disk-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--sweep-fractions", default="0.01,0.03,0.1,0.3,0.6,1.0",
                        help="DRAM-only capacities as fractions of the working set ('' = none)")
    parser.add_argument("--out", default=None,
                        help="the JSON file (default: store_replay.json in --output-dir)")
    add_output_dir(parser, "store_replay")
    args = parser.parse_args(argv)

    requests = load_trace(args.trace, args.max_requests)
    working_set = len({h for r in requests for h in r.hash_ids})
    ideal = ideal_hit_ratio(requests)

    with tempfile.TemporaryDirectory(prefix="pdserve-replay-") as tmp:
        store = TieredStore.build(args.dram_blocks, args.disk_blocks, args.disk_dir or tmp)
        start = time.perf_counter()
        hit_ratio = replay(requests, store, args.block_bytes)
        elapsed_s = time.perf_counter() - start
        # Disk writes are behind the replay; wait for them so the directory can be removed.
        if not store.flush(timeout_s=1800):
            raise TimeoutError("the disk tier did not finish writing within 30 min")
        flush_s = time.perf_counter() - start - elapsed_s
        stats = store.stats()
        store.check_integrity()
        store.close()

    sweep = []
    fractions = [float(x) for x in args.sweep_fractions.split(",") if x.strip()]
    for fraction in fractions:
        capacity = max(1, int(fraction * working_set))
        sweep_store = TieredStore.build(capacity)
        sweep.append((capacity, replay(requests, sweep_store, 64)))
        sweep_store.close()
        print(f"sweep: {capacity} blocks -> hit ratio {sweep[-1][1]:.4f}", flush=True)

    out = output_path(args, "store_replay", "store_replay.json", args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_path = out.with_suffix(".png")
    if sweep:
        plot_sweep(sweep, ideal, working_set, (args.dram_blocks + args.disk_blocks, hit_ratio),
                   plot_path)
    result = {
        "benchmark": "store_replay",
        "trace": args.trace,
        "num_requests": len(requests),
        "working_set_blocks": working_set,
        "dram_blocks": args.dram_blocks,
        "disk_blocks": args.disk_blocks,
        "block_bytes": args.block_bytes,
        "hit_ratio": round(hit_ratio, 4),
        "ideal_hit_ratio": round(ideal, 4),
        "ratio_to_ideal": round(hit_ratio / ideal, 4) if ideal else None,
        "store_stats": stats,
        "replay_s": round(elapsed_s, 2),
        "disk_write_behind_drain_s": round(flush_s, 2),
        "blocks_per_s": round(sum(len(r.hash_ids) for r in requests) / elapsed_s),
        "sweep": [{"capacity_blocks": c, "hit_ratio": round(h, 4)} for c, h in sweep],
        "plot": str(plot_path) if sweep else None,
    }
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
