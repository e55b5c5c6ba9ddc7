"""CUDA graphs for decode steps, as vLLM captures them: once the KV pool is allocated, a
one-rank CUDA worker records its decode forward (the model, then the LM head on every row) once
per batch-size bucket; a decode step then copies its inputs into static buffers and replays
the smallest bucket's graph that holds it: one launch where eager runs a few hundred.

    buckets       1, 2, 4, 8, 16, 24, ..., max_num_seqs (the last one whatever it is)
    a step of n   rows [0, n): its sequences              rows [n, bucket): padding
    rows, into    token id, position, slot, length,        id 0, position 0, slot -1 (no KV
    the buffers   block table (zeros past its end)         write), length 1, table of zeros
    replay        the bucket's graph over buffers[:bucket] -> logits [bucket, vocab]; [:n] out

A padding row attends to one position of block 0 and writes nothing (every KV-write backend
skips a negative slot); its logits are dropped. Nothing is read back to the host: the inputs go
up from pinned staging buffers without a wait and the logits stay on the device for the
sampler. A block table's width is ceil(max_model_len / block_size) at every bucket, so the
Triton decode kernel, which picks its split count from that width, launches the same grid on
every replay.

Only one-rank workers (TP, PP and CP 1, no MTP drafter) capture: a TP or PP rank's forward
holds collectives that a graph would have to capture with it (left for later), and the MTP
drafter reads the step's hidden states, which the graph does not keep. MoE models stay eager
(the grouped-GEMM routing reads nothing back, but it has not been captured on a GPU yet, and
FP8 or biased experts run the host's expert loop), and so does the torch attention backend
(it reads lengths on the host). --enforce-eager (ModelConfig.enforce_eager) turns graphs off.

On CPU nothing is captured; with PDSERVE_CUDA_GRAPHS_ON_CPU=1 a one-rank CPU worker runs its
decode steps through the same buffers, padding and callable eagerly: how tests prove the
padding and the buffers without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pdserve import envs
from pdserve.protocol.tp import StepInput
from pdserve.serve.executor.logit_rows import samples_every_row
from pdserve.serve.layers.attention import AttentionMetadata, padded_block_tables

logger = logging.getLogger(__name__)

BUCKET_STEP = 8
"""Past 8 rows the buckets grow by this many, so a step pads at most 7 rows (vLLM's spacing)."""


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets captured: 1, 2, 4, then the multiples of 8 up to max_num_seqs, and
    max_num_seqs itself where it is not one of them (the scheduler never batches more)."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += range(BUCKET_STEP, max_num_seqs + 1, BUCKET_STEP)
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def eager_reason(model: nn.Module, device: torch.device, backend_name: str,
                 enforce_eager: bool, is_one_rank: bool, has_drafter: bool) -> str | None:
    """Why this rank's decode steps run eagerly, or None where they replay graphs (on CPU only
    with PDSERVE_CUDA_GRAPHS_ON_CPU=1, and then uncaptured)."""
    from pdserve.serve.models.moe import SparseMoE

    if enforce_eager:
        return "--enforce-eager"
    if device.type == "cpu" and not envs.cuda_graphs_on_cpu():
        return "CPU (no CUDA graphs)"
    if not is_one_rank:
        return ("a worker of several ranks (TP, PP or CP > 1) would need its collectives "
                "captured in the graphs: not built")
    if has_drafter:
        return "MTP speculative decoding reads each step's hidden states"
    if any(isinstance(module, SparseMoE) for module in model.modules()):
        return "MoE layers: not yet captured (FP8 or biased experts loop on the host)"
    if device.type == "cuda" and backend_name != "triton":
        return f"the {backend_name} attention backend reads sequence lengths on the host"
    return None


class DecodeGraphs:
    """Static decode inputs sized for the largest bucket, a graph per bucket (CUDA), and the
    replay of a decode step over them. Built after the KV pool; the graphs are bound to the
    caches they were captured over (`kv_caches`)."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.batch_sizes = decode_batch_sizes(max_num_seqs)
        self.max_batch_size = self.batch_sizes[-1]
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.device = device
        self.kv_caches: list[torch.Tensor] | None = None  # set by capture
        self.num_replays = 0
        self.capture_s = 0.0
        rows, width = self.max_batch_size, self.max_blocks_per_seq
        is_cuda = device.type == "cuda"

        def buffers(shape: tuple[int, ...], dtype: torch.dtype, fill: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            """(the device buffer the graphs read, its pinned host staging twin)."""
            host = torch.full(shape, fill, dtype=dtype, pin_memory=is_cuda)
            return host.to(device, copy=True), host

        # Every row starts as padding, so a forward over the buffers as they are (the warm-up,
        # the memory profile) writes no KV.
        self.input_ids, host_ids = buffers((rows,), torch.int64, 0)
        self.positions, host_positions = buffers((rows,), torch.int64, 0)
        self.slot_mapping, host_slots = buffers((rows,), torch.int64, -1)
        self.seq_lens, host_lens = buffers((rows,), torch.int32, 1)
        self.block_tables, host_tables = buffers((rows, width), torch.int32, 0)  # [rows, width]
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._pairs = [(self.input_ids, host_ids), (self.positions, host_positions),
                       (self.slot_mapping, host_slots), (self.seq_lens, host_lens),
                       (self.block_tables, host_tables)]
        # numpy views of the staging buffers (their memory): a step's rows go in without torch
        self._ids, self._positions, self._slots, self._lens, self._tables = (
            host.numpy() for _, host in self._pairs)
        # Where the last step's copies were queued: its staging rows are not rewritten before
        # they ran (the step's sampled ids coming back make that wait rare).
        self._copied = torch.cuda.Event() if is_cuda else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output [bucket, vocab]
        self._metas = {size: AttentionMetadata(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], max_query_len=1, is_decode_only=True)
            for size in self.batch_sizes}

    @property
    def is_captured(self) -> bool:
        """Replays are CUDA graphs (False: the eager mode over the same buffers, on CPU)."""
        return bool(self._graphs)

    def bucket_for(self, num_rows: int) -> int:
        """The smallest bucket that holds num_rows (at most max_batch_size)."""
        return next(size for size in self.batch_sizes if size >= num_rows)

    def can_run(self, step: StepInput, layer_done: Callable[[int], None] | None) -> bool:
        """A decode step that fits: every chunk one sampled token (no drafts, no prompt
        logprobs), no per-layer callback (a graph runs every layer in one launch), at most
        the largest bucket's rows."""
        return (layer_done is None and len(step.chunks) <= self.max_batch_size
                and samples_every_row(step)
                and not any(c.num_draft_tokens for c in step.chunks))

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> bool:
        """Capture every bucket's graph over these caches (the largest first, all in one
        memory pool, each after an eager warm-up run that compiles its kernels); on CPU only
        bind the caches. False, with one warning line, where capture fails in any way
        (a CUDA error, an op that cannot be captured, a host read inside): decode stays
        eager."""
        self.kv_caches = kv_caches
        if self.device.type != "cuda":
            logger.info("decode steps run eagerly over the graphs' static buffers "
                        "(PDSERVE_CUDA_GRAPHS_ON_CPU), batch sizes %s", self.batch_sizes)
            return True
        start = time.perf_counter()
        try:
            self._capture_buckets()
        except Exception as exc:  # any failure leaves eager decode, which always works
            self._graphs.clear()
            self._logits.clear()
            self.kv_caches = None
            logger.warning("capturing CUDA graphs for decode failed, decode steps run "
                           "eagerly: %s: %s", type(exc).__name__, exc)
            return False
        self.capture_s = time.perf_counter() - start
        logger.info("CUDA graphs captured for decode batch sizes %s in %.2f s",
                    self.batch_sizes, self.capture_s)
        return True

    def _capture_buckets(self) -> None:
        """Every bucket's graph, the largest first, in one memory pool, each after an eager
        warm-up on one side stream made once for all of them."""
        pool = torch.cuda.graph_pool_handle()
        side_stream = torch.cuda.Stream(self.device)
        for size in reversed(self.batch_sizes):
            self._warm_up(size, side_stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(self, step: StepInput, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [n, vocab] of a decode step of n rows (can_run), by replaying its
        bucket's graph: a view of the graph's output, valid until the next replay.
        input_ids: the step's ids already on the device (async scheduling's placeholders
        filled there, pdserve/serve/engine/overlap.py), copied over the staged ones."""
        num_rows = len(step.chunks)
        size = self.bucket_for(num_rows)
        self._stage(step, size)
        if input_ids is not None:  # after the staged copy, on the same stream
            self.input_ids[:num_rows].copy_(input_ids)
        self.num_replays += 1
        if not self._graphs:  # CPU: the captured callable, eagerly, over the same buffers
            return self._forward(size)[:num_rows]
        self._graphs[size].replay()
        return self._logits[size][:num_rows]

    @torch.inference_mode()
    def profile_forward(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The largest bucket's forward, eagerly, over buffers as they start (every row
        padding: reads block 0, writes nothing): what pdserve/serve/executor/pool_sizing.py measures
        to leave the graphs' memory pool room beside the KV pool."""
        return self._forward(self.max_batch_size, kv_caches)

    def _forward(self, size: int, kv_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """What a graph holds: the model over buffers[:size], then the LM head on every row.
        The decoder model is called directly, never the CPU's fused decode loop, which
        derives each row's slot from its table and would write a padding row into block 0."""
        caches = kv_caches if kv_caches is not None else self.kv_caches
        assert caches is not None, "capture() binds the caches first"
        out = self.model.model(self.input_ids[:size], caches, self._metas[size])
        return self.model.compute_logits(out.hidden)

    def _warm_up(self, size: int, stream: torch.cuda.Stream) -> None:
        """One eager run on a side stream before capture (PyTorch's recipe): Triton compiles,
        cuBLAS picks its kernels and the allocator has its blocks before recording starts.
        Every bucket warms up on the same stream: a stream per bucket would leave the
        allocator blocks cached per stream that the next warm-up cannot reuse."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _stage(self, step: StepInput, size: int) -> None:
        """The step's rows, then padding up to `size`, into the staging buffers, and one
        host-to-device copy per buffer (non-blocking from pinned memory on CUDA).

            tables (width W)   row s: its block ids, 0 past them (a table longer than W is
                               cut: its positions stay under max_model_len, so no entry past
                               W is ever read)
            slot               table[pos // block_size] * block_size + pos % block_size
        """
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies left these rows
        chunks, n = step.chunks, len(step.chunks)
        width, bs = self.max_blocks_per_seq, self.block_size
        positions = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=n)
        self._ids[:n] = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n)
        self._positions[:n] = positions
        self._lens[:n] = positions + 1
        tables = self._tables[:size]
        tables.fill(0)
        padded = padded_block_tables(chunks, np.int32)[:, :width]
        tables[:n, :padded.shape[1]] = padded
        self._slots[:n] = (tables[np.arange(n), positions // bs].astype(np.int64) * bs
                           + positions % bs)
        self._ids[n:size] = 0
        self._positions[n:size] = 0
        self._lens[n:size] = 1
        self._slots[n:size] = -1
        for device_buffer, host in self._pairs:
            device_buffer[:size].copy_(host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
