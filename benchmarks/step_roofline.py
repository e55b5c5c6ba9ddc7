"""The engine step against the machine's floor: decode by bytes moved, prefill by FLOPs.

    python -m benchmarks.step_roofline [--model DIR] [--threads N] [--with-vllm]

A decode step must read every weight once and each sequence's KV once (in the checkpoint's
precision: 2 bytes a value for a bf16 or fp16 one), and do 2 FLOPs per parameter and row plus
its attention's, so it cannot beat

    floor_s = max(bytes / read bandwidth at that many bytes, FLOPs / matmul peak)
    bytes   = weight bytes + batch * context * KV bytes per token

where both ceilings are measured here, on the same threads. The read bandwidth is the faster
of a torch sum and a one-row skinny product over a buffer of exactly the step's bytes, read
again and again as the step reads its weights: a step whose bytes fit the last-level cache is
held to the cache's speed, not the memory's (on a host with a 480 MB L3 the llama-mid-like
model's 97 MB of weights read at ~54 GB/s on 2 threads, against 26 GB/s over 512 MiB). It is
read again in every round, right after that round's steps: on a host whose last-level cache
is shared with other tenants, how much of it this process gets moves from minute to minute
(the same 128 MB read at 37 and at 57 GB/s an hour apart on this project's machines), so a
round's step is held to the floor of that same minute, and a point's "x floor" is the median
of its rounds' ratios. A prefill must do 2 * params FLOPs per token plus the causal
attention's, so it cannot beat FLOPs / the fp32 matmul peak measured here on the same threads
(a large square product: the faster of torch's matmul and the engine's own panel product).

Every timed prompt is fresh (random tokens from a new seed, prefix caching off). A decode
point's prompts are prefilled, then run `--warmup-steps` decode steps untimed (24), for the
engine and vLLM alike: a prefill's activations push the weights out of the last-level cache,
and the decode steps after it run slow until they are back (on this project's machines a
batch-8 step took 7.4 ms right after its prefill and settled at 4.4 ms some 20 steps later).
The point's step is then the median of `--decode-steps` timed steps; the whole sweep runs
`--rounds` times (3), and the point keeps the median of its rounds' (each round's is in the
JSON): on a host shared with other tenants one noisy minute then moves one round, not the
table.

Where the model runs the fused decode loop (pdserve/serve/layers/fused_decode.py), the loop's own
clocks split each point's step (means over the timed steps, medians over the rounds): the layers'
products against their own floor (their weights at the step's read bandwidth, or their FLOPs
at the peak), the attention (its KV write included) with the rate it read its KV at, the rest
of the loop (norms, rotary, SiLU), and the host: the step's time outside the loop (scheduling,
metadata, embedding, the LM head, sampling, outputs).

Without --model it builds (and caches in PDSERVE_CACHE_DIR) a llama-mid-like random Llama:
hidden 512, 8 layers, 8 heads of 64, 4 KV heads, intermediate 1408, fp32 (about 24M
parameters). With --with-vllm (and vLLM installed: ../shared/tools/vllm-peer install) the same
table is measured for vLLM's offline LLM on the same model and threads, side by side
(benchmarks/peer_step.py in vLLM's venv). Prints a table, writes a plot and the
JSON into --output-dir (or next to --output), and prints the JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.offline import mid_model_dir, model_facts, prefill_added
from pdserve.benchmarks.output import add_output_dir, output_path

PEER_PYTHON = os.environ.get("VLLM_PEER_PYTHON", "/tmp/vllm-peer/bin/python")
PARTS = ("products", "attention", "other")  # the fused decode loop's clocks (decode_step.cpp)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local HF checkpoint (default: the llama-mid-like random Llama)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads for pdserve, the floors and vLLM")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prefill-lengths", type=int, nargs="+",
                        default=[256, 512, 1024, 2048])
    parser.add_argument("--decode-steps", type=int, default=12,
                        help="timed decode steps per point (the median is kept)")
    parser.add_argument("--warmup-steps", type=int, default=24,
                        help="untimed decode steps after each point's prefill, before the timed "
                             "ones (pdserve's and vLLM's alike): the steps right after a prefill "
                             "run slow while the weights come back into the last-level cache")
    parser.add_argument("--rounds", type=int, default=3,
                        help="decode sweeps (pdserve's and vLLM's alike): a point's step is the "
                             "median of its rounds' medians, so a noisy minute on a shared host "
                             "moves one round, not the result")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--with-vllm", action="store_true",
                        help=f"also measure vLLM offline (its python: {PEER_PYTHON})")
    parser.add_argument("--paths", action="store_true",
                        help="also time every decode point on every CPU path the engine could "
                             "have chosen (pdserve/serve/executor/cpu_tuning.py), and the "
                             "default's ratio to the best at each point")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="pdserve's engine schedules each step while the one before runs "
                             "(pdserve/serve/engine/overlap.py; default: the engine's own "
                             "default, off on CPU). Compare runs in separate processes: a second "
                             "engine in one process adds a second OpenMP team to the cores")
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: step_roofline.json in --output-dir)")
    add_output_dir(parser, "step_roofline")


# ---- the machine's ceilings, on the same threads ---------------------------------------------
def fastest_s(runs: list[Callable[[], object]], repeats: int) -> float:
    """The shortest time of any of `runs`, each warmed once and then timed `repeats` times."""
    best = float("inf")
    for run in runs:
        run()
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_bytes_per_s(nbytes: int = 512 << 20) -> float:
    """The faster of two readers over a warm buffer of nbytes on huge pages, best of 5 each:
    torch's sum, and pdserve's skinny product of one row (pdserve/kernels/csrc/skinny_gemm.cpp: 2
    FLOPs per 4 bytes, with software prefetch), which on some hosts reads half again as fast
    as the sum. A floor measured with the slower reader alone would let a step beat it."""
    from pdserve.serve.cpu.huge_pages import huge_page_buffer
    from pdserve.serve.layers.common import cpu_kernels

    # on 2 MiB pages where the host gives them, as the engine's weights and KV pool are
    # (pdserve/serve/cpu/huge_pages.py): 37 against 31 GB/s at 231 MB on this project's machines
    buffer = huge_page_buffer(nbytes // 4 * 4)
    data = torch.ones(nbytes // 4) if buffer is None else buffer.view(torch.float32).fill_(1.0)
    readers = [data.sum]
    ops = cpu_kernels()
    if ops is not None:
        rows = data[: nbytes // 4 // 1024 * 1024].view(-1, 1024)
        row = torch.ones(1, 1024)
        readers.append(lambda: ops.skinny_linear(row, rows, None))
    return nbytes / fastest_s(readers, 5)


def matmul_peak_flops(n: int = 2048) -> float:
    """The faster of two fp32 products of [n, n] by [n, n], best of 3 each: torch's matmul
    (oneDNN), and pdserve's panel product (pdserve/kernels/csrc/skinny_gemm.cpp, where the host has
    AVX-512), which the engine's prefill runs on. On a Zen 5 host oneDNN reached 211 GFLOP/s
    and the panel product 490, so a peak of oneDNN's alone let prefill read 165% of it."""
    from pdserve.serve.layers.common import cpu_kernels
    from pdserve.serve.layers.parallel import pack_panels

    a, b = torch.randn(n, n), torch.randn(n, n)
    products = [lambda: a @ b]
    ops = cpu_kernels()
    width = int(ops.panel_width()) if ops is not None else 0
    if width:
        panels = pack_panels(b.t().contiguous(), width)
        products.append(lambda: ops.panel_linear(a, panels, None))
    return 2 * n ** 3 / fastest_s(products, 3)


# ---- the model's byte and FLOP counts -------------------------------------------------------
def decode_bytes(facts: dict[str, Any], batch: int, context: int) -> int:
    return facts["weight_bytes"] + batch * context * facts["kv_bytes_per_token"]


def attention_flops(facts: dict[str, Any], num_pairs: float) -> float:
    """QK^T and PV over num_pairs (query, key) pairs: 2 FLOPs each per head dimension, every
    head and layer."""
    return 2 * 2 * facts["layers"] * facts["heads"] * facts["head_dim"] * num_pairs


def decode_flops(facts: dict[str, Any], batch: int, context: int) -> float:
    """2 FLOPs per parameter per row, plus each row's attention over its context."""
    return 2.0 * facts["matmul_params"] * batch + attention_flops(facts, context * batch)


def prefill_flops(facts: dict[str, Any], tokens: int) -> float:
    """2 FLOPs per parameter per token, plus causal attention (half the square)."""
    return 2.0 * facts["matmul_params"] * tokens + attention_flops(facts, tokens * tokens / 2)


# ---- pdserve ----------------------------------------------------------------------------------
def measure_pdserve(model_dir: Path, args: argparse.Namespace, facts: dict[str, Any]
                    ) -> dict[str, Any]:
    """Each decode point's step time per round, with the read bandwidth at its bytes measured
    right after it in the same round (its floor of that minute); each prompt length's
    prefill."""
    from pdserve.serve import LLM, SamplingParams

    vocab = facts["vocab"]
    budget = max(2048, max(args.prefill_lengths))  # tokens per step
    decode_tokens = args.warmup_steps + args.decode_steps
    # A chunked prefill decodes the batch's first prompts while it still prefills the last:
    # they start up to one token per prefill step ahead, and must not finish inside the timed
    # steps (they did: 32 x 1024, 16 prefill steps, read as a batch of 20-odd).
    head_start = -(-max(args.batch_sizes) * max(args.contexts) // budget) + 1
    longest = max(args.contexts + args.prefill_lengths) + decode_tokens + head_start + 16
    num_blocks = max(args.batch_sizes) * (-(-(max(args.contexts) + decode_tokens + head_start
                                            + 16) // args.block_size)) + 64
    generator = torch.Generator().manual_seed(1234)

    def fresh(length: int) -> list[int]:
        return torch.randint(10, vocab, (length,), generator=generator).tolist()

    prefill = []
    settings = dict(block_size=args.block_size, num_kv_blocks=num_blocks,
                    max_num_seqs=max(args.batch_sizes), max_model_len=longest,
                    max_num_batched_tokens=budget, enable_prefix_caching=False)
    with LLM(str(model_dir), async_scheduling=args.async_scheduling, **settings) as llm:
        llm.wait_for_cpu_path()  # its chosen path and the times it was chosen by (--paths)
        torch.set_num_threads(args.threads)  # the engine set its share; use the asked number
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=decode_tokens + head_start + 4,
                                ignore_eos=True)
        llm.generate([fresh(32)], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        rounds: dict[tuple[int, int], list[float]] = {}
        reads: dict[tuple[int, int], list[float]] = {}
        parts: dict[tuple[int, int], list[list[float]]] = {}
        for _ in range(args.rounds):
            for context in args.contexts:
                for batch in args.batch_sizes:
                    # the loop this batch runs (its parts are timed where the model has one)
                    fused = engine.runner.fused_decode(batch)
                    step_s, seconds = decode_point(engine, [fresh(context) for _ in range(batch)],
                                                   params, args, fused)
                    if seconds is not None:
                        parts.setdefault((batch, context), []).append(
                            (seconds / args.decode_steps).tolist())
                    read = read_bandwidth_bytes_per_s(decode_bytes(facts, batch, context))
                    rounds.setdefault((batch, context), []).append(step_s)
                    reads.setdefault((batch, context), []).append(read / 1e9)
                    print(f"pdserve decode batch {batch} context {context}: "
                          f"{step_s * 1e3:.2f} ms (read {read / 1e9:.1f} GB/s "
                          "at its bytes)", flush=True)
        decode = [{"batch": batch, "context": context,
                   "step_s": sorted(values)[len(values) // 2], "rounds_s": values,
                   "rounds_read_gb_s": reads[batch, context],
                   **({"rounds_parts_s": parts[batch, context]} if parts else {})}
                  for (batch, context), values in rounds.items()]
        one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for length in args.prefill_lengths:
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                llm.generate([fresh(length)], one_token)
                best = min(best, time.perf_counter() - start)
            prefill.append({"tokens": length, "seconds": best})
            print(f"pdserve prefill {length}: {best * 1e3:.1f} ms", flush=True)
        paths = time_every_path(llm, fresh, params, args) if args.paths else {}
    return {"decode": decode, "prefill": prefill, **paths}


def decode_point(engine: Any, prompts: list[list[int]], params: Any, args: argparse.Namespace,
                 fused: Any = None) -> tuple[float, torch.Tensor | None]:
    """One decode point: the prompts prefilled and warmed up untimed, then the median of
    `--decode-steps` timed steps (and the fused loop's part clocks, where it runs)."""
    engine_requests = [engine.add_request(prompt, params) for prompt in prompts]
    prefill_added(engine)  # untimed
    for _ in range(args.warmup_steps):
        engine.step()
    times = []
    if fused is not None:
        fused.phase_seconds = torch.zeros(len(PARTS), dtype=torch.float64)
    for _ in range(args.decode_steps):
        if len(engine.scheduler.running) != len(prompts):
            raise RuntimeError(f"batch {len(prompts)}: {len(engine.scheduler.running)} "
                               "sequences left to time")
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    seconds = None
    if fused is not None:
        seconds, fused.phase_seconds = fused.phase_seconds, None
    for request in engine_requests:  # the tokens left were only a margin
        engine.abort_request(request.request_id)
    return statistics.median(times), seconds


def time_every_path(llm: Any, fresh: Callable[[int], list[int]], params: Any,
                    args: argparse.Namespace) -> dict[str, Any]:
    """--paths: every decode point on every CPU path the engine could have chosen, against the
    path it serves with by default: two passes, the second in reverse order, each path's
    point keeping its faster pass (a noisy minute then costs no path its place)."""
    from pdserve.serve.executor import cpu_tuning as tuning

    runner = llm.engine.runner
    chosen = runner.cpu_tuning
    if chosen is None or not chosen.seconds:
        print("one CPU path only here: nothing to compare", flush=True)
        return {}
    model = runner._rank.model
    steps: dict[str, dict[str, float]] = {}
    # the measured paths, and the chosen one where it is a split of two of them
    order = list(chosen.seconds)[:chosen.num_measured]
    if chosen.chosen.label not in order:
        order.append(chosen.chosen.label)
    for label in order + order[::-1]:
        tuning.apply(model, chosen.paths[label])
        for context in args.contexts:
            for batch in args.batch_sizes:
                step_s, _ = decode_point(llm.engine, [fresh(context) for _ in range(batch)],
                                         params, args)
                key = f"{batch}x{context}"
                steps.setdefault(label, {})[key] = min(step_s, steps.get(label, {}).get(
                    key, float("inf")))
                print(f"path {label} decode {key}: {step_s * 1e3:.2f} ms", flush=True)
    tuning.apply(model, chosen.chosen)
    best = {point: min(times[point] for times in steps.values())
            for point in steps[chosen.chosen.label]}
    ratios = {point: steps[chosen.chosen.label][point] / best[point] for point in best}
    return {"paths_step_s": steps, "default_path": chosen.chosen.label,
            "default_path_source": chosen.source, "default_vs_best_path": ratios}


def measure_vllm(model_dir: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any] | None:
    if not Path(PEER_PYTHON).exists():
        print(f"vLLM not installed ({PEER_PYTHON}); skipping the peer", flush=True)
        return None
    script = Path(__file__).with_name("peer_step.py")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_NO_USAGE_STATS="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    command = [PEER_PYTHON, str(script), "--model", str(model_dir), "--vocab-size", str(vocab),
               "--batch-sizes", *map(str, args.batch_sizes),
               "--contexts", *map(str, args.contexts),
               "--prefill-lengths", *map(str, args.prefill_lengths),
               "--decode-tokens", str(args.decode_steps), "--rounds", str(args.rounds),
               "--warmup-steps", str(args.warmup_steps),
               "--dtype", model_facts(model_dir)["dtype"]]  # vLLM's own precision for it
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        print(f"vLLM run failed:\n{done.stderr[-3000:]}", flush=True)
        return None
    # vLLM logs to stdout too (its shutdown lines come after ours): take our JSON line
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"decode"')]
    if not lines:
        print(f"vLLM printed no result:\n{done.stdout[-2000:]}", flush=True)
        return None
    result = json.loads(lines[-1])
    if any(row["step_s"] <= 0 for row in result["decode"]):
        print("vLLM's decode estimate came out <= 0 for a point (noise); left out", flush=True)
        result["decode"] = [row for row in result["decode"] if row["step_s"] > 0]
    return result


# ---- report -----------------------------------------------------------------------------------
def analyse(facts: dict[str, Any], peak: float, runs: dict[str, Any]) -> dict[str, Any]:
    """Each decode row's rounds (`rounds_s`) against the read bandwidth measured at its bytes
    in the same rounds (`rounds_read_gb_s`): floor and x floor are the medians of the
    rounds'."""
    decode = []
    for row in runs["pdserve"]["decode"]:
        nbytes = decode_bytes(facts, row["batch"], row["context"])
        flops = decode_flops(facts, row["batch"], row["context"])
        compute_s = flops / peak
        memory = [nbytes / (gb_s * 1e9) for gb_s in row["rounds_read_gb_s"]]
        floors = [max(memory_s, compute_s) for memory_s in memory]
        floor_s = statistics.median(floors)
        entry = {**row, "bytes": nbytes, "read_gb_s": statistics.median(row["rounds_read_gb_s"]),
                 "memory_floor_s": statistics.median(memory), "flops": flops,
                 "compute_floor_s": compute_s, "floor_s": floor_s,
                 "x_floor": statistics.median([step_s / floor for step_s, floor in
                                     zip(row["rounds_s"], floors, strict=True)])}
        # the loop's clocks, where its steps ran the loop (a step it does not take reads 0)
        if "rounds_parts_s" in row and all(parts[1] > 0 for parts in row["rounds_parts_s"]):
            entry["parts"] = step_parts(facts, peak, row, entry)
        peer = _match(runs.get("vllm"), "decode", row, ("batch", "context"))
        if peer is not None:
            entry.update(vllm_step_s=peer["step_s"], x_vllm=row["step_s"] / peer["step_s"],
                         vllm_x_floor=peer["step_s"] / floor_s)
        decode.append(entry)
    prefill = []
    for row in runs["pdserve"]["prefill"]:
        flops = prefill_flops(facts, row["tokens"])
        entry = {**row, "flops": flops, "gflops_per_s": flops / row["seconds"] / 1e9,
                 "fraction_of_peak": flops / row["seconds"] / peak}
        peer = _match(runs.get("vllm"), "prefill", row, ("tokens",))
        if peer is not None:
            entry.update(vllm_seconds=peer["seconds"], x_vllm=row["seconds"] / peer["seconds"])
        prefill.append(entry)
    return {"decode": decode, "prefill": prefill}


def step_parts(facts: dict[str, Any], peak: float, row: dict[str, Any],
               entry: dict[str, Any]) -> dict[str, Any]:
    """Where a decode step goes (the fused loop's own clocks, each part the median of its
    rounds' means): the products against their own floor (their weights at the read
    bandwidth, or their FLOPs at the matmul peak; the layers' and the LM head's, which the loop
    multiplies where every product has panels), the attention's KV read rate, the rest of
    the loop (norms, rotary, SiLU), and the host: the step's time outside the loop (scheduling,
    metadata, embedding, sampling, outputs)."""
    medians = [statistics.median(r[i] for r in row["rounds_parts_s"]) for i in range(len(PARTS))]
    products_s, attention_s, other_s = medians
    batch, context = row["batch"], row["context"]
    products_floor_s = max(facts["weight_bytes"] / (entry["read_gb_s"] * 1e9),
                           2.0 * facts["matmul_params"] * batch / peak)
    return {"products_s": products_s, "attention_s": attention_s, "other_s": other_s,
            "host_s": max(0.0, row["step_s"] - sum(medians)),
            "products_floor_s": products_floor_s,
            "attention_gb_s": batch * context * facts["kv_bytes_per_token"] / attention_s / 1e9}


def _match(run: dict[str, Any] | None, kind: str, row: dict[str, Any], keys: tuple[str, ...]
           ) -> dict[str, Any] | None:
    if run is None:
        return None
    return next((r for r in run[kind] if all(r[k] == row[k] for k in keys)), None)


def print_table(result: dict[str, Any]) -> None:
    print(f"\nread bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s over 512 MiB, fp32 "
          f"matmul peak {result['matmul_peak_gflops']:.0f} GFLOP/s on {result['threads']} "
          f"threads; weights {result['model']['weight_bytes'] / 1e6:.1f} MB")
    print(f"{'batch':>5} {'ctx':>5} | {'MB':>6} {'GB/s':>5} | {'step ms':>8} {'floor ms':>8} "
          f"{'x floor':>7} | {'vLLM ms':>8} {'x vLLM':>6}")
    for r in result["decode"]:
        peer = (f"{r['vllm_step_s'] * 1e3:8.2f} {r['x_vllm']:6.2f}" if "vllm_step_s" in r
                else f"{'-':>8} {'-':>6}")
        print(f"{r['batch']:>5} {r['context']:>5} | {r['bytes'] / 1e6:6.0f} {r['read_gb_s']:5.1f} "
              f"| {r['step_s'] * 1e3:8.2f} {r['floor_s'] * 1e3:8.2f} {r['x_floor']:7.2f} | {peer}")
    if any("parts" in r for r in result["decode"]):
        print(f"{'batch':>5} {'ctx':>5} | {'products ms':>11} {'its floor':>9} | "
              f"{'attention ms':>12} {'KV GB/s':>7} | {'other ms':>8} | {'host ms':>7}")
        for r in result["decode"]:
            if "parts" in r:
                p = r["parts"]
                print(f"{r['batch']:>5} {r['context']:>5} | {p['products_s'] * 1e3:11.2f} "
                      f"{p['products_floor_s'] * 1e3:9.2f} | {p['attention_s'] * 1e3:12.2f} "
                      f"{p['attention_gb_s']:7.1f} | {p['other_s'] * 1e3:8.2f} | "
                      f"{p['host_s'] * 1e3:7.2f}")
    print(f"{'tokens':>6} | {'prefill ms':>10} {'GFLOP/s':>8} {'of peak':>7} | "
          f"{'vLLM ms':>8} {'x vLLM':>6}")
    for r in result["prefill"]:
        peer = (f"{r['vllm_seconds'] * 1e3:8.1f} {r['x_vllm']:6.2f}" if "vllm_seconds" in r
                else f"{'-':>8} {'-':>6}")
        print(f"{r['tokens']:>6} | {r['seconds'] * 1e3:10.1f} {r['gflops_per_s']:8.1f} "
              f"{100 * r['fraction_of_peak']:6.0f}% | {peer}")
    if "paths_step_s" in result:
        points = list(result["default_vs_best_path"])
        print(f"\ndecode step ms per CPU path (default: {result['default_path']}, "
              f"{result['default_path_source']})")
        print(f"{'path':<36} " + " ".join(f"{point:>9}" for point in points))
        for label, steps in result["paths_step_s"].items():
            print(f"{label:<36} " + " ".join(f"{steps[p] * 1e3:9.2f}" for p in points))
        print(f"{'default / best':<36} " + " ".join(
            f"{result['default_vs_best_path'][p]:9.2f}" for p in points))


def plot(result: dict[str, Any], path: Path) -> Path:
    from pdserve.benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = [f"b{r['batch']}\nc{r['context']}" for r in result["decode"]]
    xs = range(len(labels))
    left.bar([x - 0.27 for x in xs], [r["floor_s"] * 1e3 for r in result["decode"]], 0.27,
             label="floor (bytes / bandwidth, or FLOPs / peak)", color="lightgrey")
    if all("parts" in r for r in result["decode"]):  # pdserve's bar split into its parts
        bottom = [0.0] * len(labels)
        for key, name in (("products_s", "pdserve: products"), ("attention_s", "attention"),
                          ("other_s", "norms, rotary, SiLU"), ("host_s", "host (Python)")):
            heights = [r["parts"][key] * 1e3 for r in result["decode"]]
            left.bar(list(xs), heights, 0.27, bottom=bottom, label=name)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    else:
        left.bar(list(xs), [r["step_s"] * 1e3 for r in result["decode"]], 0.27,
                 label="pdserve")
    if any("vllm_step_s" in r for r in result["decode"]):
        left.bar([x + 0.27 for x in xs], [r.get("vllm_step_s", 0) * 1e3
                                          for r in result["decode"]], 0.27, label="vLLM")
    left.set_xticks(list(xs), labels)
    left.set_ylabel("decode step (ms)")
    left.set_title("decode step against its floor")
    left.legend()
    tokens = [r["tokens"] for r in result["prefill"]]
    right.plot(tokens, [r["gflops_per_s"] for r in result["prefill"]], marker="o",
               label="pdserve")
    if any("vllm_seconds" in r for r in result["prefill"]):
        right.plot(tokens, [r["flops"] / r["vllm_seconds"] / 1e9 for r in result["prefill"]
                            if "vllm_seconds" in r], marker="s", label="vLLM")
    right.axhline(result["matmul_peak_gflops"], color="grey", linestyle="--",
                  label="fp32 matmul peak")
    right.set_xscale("log", base=2)
    right.set_xlabel("prompt tokens (fresh)")
    right.set_ylabel("GFLOP/s")
    right.set_title("prefill against the matmul peak")
    right.legend()
    return save_figure(fig, plt, path, dpi=120)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else mid_model_dir()
    facts = model_facts(model_dir)
    bandwidth, peak = read_bandwidth_bytes_per_s(), matmul_peak_flops()
    print(f"measured on {args.threads} threads: read {bandwidth / 1e9:.1f} GB/s over 512 MiB, "
          f"matmul {peak / 1e9:.0f} GFLOP/s", flush=True)
    runs = {"pdserve": measure_pdserve(model_dir, args, facts)}
    if args.with_vllm:
        peer = measure_vllm(model_dir, args, facts["vocab"])
        if peer is not None:
            runs["vllm"] = peer
    from pdserve.serve.executor.cpu_tuning import cache_sizes, machine_facts

    machine = machine_facts()
    result = {"machine": {"cpu_model": machine["cpu_model"], "cpu_flags": machine["cpu_flags"],
                          "caches": cache_sizes(), "cores": machine["cores"]},
              "model": {**facts, "dir": str(model_dir)}, "threads": args.threads,
              "async_scheduling": args.async_scheduling,
              "read_bandwidth_gb_s": bandwidth / 1e9, "matmul_peak_gflops": peak / 1e9,
              **analyse(facts, peak, runs),
              **{key: value for key, value in runs["pdserve"].items()
                 if key.startswith(("paths_", "default_"))}}
    print_table(result)
    output = output_path(args, "step_roofline", "step_roofline.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(result, output.with_suffix(".png")))
    output.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
