"""One rank's part of every step: its model shard and KV pool, the step's forward and logits,
its share of KV block reads and writes, and the MTP drafter's pass. Rank 0 runs it inside the
engine's process (pdserve/serve/executor/model_runner.py), every other rank in a process of its own
(pdserve/serve/executor/rank_worker.py); every rank runs the same steps in the same order.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve.kvstore.memory_tier import fp8_as_bytes
from pdserve.protocol.tp import ReadKV, SeqChunk, StepInput, WriteKV
from pdserve.serve.config import MAX_SPECULATIVE_TOKENS, CacheConfig, SchedulerConfig
from pdserve.serve.executor.context_parallel import (
    CPGroup,
    read_owned_blocks,
    run_context_parallel_step,
    write_owned_blocks,
)
from pdserve.serve.executor.cuda_graphs import DecodeGraphs, eager_reason
from pdserve.serve.executor.kv_cache import KVCachePlan, KVCachePool
from pdserve.serve.executor.loader import ModelSpec, load_model
from pdserve.serve.executor.logit_rows import logit_rows, samples_every_row
from pdserve.serve.executor.pool_sizing import free_device_memory, plan_pool
from pdserve.serve.layers import ops
from pdserve.serve.layers.attention import build_attention_metadata, default_backend_name
from pdserve.serve.layers.distributed import Rendezvous, TPGroup
from pdserve.serve.layers.parallel import kv_heads_per_rank
from pdserve.serve.layers.pipeline import (
    PipelineStage,
    PipelineTimes,
    PPGroup,
    pad_layers,
    run_pipelined_step,
)
from pdserve.serve.layers.uploads import to_device
from pdserve.serve.models.base import ModelOutput

logger = logging.getLogger(__name__)

LOGITS_ROWS_PER_CALL = 256
"""Most rows of logits computed at once when a step asks for more than one per chunk (prompt
logprobs): bounds that step's extra activation memory to this many rows x vocab."""


def step_token_ids(step: StepInput) -> torch.Tensor:
    """The step's token ids in chunk order, int64 [num_tokens] on the host."""
    token_ids = np.fromiter(  # chain iterates in C: no Python work per token
        itertools.chain.from_iterable(c.token_ids for c in step.chunks), dtype=np.int64,
        count=step.num_tokens,
    )
    return torch.from_numpy(token_ids)


class Rank:
    """One rank's model and KV pool, and the step it runs (identical on every rank)."""

    cp: CPGroup = CPGroup()  # context parallelism: set by setup_rank

    def __init__(self, spec: ModelSpec, block_size: int, tp: TPGroup,
                 device: torch.device, pp: PPGroup | None = None) -> None:
        """Load this rank's shard (its pipeline stage's layers); the pool comes after every
        rank loaded (allocate_pool)."""
        self.tp = tp
        self.pp = pp or PPGroup(PipelineStage(0, 1, spec.num_layers, spec.tie_word_embeddings))
        self.pipeline_times = PipelineTimes()
        self.rendezvous: Rendezvous | None = None  # set by setup_rank once the group is up
        self.device = device
        self.block_size = block_size
        self.spec = spec
        self.free_before_load = free_device_memory(device)
        ops.use_device(device.type)  # a CUDA rank never builds the CPU kernels
        self.model = load_model(spec, tp, device, default_backend_name(device),
                                show_progress=tp.rank == 0, stage=self.pp.stage)
        self.num_local_layers = len(self.pp.stage.layers)  # the KV pool holds these
        self.num_mtp_layers = 0  # 1 once add_mtp built the drafter (speculative decoding)
        self.layout = spec.kv_layout(block_size)
        # An MLA latent is replicated; GQA heads split (or replicate past num_kv_heads ranks).
        self.num_kv_heads_per_rank = (spec.num_kv_heads if self.layout.kind == "mla"
                                      else kv_heads_per_rank(spec.num_kv_heads, tp.size))
        self.wants_decode_graphs = False  # plan_decode_graphs, before allocate_pool
        self.decode_graphs: DecodeGraphs | None = None  # capture_decode_graphs, after it

    def add_mtp(self) -> None:
        """Build and load the checkpoint's MTP module (before allocate_pool, which then
        plans one more layer of KV for it)."""
        from pdserve.serve.executor.loader import _default_dtype_and_device, load_mtp_weights

        build = getattr(self.model, "build_mtp", None)
        if build is None:
            raise ValueError(f"{self.spec.architecture} has no multi-token-prediction module:"
                             " MTP speculative decoding needs a DeepSeek-V3 checkpoint")
        with _default_dtype_and_device(self.spec.torch_dtype, self.device):
            build()
        load_mtp_weights(self.model, self.spec.model_dir)
        self.model.mtp.eval()
        self.num_mtp_layers = 1

    @torch.inference_mode()
    def propose(self, chunks: list[Any]) -> list[list[int]]:
        """The MTP pass over spec_decode.DraftChunks after the step that computed
        last_hidden: writes the MTP layer's KV of every row; returns each chunk's greedy
        drafts (its last row's argmax, then the MTP chained on its own output)."""
        mtp, embed = self.model.mtp, self.model.model.embed_tokens
        rotary = self.model.model.rotary_emb
        rows = torch.cat([torch.arange(c.hidden_start, c.hidden_start + len(c.token_ids))
                          for c in chunks]).to(self.device)
        previous = self.last_hidden.index_select(0, rows)  # [T', hidden]
        # Rows of a sequence that verified drafts are as few: marked so, the attention
        # takes them as decode rows (pdserve/serve/layers/attention.py); a prompt chunk's go to
        # prefill.
        short = all(len(c.token_ids) <= 1 + MAX_SPECULATIVE_TOKENS for c in chunks)
        step = StepInput([SeqChunk(c.request_id, c.token_ids, c.start_pos, c.block_table,
                                   c.num_drafts > 0,
                                   num_draft_tokens=len(c.token_ids) - 1 if short else 0)
                          for c in chunks])
        drafting = [i for i, c in enumerate(chunks) if c.num_drafts > 0]
        drafts: list[list[int]] = [[] for _ in chunks]
        positions = [chunks[i].start_pos + len(chunks[i].token_ids) - 1 for i in drafting]
        last = previous  # the MTP's output rows of the sequences drafting, set below
        for j in range(max((chunks[i].num_drafts for i in drafting), default=1)):
            if j > 0:  # chained: one row per sequence still drafting, one position on
                keep = [n for n, i in enumerate(drafting) if chunks[i].num_drafts > j]
                if not keep:
                    break
                drafting = [drafting[n] for n in keep]
                positions = [positions[n] + 1 for n in keep]
                previous = last.index_select(0, torch.tensor(keep, device=self.device))
                step = StepInput([SeqChunk(chunks[i].request_id, [drafts[i][-1]], pos,
                                           chunks[i].block_table, True)
                                  for i, pos in zip(drafting, positions, strict=True)])
            meta = build_attention_metadata(step, self.block_size, self.device)
            input_ids = torch.tensor([t for c in step.chunks for t in c.token_ids],
                                     dtype=torch.int64, device=self.device)
            hidden = mtp.propose(embed(input_ids), previous, self.mtp_kv_cache, meta,
                                 rotary.cos_sin(meta.positions, previous.dtype))
            if not drafting:
                break  # a pass that only writes the MTP layer's KV
            ends = meta.cu_seqlens_q[1:].long() - 1
            if j == 0:
                ends = ends[torch.tensor(drafting, device=self.device)]
            last = hidden.index_select(0, ends)  # [drafting, hidden]
            tokens = mtp.compute_logits(last).argmax(dim=-1).tolist()
            for i, token in zip(drafting, tokens, strict=True):
                drafts[i].append(int(token))
        return drafts

    def plan_decode_graphs(self, enforce_eager: bool, is_one_rank: bool) -> None:
        """Decide whether decode steps will replay CUDA graphs
        (pdserve/serve/executor/cuda_graphs.py), before allocate_pool, whose memory profile then
        leaves their pool room. Only a worker of one rank: a TP or PP rank's graph would need its
        collectives captured (not built)."""
        reason = eager_reason(self.model, self.device, default_backend_name(self.device),
                              enforce_eager, is_one_rank, self.num_mtp_layers > 0)
        self.wants_decode_graphs = reason is None
        if reason is not None and self.device.type == "cuda":
            logger.info("decode steps run eagerly, without CUDA graphs: %s", reason)

    def capture_decode_graphs(self, max_num_seqs: int) -> None:
        """After allocate_pool: the decode graphs over this rank's pool, where planned."""
        if not self.wants_decode_graphs:
            return
        graphs = DecodeGraphs(self.model, max_num_seqs, self.spec.max_model_len,
                              self.block_size, self.device)
        if graphs.capture(self.pool.kv_caches):
            self.decode_graphs = graphs

    def allocate_pool(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                      min_over_ranks: Callable[[int], int] = lambda n: n) -> None:
        """Plan the pool (pdserve/serve/executor/pool_sizing.py: collectives, call on every rank
        together) and allocate it."""
        plan = plan_pool(self, cache_config, scheduler_config, min_over_ranks)
        self.plan: KVCachePlan = plan
        self.num_blocks = plan.num_blocks
        # The served context is what the pool holds: a longer request could never run.
        self.spec = dataclasses.replace(self.spec, max_model_len=plan.max_model_len)
        self.pool = self.new_pool(self.num_blocks)
        if self.num_mtp_layers:  # the MTP layer's own cache, same block ids (spec_decode.py)
            self.mtp_kv_cache: torch.Tensor = self._new_pool_of(
                1, self.num_blocks).kv_caches[0].zero_()

    def new_pool(self, num_blocks: int) -> KVCachePool:
        return self._new_pool_of(self.num_local_layers, num_blocks)

    def _new_pool_of(self, num_layers: int, num_blocks: int) -> KVCachePool:
        spec = self.spec
        return KVCachePool(num_layers, num_blocks, self.block_size,
                           self.num_kv_heads_per_rank, spec.head_dim, spec.kv_torch_dtype,
                           self.device, self.layout.num_planes)

    @torch.inference_mode()
    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.forward(step, self.pool.kv_caches, layer_done, input_ids)

    def forward(self, step: StepInput, kv_caches: list[torch.Tensor],
                layer_done: Callable[[int], None] | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's logit rows (None off the logits rank) over these caches. input_ids: the
        step's token ids already on the device (one rank only; default: the chunks'). A decode step
        over the pool the decode graphs were captured on replays one (one-rank workers)."""
        if self.cp.size > 1:  # this rank's share of the tokens, attention round the ring
            return run_context_parallel_step(self.model, step, kv_caches, self.block_size,
                                             self.cp, self.device,
                                             default_backend_name(self.device), logit_rows(step))
        if self.pp.size > 1:  # this stage's layers over the step's micro-batches
            spec = self.spec
            return run_pipelined_step(self, step, kv_caches, spec.hidden_size,
                                      spec.torch_dtype, len(logit_rows(step)), spec.vocab_size,
                                      self.pipeline_times)
        graphs = self.decode_graphs  # only over the pool they were captured on
        if (graphs is not None and kv_caches is graphs.kv_caches
                and graphs.can_run(step, layer_done)):
            return graphs.run(step, input_ids)
        out = self.run_model(step, kv_caches, layer_done, input_ids=input_ids)  # [T, hidden]
        if self.num_mtp_layers:
            self.last_hidden = out.hidden  # the MTP pass after sampling reads its rows
        if out.logits is not None and samples_every_row(step):  # the fused loop's, every row
            return out.logits
        return self.compute_logits(out.hidden, step)

    def run_model(self, step: StepInput, kv_caches: list[torch.Tensor],
                  layer_done: Callable[[int], None] | None = None,
                  carried: tuple[torch.Tensor, torch.Tensor] | None = None,
                  input_ids: torch.Tensor | None = None) -> ModelOutput:
        """The model over one step (or micro-batch): the final hidden states [T, hidden]
        (with their logits where the fused decode loop made them), or on a pipeline stage
        before the last, (hidden, residual) for the next stage."""
        meta = build_attention_metadata(step, self.block_size, self.device)
        if input_ids is None:
            input_ids = to_device(step_token_ids(step), self.device)
        return self.model(input_ids, kv_caches, meta, layer_done, carried)

    def compute_logits(self, hidden: torch.Tensor, step: StepInput) -> torch.Tensor | None:
        """The step's logit rows from its final hidden states (None off the logits rank)."""
        if samples_every_row(step):  # a decode step: every row, in order
            return self.model.compute_logits(hidden)
        # The last row of each chunk that samples, then the rows of prompt logprobs
        logits_rows = to_device(torch.from_numpy(logit_rows(step)), self.device)
        if logits_rows.numel() == 0:
            return None
        # A step without prompt logprobs has at most a row per chunk: one call. Prompt rows
        # (a whole chunk's) would be [rows, vocab] that no memory profile counted: in slices,
        # each to the host before the next (every rank slices alike: lm_head is collective)
        per_call = max(LOGITS_ROWS_PER_CALL, len(step.chunks))
        if logits_rows.numel() <= per_call:
            return self.model.compute_logits(hidden.index_select(0, logits_rows))
        parts = []
        for rows in logits_rows.split(per_call):
            part = self.model.compute_logits(hidden.index_select(0, rows))
            parts.append(None if part is None else part.float().cpu())
        return None if parts[0] is None else torch.cat(parts)

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's heads of the blocks, for its stage's layers:
        [stage layers, P, n, block_size, local heads, dim]. Under CP: the blocks this rank
        owns, zeros for the others (every rank's summed is the whole)."""
        if self.cp.size > 1:
            return read_owned_blocks(self.pool, block_ids, self.cp)
        return torch.stack(self.pool.read_blocks(block_ids))

    def read_kv_for_gather(self, block_ids: list[int]) -> torch.Tensor:
        """read_kv on the host, padded to the largest stage's layer count (one gather shape
        on every rank; pdserve/serve/layers/pipeline.py assemble_kv_blocks drops the padding)."""
        local = self.read_kv(block_ids).cpu()
        if self.pp.size == 1:
            return local
        return pad_layers(local, max(len(r) for r in self.pp.layer_ranges()))

    def write_kv(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write this rank's layers and head slice of whole-model, whole-head blocks
        [layers, P, n, bs, heads, dim]. Under CP: the blocks this rank owns."""
        if self.cp.size > 1:
            write_owned_blocks(self.pool, block_ids, full, self.cp)
            return
        layers = self.pp.stage.layers
        mine = full[layers.start:layers.stop, :, :, :,
                    self.layout.rank_heads(self.tp.rank, self.tp.size)]
        self.pool.write_blocks(block_ids, list(mine.unbind(0)))

    def write_kv_layer(self, layer: int, block_ids: list[int], blocks: torch.Tensor) -> None:
        """write_kv of one layer, [P, n, bs, heads, dim] (no pipeline or context split)."""
        heads = self.layout.rank_heads(self.tp.rank, self.tp.size)
        self.pool.write_layer_blocks(layer, block_ids, blocks[:, :, :, heads])

    def serve_kv_command(self, command: ReadKV | WriteKV, control: Any) -> None:
        """A non-zero rank's part of ModelRunner.read_kv_blocks / write_kv_blocks."""
        if isinstance(command, ReadKV):
            dist.gather(fp8_as_bytes(self.read_kv_for_gather(command.block_ids)), None, dst=0,
                        group=control)
        else:
            spec, layout = self.spec, self.layout
            num_layers = spec.num_layers if command.layer < 0 else 1
            full = torch.empty(num_layers, layout.num_planes, len(command.block_ids),
                               self.block_size, spec.num_kv_heads, spec.head_dim,
                               dtype=spec.kv_torch_dtype)
            dist.broadcast(fp8_as_bytes(full), src=0, group=control)
            if command.layer < 0:
                self.write_kv(command.block_ids, full.to(self.device))
            else:
                self.write_kv_layer(command.layer, command.block_ids, full[0].to(self.device))

    def validate(self, step: StepInput) -> None:
        """Reject a step rank 0 cannot run before any rank starts it (no half-done steps)."""
        max_slot = self.num_blocks
        for c in step.chunks:
            if not c.token_ids:
                raise ValueError(f"request {c.request_id}: empty chunk")
            if c.start_pos < 0 or c.start_pos + len(c.token_ids) > self.spec.max_model_len:
                raise ValueError(f"request {c.request_id}: positions up to "
                                 f"{c.start_pos + len(c.token_ids)} exceed max_model_len="
                                 f"{self.spec.max_model_len}")
            if min(c.token_ids) < 0 or max(c.token_ids) >= self.spec.vocab_size:
                raise ValueError(f"request {c.request_id}: token id out of vocabulary")
            needed = -(-(c.start_pos + len(c.token_ids)) // self.block_size)
            if len(c.block_table) < needed:
                raise ValueError(f"request {c.request_id}: block_table has "
                                 f"{len(c.block_table)} blocks, positions need {needed}")
            if min(c.block_table) < 0 or max(c.block_table) >= max_slot:
                raise ValueError(f"request {c.request_id}: block id out of [0, {max_slot})")
