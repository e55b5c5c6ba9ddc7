"""Context parallelism (CP): a step's prompt tokens split over CP ranks, attention as ring
attention (pdserve/kernels/ring_attention.py; the ring itself pdserve/kernels/ring.py), each rank's
KV in its own paged pool.

Where the KV lives. The engine's block manager sees one pool of CP x B blocks; global block
g lives on rank g % CP as that rank's local block g // CP. A fresh free list hands out
0, 1, 2, ..., so a request's blocks stripe over the ranks ("round-robin by block"), and a
prompt can be as long as all ranks' pools together:

    block table   [ 0  1  2  3  4  5 ]      CP 2, block_size 4
    rank 0 holds    0     2     4           local blocks 0 1 2
    rank 1 holds       1     3     5        local blocks 0 1 2

Who computes what. Every rank receives the whole step (the usual StepInput) and works out
the same plan from it:
  - a chunk of several tokens (a prompt, or a piece of one) is split zig-zag (rank r takes
    chunks r and 2 CP - 1 - r of 2 CP): each rank runs the model on its share; attention is
    ring attention, the payload of rank r being the K/V it computed plus the K/V of the
    request's earlier tokens (a chunked prefill's or a prefix hit's) that its pool holds.
    As the payloads pass by, each rank writes the rows whose block it owns into its pool;
  - a chunk of one token (a decode) is computed by every rank (one token: cheap); its K/V
    goes to the block's owner; every rank attends it to the KV shard in its own pool, and the
    partial (out, lse) are all-gathered and merged, so every rank holds the same output.
The logits rows end on rank 0 (rows another rank computed are summed into it).

MLA rings the latent rows [c_kv | k_rope] (R + P numbers per token: DeepSeek-V3 576, against
H (N + P + V) = 40960 expanded), and each rank expands a block when it arrives (k = [c W_UK |
k_rope], v = c W_UV), so the attention runs expanded as Hugging Face and the engine's
prefill compute it, the transfer stays small. Decode attends absorbed over each shard
(q W_UK against the latent rows, one shared key head), merged in latent space, then W_UV.

Limits: CP composes neither with TP nor with PP yet (refused when asked); a step's
per-layer KV callback (layer-wise hand-off) is not offered, the hand-off reads blocks after
the step (read_owned_blocks gathers them from their owners in token order).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdserve.kernels import get_block_attention
from pdserve.kernels.partials import empty_partial, merge_attention, merge_stacked
from pdserve.kernels.reference import padded_rows_attention
from pdserve.kernels.ring import ring_pass
from pdserve.kernels.zigzag import zigzag_ranges
from pdserve.protocol.tp import StepInput
from pdserve.serve.layers.attention import AttentionMetadata
from pdserve.serve.layers.uploads import to_device

DECODE_GROUP_SLOTS = 1 << 16
"""Most K/V rows one batched decode-shard attention gathers (rows x longest shard): bounds
the padded copy a decode step makes of its context shards."""


@dataclass(frozen=True)
class CPGroup:
    """This process's place in the context-parallel group (None group: the world)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size <= 0 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad CP rank {self.rank} of {self.size}")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def owner_of_block(block_id: int | np.ndarray, cp_size: int) -> Any:
    return block_id % cp_size


def local_block_id(block_id: int | np.ndarray, cp_size: int) -> Any:
    return block_id // cp_size


# ---- the KV hand-off: blocks by owner ------------------------------------------------------


def read_owned_blocks(pool: Any, block_ids: list[int], cp: CPGroup) -> torch.Tensor:
    """[layers, P, n, bs, heads, dim] with the blocks this rank owns filled and the others
    zero: summing every rank's tensor gives the blocks whole, in the order asked."""
    ids = np.asarray(block_ids, dtype=np.int64)
    mine = np.nonzero(owner_of_block(ids, cp.size) == cp.rank)[0]
    layers = pool.read_blocks(local_block_id(ids[mine], cp.size).tolist())
    shape = (len(layers), layers[0].shape[0], len(block_ids), *layers[0].shape[2:])
    out = layers[0].new_zeros(shape)
    if len(mine):
        out[:, :, torch.from_numpy(mine).to(out.device)] = torch.stack(layers)
    return out


def assemble_owned_blocks(parts: list[torch.Tensor], block_ids: list[int]
                          ) -> list[torch.Tensor]:
    """Every rank's read_owned_blocks ([layers, P, n, ...] each, in rank order) -> per layer
    [P, n, ...] with each block taken from its owner: the hand-off's token-order blocks."""
    owners = owner_of_block(torch.tensor(block_ids, dtype=torch.int64), len(parts))
    whole = parts[0].clone()
    for rank in range(1, len(parts)):
        mine = owners == rank
        whole[:, :, mine] = parts[rank][:, :, mine]
    return list(whole.unbind(0))


def write_owned_blocks(pool: Any, block_ids: list[int], full: torch.Tensor,
                       cp: CPGroup) -> None:
    """Keep the blocks of full [layers, P, n, bs, heads, dim] that this rank owns."""
    ids = np.asarray(block_ids, dtype=np.int64)
    mine = np.nonzero(owner_of_block(ids, cp.size) == cp.rank)[0]
    if not len(mine):
        return
    picked = full[:, :, torch.from_numpy(mine).to(full.device)]
    pool.write_blocks(local_block_id(ids[mine], cp.size).tolist(), list(picked.unbind(0)))


# ---- one step's plan -----------------------------------------------------------------------


@dataclass
class _Payload:
    """What one rank sends around the ring in a step, as every rank can work it out. Per
    ring chunk (a request's multi-token chunk), the rows it computed, then the request's
    earlier rows its pool holds:

        [ chunk A: new (zig-zag share) | cached | chunk B: new | cached | ... ]

    Lists are per ring chunk; positions covers new and cached rows, the rest new rows only
    (cached_slots the cached ones, in the sender's pool)."""

    positions: list[np.ndarray] = field(default_factory=list)
    cached_slots: list[np.ndarray] = field(default_factory=list)
    new_owners: list[np.ndarray] = field(default_factory=list)  # the rank whose pool keeps it
    new_slots: list[np.ndarray] = field(default_factory=list)  # and its slot there

    @property
    def num_rows(self) -> int:
        return sum(len(p) for p in self.positions)


class ContextParallelStep:
    """One step's CP plan on one rank (the same arithmetic on every rank), used by every
    layer's attention (the Attention modules call gqa_attention / mla_attention when the
    step's metadata carries it)."""

    def __init__(self, step: StepInput, block_size: int, cp: CPGroup, device: torch.device,
                 backend_name: str) -> None:
        self.cp = cp
        self.device = device
        self.attend = get_block_attention(backend_name)
        me, size = cp.rank, cp.size
        lengths = np.array([len(c.token_ids) for c in step.chunks], dtype=np.int64)
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        holder = np.zeros(int(starts[-1]), dtype=np.int64)  # who keeps a token's hidden row
        local_flat: list[np.ndarray] = []
        local_pos: list[np.ndarray] = []
        num_local = 0
        # decode chunks (one token): computed by every rank, attended shard by shard
        self.decode_rows: list[int] = []
        self._decode_write: list[tuple[int, int]] = []  # (local row, slot) of rows I own
        self._decode_shards: list[np.ndarray] = []  # my slots of each decode's context
        # ring chunks: my query rows (local) and their positions, per ring chunk
        self._ring_rows: list[np.ndarray] = []
        self._ring_pos: list[np.ndarray] = []
        self._payloads = [_Payload() for _ in range(size)]
        for s, chunk in enumerate(step.chunks):
            n, first = int(lengths[s]), int(starts[s])
            table = np.asarray(chunk.block_table, dtype=np.int64)
            positions = np.arange(chunk.start_pos, chunk.start_pos + n, dtype=np.int64)
            blocks = table[positions // block_size]
            owners = owner_of_block(blocks, size)
            slots = local_block_id(blocks, size) * block_size + positions % block_size
            if n == 1:  # a decode: every rank computes it
                row = num_local
                local_flat.append(np.array([first]))
                local_pos.append(positions)
                num_local += 1
                self.decode_rows.append(row)
                if owners[0] == me:
                    self._decode_write.append((row, int(slots[0])))
                context = np.arange(chunk.start_pos + 1, dtype=np.int64)
                self._decode_shards.append(_owned_slots(table, context, block_size, size, me))
                continue
            cached = np.arange(chunk.start_pos, dtype=np.int64)
            for rank in range(size):
                index = np.concatenate([np.arange(a, b) for a, b in zigzag_ranges(n, size, rank)])
                payload = self._payloads[rank]
                owned_cached = _owned_positions(table, cached, block_size, size, rank)
                payload.positions.append(np.concatenate([positions[index], owned_cached]))
                payload.cached_slots.append(_slots(table, owned_cached, block_size, size))
                payload.new_owners.append(owners[index])
                payload.new_slots.append(slots[index])
                holder[first + index] = rank
                if rank == me:
                    local_flat.append(first + index)
                    local_pos.append(positions[index])
                    self._ring_rows.append(num_local + np.arange(len(index)))
                    self._ring_pos.append(positions[index])
                    num_local += len(index)
        self.num_local_rows = num_local
        flat = np.concatenate(local_flat) if local_flat else np.zeros(0, dtype=np.int64)
        self.local_flat = flat
        self.positions = np.concatenate(local_pos) if local_pos else np.zeros(0, np.int64)
        self._holder = holder
        self._local_of_flat = np.full(len(holder), -1, dtype=np.int64)
        self._local_of_flat[flat] = np.arange(len(flat))
        self._has_ring = bool(self._ring_rows)

    # ---- GQA / MHA ---------------------------------------------------------------------

    def gqa_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, scale: float, backend: Any) -> torch.Tensor:
        """This rank's rows: query [T, H, D], key/value [T, Hkv, D], kv_cache [2, blocks,
        bs, Hkv, D] (this rank's pool) -> [T, H, D]."""
        num_kv_heads, head_dim = key.shape[1:]
        k_cache = kv_cache[0].reshape(-1, num_kv_heads, head_dim)  # [slots, Hkv, D]
        v_cache = kv_cache[1].reshape(-1, num_kv_heads, head_dim)
        out = torch.zeros(query.shape[0], query.shape[1], value.shape[2],
                          dtype=torch.float32, device=query.device)

        def write(rows_k: torch.Tensor, rows_v: torch.Tensor, slots: np.ndarray) -> None:
            backend.write_kv_cache(rows_k, rows_v, kv_cache, self._tensor(slots))

        if self.decode_rows:
            self._write_decodes(lambda rows, slots: write(key[rows], value[rows], slots))
            rows = self._tensor(self.decode_rows)

            def shard_partial(first: int, slots: torch.Tensor, lengths: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
                q = query[rows[first:first + slots.shape[0]]]
                return padded_rows_attention(q, k_cache[slots], v_cache[slots], lengths, scale)

            out[rows] = self._merged_decode(shard_partial, query.shape[1], value.shape[2])
        if self._has_ring:
            payload = [self._payload_tensor(key, k_cache), self._payload_tensor(value, v_cache)]

            def expand(block: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
                return block[0], block[1]

            self._ring(query, payload, expand,
                       lambda block, rows, slots: write(block[0][rows], block[1][rows], slots),
                       scale, out)
        return out.to(query.dtype)

    # ---- MLA ---------------------------------------------------------------------------

    def mla_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, kv_cache: torch.Tensor,
                      scale: float, backend: Any) -> torch.Tensor:
        """q_nope [T, H, N], q_rope [T, H, P], latent [T, R + P], w_uk [H, N, R],
        w_uv [H, V, R], kv_cache [1, blocks, bs, 1, R + P] -> [T, H, V]."""
        latent_cache = kv_cache[0, :, :, 0]
        flat_cache = latent_cache.reshape(-1, latent.shape[1])  # [slots, R + P]
        rank_dim = w_uk.shape[2]
        num_heads, v_dim = w_uv.shape[0], w_uv.shape[1]
        out = torch.zeros(q_nope.shape[0], num_heads, v_dim, dtype=torch.float32,
                          device=q_nope.device)

        def write(rows_latent: torch.Tensor, slots: np.ndarray) -> None:
            backend.write_latent_cache(rows_latent, latent_cache, self._tensor(slots))

        if self.decode_rows:
            self._write_decodes(lambda rows, slots: write(latent[rows], slots))
            rows = self._tensor(self.decode_rows)
            # absorbed: one key head of latent rows, values the c_kv part
            q_latent = torch.einsum("thn,hnr->thr", q_nope[rows], w_uk)
            q_absorbed = torch.cat([q_latent, q_rope[rows]], dim=-1)  # [Td, H, R + P]

            def shard_partial(first: int, slots: torch.Tensor, lengths: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
                shard = flat_cache[slots][:, :, None, :]  # [n, L, 1, R + P]
                q = q_absorbed[first:first + slots.shape[0]]
                return padded_rows_attention(q, shard, shard[..., :rank_dim], lengths, scale)

            o_latent = self._merged_decode(shard_partial, num_heads, rank_dim)
            out[rows] = torch.einsum("thr,hvr->thv", o_latent, w_uv.float())
        if self._has_ring:
            query = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, N + P]
            payload = [self._payload_tensor(latent, flat_cache)]

            def expand(block: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
                c_kv, k_rope = block[0][:, :rank_dim], block[0][:, rank_dim:]
                k = torch.cat([torch.einsum("nr,hkr->nhk", c_kv, w_uk),
                               k_rope[:, None, :].expand(-1, num_heads, -1)], dim=-1)
                return k, torch.einsum("nr,hvr->nhv", c_kv, w_uv)

            self._ring(query, payload, expand,
                       lambda block, rows, slots: write(block[0][rows], slots), scale, out)
        return out.to(q_nope.dtype)

    # ---- shared pieces -----------------------------------------------------------------

    def _tensor(self, values: Any) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
                         self.device)

    def _write_decodes(self, write: Any) -> None:
        if self._decode_write:
            rows, slots = zip(*self._decode_write, strict=True)
            write(self._tensor(rows), np.asarray(slots))

    def _merged_decode(self, shard_partial: Any, num_heads: int, v_dim: int) -> torch.Tensor:
        """Each decode row against this rank's shard of its context (rows in groups, shards
        padded to the group's longest), all-gathered over the ranks and merged:
        [Td, H, v_dim] fp32, the same on every rank."""
        num_rows = len(self.decode_rows)
        outs = torch.zeros(num_rows, num_heads, v_dim, dtype=torch.float32, device=self.device)
        lses = torch.full((num_rows, num_heads), float("-inf"), dtype=torch.float32,
                          device=self.device)
        for first, slots, lengths in self._decode_groups():
            num = slots.shape[0]
            outs[first:first + num], lses[first:first + num] = shard_partial(first, slots,
                                                                            lengths)
        out, _ = merge_stacked(self.cp.all_gather(outs), self.cp.all_gather(lses))
        return out

    def _decode_groups(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first row, slots [n, L] padded with slot 0, lengths [n]) for groups of decode
        rows whose padded shards stay under DECODE_GROUP_SLOTS gathered rows."""
        groups, first = [], 0
        shards = self._decode_shards
        while first < len(shards):
            end, longest = first, 0
            while end < len(shards):
                longest_next = max(longest, len(shards[end]), 1)
                if end > first and longest_next * (end + 1 - first) > DECODE_GROUP_SLOTS:
                    break
                longest, end = longest_next, end + 1
            slots = np.zeros((end - first, longest), dtype=np.int64)
            for i, shard in enumerate(shards[first:end]):
                slots[i, :len(shard)] = shard
            lengths = [len(shard) for shard in shards[first:end]]
            groups.append((first, self._tensor(slots), self._tensor(lengths)))
            first = end
        return groups

    def _payload_tensor(self, rows: torch.Tensor, cache_rows: torch.Tensor) -> torch.Tensor:
        """This rank's ring payload: per ring chunk its new rows, then its cached rows."""
        mine = self._payloads[self.cp.rank]
        parts = []
        for new_rows, cached_slots in zip(self._ring_rows, mine.cached_slots, strict=True):
            parts.append(rows[self._tensor(new_rows)])
            parts.append(cache_rows[self._tensor(cached_slots)].to(rows.dtype))
        return torch.cat(parts)

    def _ring(self, query: torch.Tensor, payload: list[torch.Tensor], expand: Any,
              write: Any, scale: float, out: torch.Tensor) -> None:
        """Ring attention of this rank's ring rows; writes the rows of passing payloads that
        this rank owns; fills out's ring rows."""
        me, size = self.cp.rank, self.cp.size
        shapes = [[torch.Size((p.num_rows, *t.shape[1:])) for t in payload]
                  for p in self._payloads]
        q_rows = [self._tensor(r) for r in self._ring_rows]
        q_pos = [self._tensor(p) for p in self._ring_pos]
        partials = [empty_partial(query[rows], out.shape[2]) for rows in q_rows]

        def visit(src: int, block: list[torch.Tensor]) -> None:
            sender = self._payloads[src]
            offsets = [0, *itertools.accumulate(len(p) for p in sender.positions)]
            owned_rows, owned_slots = [], []
            for j, new_owners in enumerate(sender.new_owners):
                mine = np.nonzero(new_owners == me)[0]
                owned_rows.append(offsets[j] + mine)
                owned_slots.append(sender.new_slots[j][mine])
            rows = np.concatenate(owned_rows) if owned_rows else np.zeros(0, np.int64)
            if len(rows):
                write(block, self._tensor(rows), np.concatenate(owned_slots))
            k, v = expand(block)
            for j, positions in enumerate(sender.positions):
                if not len(positions) or not len(self._ring_pos[j]):
                    continue
                if positions.min() > self._ring_pos[j].max():
                    continue  # all of it lies in this rank's future: skipped
                lo, hi = offsets[j], offsets[j + 1]
                part = self.attend(query[q_rows[j]], k[lo:hi], v[lo:hi], scale, q_pos[j],
                                   self._tensor(positions))
                partials[j] = merge_attention(*partials[j], *part)

        if size == 1:
            visit(me, payload)
        else:
            ring_pass(payload, visit, self.cp.group, shapes)
        for rows, (part_out, _) in zip(q_rows, partials, strict=True):
            out[rows] = part_out

    # ---- hidden rows for the logits ---------------------------------------------------

    def gather_rows(self, hidden: torch.Tensor, flat_rows: np.ndarray) -> torch.Tensor | None:
        """hidden [local rows, hidden] -> the step's rows flat_rows [len, hidden] on rank 0
        (None elsewhere). Rows another rank keeps are summed in over the group (zeros from
        the rest: exact)."""
        holders = self._holder[flat_rows]
        local = self._local_of_flat[flat_rows]
        if not (holders != 0).any():
            if self.cp.rank != 0:
                return None
            return hidden[self._tensor(local)]
        gathered = hidden.new_zeros(len(flat_rows), hidden.shape[1])
        mine = np.nonzero(holders == self.cp.rank)[0]
        if len(mine):
            gathered[self._tensor(mine)] = hidden[self._tensor(local[mine])]
        self.cp.all_reduce(gathered)
        return gathered if self.cp.rank == 0 else None


def _owned_positions(table: np.ndarray, positions: np.ndarray, block_size: int, size: int,
                     rank: int) -> np.ndarray:
    """The positions whose block lives on `rank`."""
    if not len(positions):
        return positions
    return positions[owner_of_block(table[positions // block_size], size) == rank]


def _slots(table: np.ndarray, positions: np.ndarray, block_size: int, size: int) -> np.ndarray:
    """Local slots (on their owner) of the positions."""
    blocks = table[positions // block_size]
    return local_block_id(blocks, size) * block_size + positions % block_size


def _owned_slots(table: np.ndarray, positions: np.ndarray, block_size: int, size: int,
                 rank: int) -> np.ndarray:
    return _slots(table, _owned_positions(table, positions, block_size, size, rank),
                  block_size, size)


def run_context_parallel_step(model: Any, step: StepInput, kv_caches: list[torch.Tensor],
                              block_size: int, cp: CPGroup, device: torch.device,
                              backend_name: str, logits_rows: np.ndarray
                              ) -> torch.Tensor | None:
    """One step on one CP rank: this rank's tokens through the model (attention over the
    ring), then the logits of logits_rows (flat step rows) on rank 0; None elsewhere."""
    plan = ContextParallelStep(step, block_size, cp, device, backend_name)
    token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in step.chunks),
                            dtype=np.int64, count=step.num_tokens)
    input_ids = to_device(torch.from_numpy(token_ids[plan.local_flat]), device)
    num_rows = plan.num_local_rows
    unused = torch.zeros(1, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        positions=to_device(torch.from_numpy(plan.positions), device),
        slot_mapping=torch.full((num_rows,), -1, dtype=torch.int64, device=device),
        cu_seqlens_q=unused, seq_lens=unused, block_tables=unused.view(1, 1),
        max_query_len=0, is_decode_only=False, context_parallel=plan)
    hidden = model(input_ids, kv_caches, meta).hidden  # [local rows, hidden]
    if len(logits_rows) == 0:
        return None
    rows = plan.gather_rows(hidden, logits_rows)
    return None if rows is None else model.compute_logits(rows)
