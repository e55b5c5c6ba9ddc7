"""Attention kernel micro-benchmarks against the hardware's measured ceilings.

    python -m benchmarks.kernels.bench_attention --output bench_attention.json

Measured first, in the same run: the bf16 matmul peak (TFLOP/s, an 8192^3 torch.matmul)
and the device copy bandwidth (GB/s, read + write of a 2 GiB torch copy_). Then:

- prefill: the Triton paged kernel (head_dim 128, 32 query / 8 KV heads, block size 16) on
  causal sequences of 1k-16k tokens, 16k tokens per batch, against torch SDPA's flash backend
  on the same data laid out contiguously. FLOPs counted as causal: 2 * 2 * S^2/2 * H * D.
- decode: bytes of K/V read per step over the paged cache (the kernel's floor), GB/s,
  against SDPA on contiguous K/V and the copy bandwidth. Decode timings replay a CUDA graph
  (device time; the eager time with Python launch overhead is reported beside it).
- MLA decode: DeepSeek-V3 absorbed shapes (R 512, P 64, block size 64), GB/s of latent rows
  read, against batched torch matmuls on a contiguous latent cache.
- MLA prefill: DeepSeek-V3 at 16 and 128 heads, Triton's absorbed form against the torch
  backend's expanded one (K/V up-projected from the latent, then SDPA), milliseconds; a
  failure is recorded in the row, not raised (this path has never run on a GPU).

Every measured configuration is also checked against pdserve/kernels/reference.py (max |error|
is in the JSON). Seeds are fixed; each timing warms up, then takes the median of several
repetitions of back-to-back launches. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from pdserve.benchmarks.output import add_output_dir, output_path

DEVICE = "cuda"
REFERENCE_MAX_SEQ_LEN = 4096  # the reference's fp32 masked SDPA grows as seq_len^2 beyond this


def _randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 normal samples made on the device (CPU generation of GiBs would dominate)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    device_gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=device_gen, device=DEVICE, dtype=torch.bfloat16)


def time_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = 7, calls: int = 5) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back launches (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def graph_time_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Device time per call with launch overhead removed: `calls` calls captured in one CUDA
    graph, replayed. Decode steps take tens of microseconds, less than the Python wrapper's
    launch cost, so eager timing would measure the host. Falls back to eager timing when the
    function cannot be captured (the result then includes launch overhead)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return time_ms(fn)
    return time_ms(graph.replay, warmup=2, calls=1) / calls


def measure_peaks() -> dict[str, float]:
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    matmul_ms = time_ms(lambda: a @ b)
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    return {"bf16_matmul_tflops": 2 * n**3 / matmul_ms / 1e9,
            "copy_gbps": 2 * src.numel() / copy_ms / 1e6}


def _paged_cache(contexts: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random paged cache holding `contexts` -> (kv_cache, block_tables) on the GPU.
    Blocks are shuffled so no sequence is contiguous in memory."""
    blocks = [math.ceil(n / block_size) for n in contexts]
    perm = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[used:used + n]
        used += n
    kv_cache = _randn(2, sum(blocks), block_size, num_kv_heads, head_dim, gen=gen).to(dtype)
    return kv_cache, tables.to(DEVICE)


def _gather_dense(kv_cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[batch, 2, Hkv, seq_len, D]: a contiguous copy of equal-length paged sequences."""
    rows = kv_cache[:, tables.long()]  # [2, batch, blocks, bs, Hkv, D]
    rows = rows.reshape(2, tables.shape[0], -1, *kv_cache.shape[3:])[:, :, :seq_len]
    return rows.permute(1, 0, 3, 2, 4).contiguous()


TOTAL_PREFILL_TOKENS = 16384  # per prefill batch: 16 x 1k ... 1 x 16k
PREFILL_HEADS = (32, 8, 128, 16)  # query heads, KV heads, head_dim, block size (Llama-3-8B)


def prefill_row(seq_len: int, batch: int, gen: torch.Generator, peak_tflops: float,
                 tiles: list[Any]) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pdserve.kernels import get_attention_backend
    from pdserve.kernels import reference as ref

    triton_backend = get_attention_backend("triton")
    num_heads, num_kv_heads, head_dim, block_size = PREFILL_HEADS
    scale = head_dim ** -0.5
    kv_cache, tables = _paged_cache([seq_len] * batch, num_kv_heads, head_dim, block_size,
                                    torch.bfloat16, gen)
    query = _randn(batch * seq_len, num_heads, head_dim, gen=gen)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * seq_len
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    args = (query, kv_cache, cu, lens, tables, scale, seq_len)
    flops = 4 * batch * num_heads * head_dim * seq_len * seq_len / 2
    row: dict[str, Any] = {"seq_len": seq_len, "batch": batch, "num_heads": num_heads,
                           "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                           "block_size": block_size}
    out = triton_backend.prefill_attention(*args)
    if seq_len <= REFERENCE_MAX_SEQ_LEN:
        row["max_abs_error_vs_reference"] = (
            out - ref.prefill_attention(*args)).abs().max().item()
    triton_ms = time_ms(lambda: triton_backend.prefill_attention(*args))
    row["triton_ms"] = triton_ms
    row["triton_tflops"] = flops / triton_ms / 1e9
    row["triton_fraction_of_peak"] = row["triton_tflops"] / peak_tflops
    dense = _gather_dense(kv_cache, tables, seq_len)  # [b, 2, Hkv, L, D]
    q_dense = query.view(batch, seq_len, num_heads, head_dim).transpose(1, 2).contiguous()

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_dense, dense[:, 0], dense[:, 1], is_causal=True, scale=scale, enable_gqa=True)

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_ms = time_ms(sdpa)
        row["sdpa_flash_ms"] = sdpa_ms
        row["sdpa_flash_tflops"] = flops / sdpa_ms / 1e9
        row["triton_speed_vs_sdpa"] = sdpa_ms / triton_ms
    except RuntimeError as error:  # flash backend unavailable for this build/shape
        row["sdpa_flash_error"] = str(error)[:300]
    for tile in tiles:
        key = f"tiles_{tile.block_m}x{tile.block_n}_w{tile.num_warps}_s{tile.num_stages}"
        try:
            tile_ms = time_ms(lambda t=tile: triton_backend.prefill_attention(*args, tiles=t))
            row[key + "_tflops"] = flops / tile_ms / 1e9
        except Exception as error:  # out of shared memory or registers: record, go on
            row[key + "_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return row


def decode_row(batch: int, context: int, gen: torch.Generator, copy_gbps: float) -> dict:
    from pdserve.kernels import get_attention_backend
    from pdserve.kernels import reference as ref

    triton_backend = get_attention_backend("triton")
    num_heads, num_kv_heads, head_dim, block_size = PREFILL_HEADS
    scale = head_dim ** -0.5
    kv_cache, tables = _paged_cache([context] * batch, num_kv_heads, head_dim, block_size,
                                    torch.bfloat16, gen)
    query = _randn(batch, num_heads, head_dim, gen=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    args = (query, kv_cache, lens, tables, scale)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
    row: dict[str, Any] = {"batch": batch, "context": context, "num_heads": num_heads,
                           "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                           "kv_bytes": kv_bytes}
    out = triton_backend.decode_attention(*args)
    if batch <= 64:  # the reference loops per sequence; skip it for the biggest batches
        row["max_abs_error_vs_reference"] = (
            out - ref.decode_attention(*args)).abs().max().item()
    triton_ms = graph_time_ms(lambda: triton_backend.decode_attention(*args))
    row["triton_us"] = triton_ms * 1e3
    row["triton_eager_us"] = time_ms(lambda: triton_backend.decode_attention(*args)) * 1e3
    row["triton_gbps"] = kv_bytes / triton_ms / 1e6
    row["triton_fraction_of_copy_bandwidth"] = row["triton_gbps"] / copy_gbps
    dense = _gather_dense(kv_cache, tables, context)
    del kv_cache  # the dense copy doubles memory; the paged one is no longer needed
    sdpa_ms = graph_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None, :], dense[:, 0], dense[:, 1], scale=scale, enable_gqa=True))
    row["sdpa_dense_gbps"] = kv_bytes / sdpa_ms / 1e6
    return row


def mla_row(num_heads: int, batch: int, context: int, gen: torch.Generator,
             copy_gbps: float) -> dict:
    from pdserve.kernels import get_attention_backend
    from pdserve.kernels import reference as ref

    triton_backend = get_attention_backend("triton")
    rank, rope_dim, block_size = 512, 64, 64  # DeepSeek-V3
    scale = (128 + rope_dim) ** -0.5
    num_blocks = batch * math.ceil(context / block_size)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, -1).to(torch.int32)
    tables = tables.to(DEVICE)
    cache = _randn(num_blocks, block_size, rank + rope_dim, gen=gen)
    q_latent = _randn(batch, num_heads, rank, gen=gen)
    q_rope = _randn(batch, num_heads, rope_dim, gen=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    args = (q_latent, q_rope, cache, lens, tables, scale)
    latent_bytes = batch * context * (rank + rope_dim) * 2
    row: dict[str, Any] = {"num_heads": num_heads, "batch": batch, "context": context,
                           "kv_lora_rank": rank, "rope_dim": rope_dim,
                           "latent_bytes": latent_bytes}
    out = triton_backend.mla_decode_attention(*args)
    if batch <= 64:
        row["max_abs_error_vs_reference"] = (
            out - ref.mla_decode_attention(*args)).abs().max().item()
    triton_ms = graph_time_ms(lambda: triton_backend.mla_decode_attention(*args))
    row["triton_us"] = triton_ms * 1e3
    row["triton_eager_us"] = time_ms(lambda: triton_backend.mla_decode_attention(*args)) * 1e3
    row["triton_gbps"] = latent_bytes / triton_ms / 1e6
    row["triton_fraction_of_copy_bandwidth"] = row["triton_gbps"] / copy_gbps
    dense = cache[tables.long()].reshape(batch, -1, rank + rope_dim)[:, :context]
    q_full = torch.cat([q_latent, q_rope], dim=-1)  # [b, H, R + P]

    def torch_mla() -> torch.Tensor:
        scores = torch.bmm(q_full, dense.transpose(1, 2)).float() * scale  # [b, H, L]
        return torch.bmm(torch.softmax(scores, -1).to(dense.dtype), dense[:, :, :rank])

    torch_ms = graph_time_ms(torch_mla)
    row["torch_dense_gbps"] = latent_bytes / torch_ms / 1e6
    return row


def mla_prefill_row(num_heads: int, seq_len: int, batch: int, gen: torch.Generator) -> dict:
    """DeepSeek-V3's MLA prefill: Triton's absorbed form (576-wide latent as K and V through
    the paged prefill kernel) against the torch backend's expanded form (per-head K/V
    up-projected from the latent, then SDPA), both from the same paged latent cache."""
    from pdserve.kernels import get_attention_backend
    from pdserve.kernels import reference as ref

    nope, v_dim, rank, rope_dim, block_size = 128, 128, 512, 64, 64
    scale = (nope + rope_dim) ** -0.5
    num_blocks = batch * math.ceil(seq_len / block_size)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, -1).to(torch.int32)
    cache = _randn(num_blocks, block_size, rank + rope_dim, gen=gen)
    q_nope = _randn(batch * seq_len, num_heads, nope, gen=gen)
    q_rope = _randn(batch * seq_len, num_heads, rope_dim, gen=gen)
    w_uk = _randn(num_heads, nope, rank, gen=gen) * rank ** -0.5
    w_uv = _randn(num_heads, v_dim, rank, gen=gen) * rank ** -0.5
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * seq_len
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    args = (q_nope, q_rope, cache, w_uk, w_uv, cu, lens, tables.to(DEVICE), scale, seq_len)
    # causal attention FLOPs of each form (QK^T and PV over half the square)
    pairs = batch * num_heads * seq_len * seq_len / 2
    row: dict[str, Any] = {"num_heads": num_heads, "seq_len": seq_len, "batch": batch,
                           "absorbed_attention_tflop": pairs * 2 * (2 * rank + rope_dim) / 1e12,
                           "expanded_attention_tflop": pairs * 2 * (nope + rope_dim + v_dim)
                           / 1e12}
    try:
        triton_backend = get_attention_backend("triton")
        out = triton_backend.mla_prefill_attention(*args)
        expected = ref.mla_prefill_attention(*args)
        row["max_abs_error_vs_reference"] = (out - expected).abs().max().item()
        row["triton_absorbed_ms"] = time_ms(lambda: triton_backend.mla_prefill_attention(*args))
        row["torch_expanded_ms"] = time_ms(lambda: ref.mla_prefill_attention(*args))
        row["triton_speed_vs_torch_expanded"] = (row["torch_expanded_ms"]
                                                 / row["triton_absorbed_ms"])
    except Exception as error:  # never measured on a GPU before: record, go on
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=None,
                        help="the JSON file (default: bench_attention.json in --output-dir)")
    add_output_dir(parser, "bench_attention")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    parser.add_argument("--sweep-tiles", action="store_true",
                        help="also time other prefill tile shapes (to retune defaults)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (none found); nothing measured.")
        return 0
    import triton

    from pdserve.kernels.prefill_attention import PrefillTiles

    output = output_path(args, "bench_attention", "bench_attention.json", args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    peaks = measure_peaks()
    print(json.dumps(peaks), flush=True)
    seq_lens = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384]
    decode_shapes = ([(1, 32768), (64, 4096)] if args.quick else
                     [(1, 32768), (8, 16384), (64, 4096), (256, 2048), (256, 8192)])
    mla_shapes = ([(16, 1, 32768), (16, 64, 4096)] if args.quick else
                  [(16, 1, 32768), (16, 32, 8192), (16, 128, 4096), (128, 32, 8192)])
    tiles = None
    if args.sweep_tiles:
        tiles = [PrefillTiles(m, n, w, s) for m, n, w, s in
                 [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                  (64, 32, 4, 3)]]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "seed": args.seed,
        "peaks": peaks, "prefill": [], "decode": [], "mla_decode": [], "mla_prefill": [],
        "prefill_tile_sweep": [],
    }
    # Rows are written as they come, so a run cut short by a time limit still reports.
    runs: list[tuple[str, Callable[[], dict]]] = []
    for seq_len in seq_lens:
        batch = max(1, TOTAL_PREFILL_TOKENS // seq_len)
        runs.append(("prefill", lambda s=seq_len, b=batch: prefill_row(
            s, b, gen, peaks["bf16_matmul_tflops"], [])))
    for batch, context in decode_shapes:
        runs.append(("decode", lambda b=batch, c=context: decode_row(
            b, c, gen, peaks["copy_gbps"])))
    for num_heads, batch, context in mla_shapes:
        runs.append(("mla_decode", lambda h=num_heads, b=batch, c=context: mla_row(
            h, b, c, gen, peaks["copy_gbps"])))
    for num_heads, seq_len in [(16, 4096), (128, 1024)]:  # DeepSeek-V3 at TP 8, at TP 1
        runs.append(("mla_prefill", lambda h=num_heads, s=seq_len: mla_prefill_row(
            h, s, 1, gen)))
    for seq_len in [4096, 16384] if tiles else []:  # last: the least needed
        runs.append(("prefill_tile_sweep", lambda s=seq_len: prefill_row(
            s, TOTAL_PREFILL_TOKENS // s, gen, peaks["bf16_matmul_tflops"], tiles)))
    for section, run in runs:
        report[section].append(run())
        print(json.dumps({section: report[section][-1]}), flush=True)
        with open(output, "w") as f:
            json.dump(report, f, indent=2)
        torch.cuda.empty_cache()
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
