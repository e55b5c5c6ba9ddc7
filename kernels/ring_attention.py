"""Ring attention: causal attention over a sequence whose tokens are split over the ranks of a
context-parallel (CP) group, K/V blocks rotating around the ring (Liu et al., Ring Attention).

Zig-zag split, so that causal work is even: the tokens cut into 2 * CP chunks, and rank r
takes chunk r and chunk 2 * CP - 1 - r (an early, cheap chunk and a late, dear one):

    CP 2:  chunks  0 1 2 3        rank 0: 0 + 3     rank 1: 1 + 2
    CP 4:  chunks  0 1 2 3 4 5 6 7
           rank    0 1 2 3 3 2 1 0

The ring: every rank holds its queries and its own K/V block. In step s it attends its
queries to the block that started on rank (r - s) mod CP, while it already sends that block
on to rank r + 1 and receives the next from rank r - 1 (isend/irecv: the transfer overlaps the
compute). CP - 1 transfers later every rank has seen every block. Each step gives a partial
(out, lse); merge_attention folds it into the running result with the online-softmax rescale:

    lse = log(e^lse_a + e^lse_b)
    out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)

so the order of blocks does not matter. A block whose first key lies after the rank's last
query is skipped (causal: it is all in the future).

The unit of compute is block attention (q chunk x K/V chunk -> (out, lse), full or causal by
absolute positions): block_attention_reference here in plain torch, the ground truth, and the
Triton kernel in kernels/block_attention.py (imported only when asked for). Everything here is
torch and torch.distributed; pdserve's engine (serve/executor/context_parallel.py) calls ring_pass
with
its own payload (a K/V block, or an MLA latent block) and visitor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

BlockAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], scale, q_pos=None, k_pos=None)
-> (out [Tq, H, Dv] fp32, lse [Tq, H] fp32)."""


def check_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_pos: torch.Tensor | None, k_pos: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree with q "
                         f"{tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("give both q_pos and k_pos (causal) or neither (full)")
    if q_pos is not None and k_pos is not None:
        if q_pos.shape != (q.shape[0],) or k_pos.shape != (k.shape[0],):
            raise ValueError(f"q_pos must be [{q.shape[0]}] and k_pos [{k.shape[0]}], got "
                             f"{tuple(q_pos.shape)}, {tuple(k_pos.shape)}")


def block_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              q_pos: torch.Tensor | None = None,
                              k_pos: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q against one K/V chunk, in fp32 with the scores materialised: (out, lse).

        out[i, h] = sum_j softmax_j(scale q[i, h] . k[j, h // g]) v[j, h // g]   [Tq, H, Dv]
        lse[i, h] = log sum_j exp(scale q[i, h] . k[j, h // g])                   [Tq, H]

    over every key (full mask) or, given positions, the keys with k_pos[j] <= q_pos[i]
    (causal; positions absolute and in any order). A row that sees no key: out 0, lse -inf.
    """
    check_block_attention(q, k, v, q_pos, k_pos)
    num_q, num_heads, _ = q.shape
    if k.shape[0] == 0 or num_q == 0:
        return empty_partial(q, v.shape[2])
    group = num_heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [Tk, H, D]
    vf = v.float().repeat_interleave(group, dim=1)  # [Tk, H, Dv]
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [H, Tq, Tk]
    if q_pos is not None and k_pos is not None:
        future = k_pos.long()[None, :] > q_pos.long()[:, None]  # [Tq, Tk]
        scores = scores.masked_fill(future[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    probs = torch.exp(scores - _finite(lse)[..., None])  # a row that sees nothing: zeros
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse.transpose(0, 1).contiguous()


def empty_partial(q: torch.Tensor, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, lse) of attending to nothing: zeros and -inf, the merge's identity."""
    return (q.new_zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float32),
            q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32))


def block_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention_reference's result from torch's CPU flash kernel, which returns the
    lse beside the output and never materialises the scores (5x faster at 1k x 1k here).

    That kernel knows only the full mask and the top-left causal one, so a causal call is cut
    up by positions: the queries into runs of consecutive positions, and for each run

        keys  < first position of the run     full mask   (a cached prefix, earlier chunks)
        keys in [first, last] of the run      causal, top-left, when they are exactly
                                              first, first + 1, ... (the run's own chunk);
                                              otherwise the masked reference
        keys  > last position of the run      skipped     (its future)

    whose partials merge. q/k and v of different widths are zero-padded to one (exact)."""
    check_block_attention(q, k, v, q_pos, k_pos)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return empty_partial(q, v.shape[2])
    if q_pos is None or k_pos is None:
        return _flash_cpu(q, k, v, scale, causal=False)
    out, lse = empty_partial(q, v.shape[2])
    q_pos, k_pos = q_pos.long(), k_pos.long()
    for start, end in _consecutive_runs(q_pos):
        first, last = int(q_pos[start]), int(q_pos[end - 1])
        run_q = q[start:end]
        part = empty_partial(run_q, v.shape[2])
        earlier = torch.nonzero(k_pos < first).flatten()
        if earlier.numel():
            whole = earlier.numel() == k.shape[0]
            part = _flash_cpu(run_q, k if whole else k[earlier], v if whole else v[earlier],
                              scale, causal=False)
        inside = torch.nonzero((k_pos >= first) & (k_pos <= last)).flatten()
        if inside.numel():
            inside_pos = k_pos[inside]
            expected = torch.arange(first, first + inside.numel(), device=k_pos.device)
            if torch.equal(inside_pos, expected):
                diagonal = _flash_cpu(run_q, k[inside], v[inside], scale, causal=True)
            else:
                diagonal = block_attention_reference(run_q, k[inside], v[inside], scale,
                                                     q_pos[start:end], inside_pos)
            part = merge_attention(*part, *diagonal)
        out[start:end], lse[start:end] = part
    return out, lse


def _consecutive_runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) index ranges over which positions go up by exactly one."""
    breaks = torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1
    edges = [0, *breaks.tolist(), positions.shape[0]]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of torch's CPU flash kernel on [T, H, D] tensors: (out fp32, lse fp32).
    Causal is top-left aligned (query i sees keys j <= i). Needs q and k non-empty."""
    num_heads, v_dim = q.shape[1], v.shape[2]
    width = max(q.shape[2], v_dim)
    q, k, v = (F.pad(t.float(), (0, width - t.shape[2])) for t in (q, k, v))
    group = num_heads // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0,
        causal, scale=scale)[:2]
    return out[0, :, :, :v_dim].transpose(0, 1), lse[0].transpose(0, 1)


def padded_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          lengths: torch.Tensor, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per sequence against its own keys, batched: (out, lse) in fp32.

        q [S, H, D], k [S, L, Hkv, D], v [S, L, Hkv, Dv], lengths [S] (keys j >= lengths[s]
        are padding)  ->  out [S, H, Dv], lse [S, H]

    What a CP decode step needs: each rank attends every decode row to its own shard of that
    row's context in one call, and the shards' partials merge across the ranks."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qg, k.float()) * scale  # [S, Hkv, g, L]
    padding = torch.arange(k.shape[1], device=q.device)[None, :] >= lengths[:, None]
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [S, Hkv, g]
    probs = torch.exp(scores - _finite(lse)[..., None])
    out = torch.einsum("skgl,slkd->skgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, v.shape[3]), lse.reshape(num_seqs, num_heads)


def get_block_attention(backend_name: str) -> BlockAttention:
    """The block attention of an attention backend: Triton's kernel for "triton" (in the
    interpreter without CUDA), torch's CPU flash kernel for "cpu" (block_attention_cpu), the
    plain-torch reference for "torch"."""
    if backend_name == "torch":
        return block_attention_reference
    if backend_name == "cpu":
        return block_attention_cpu
    if backend_name == "triton":
        from . import _enable_interpreter_without_cuda

        _enable_interpreter_without_cuda()
        from .block_attention import block_attention

        return block_attention
    raise ValueError(f"unknown attention backend {backend_name!r}")


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partials of the same queries over disjoint keys -> the partial over both
    (out [T, H, D] and lse [T, H], fp32). A side with lse -inf contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = _finite(lse)
    weight_a = torch.exp(lse_a - base)[..., None]
    weight_b = torch.exp(lse_b - base)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials stacked on a leading axis (one per rank: outs [R, T, H, D], lses [R, T, H],
    as an all-gather returns them) -> one partial."""
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - _finite(lse)[None])[..., None]  # [R, T, H, 1]
    return (outs * weights).sum(dim=0), lse


# ---- the zig-zag split ---------------------------------------------------------------------


def zigzag_chunk_bounds(num_tokens: int, cp_size: int) -> list[tuple[int, int]]:
    """[start, end) of the 2 * cp_size chunks, as even as integers allow (the first
    num_tokens % (2 cp) chunks one longer)."""
    if cp_size <= 0 or num_tokens < 0:
        raise ValueError(f"bad zig-zag split of {num_tokens} tokens over {cp_size} ranks")
    num_chunks = 2 * cp_size
    base, extra = divmod(num_tokens, num_chunks)
    bounds, start = [], 0
    for c in range(num_chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def zigzag_ranges(num_tokens: int, cp_size: int, rank: int) -> list[tuple[int, int]]:
    """Rank `rank`'s two chunks, [start, end) each, in token order: chunk r, chunk 2 CP-1-r."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} is not in a CP group of {cp_size}")
    bounds = zigzag_chunk_bounds(num_tokens, cp_size)
    return [bounds[rank], bounds[2 * cp_size - 1 - rank]]


def zigzag_indices(num_tokens: int, cp_size: int, rank: int) -> torch.Tensor:
    """Token indices of rank `rank` under the zig-zag split (int64, ascending)."""
    parts = [torch.arange(start, end) for start, end in zigzag_ranges(num_tokens, cp_size, rank)]
    return torch.cat(parts)


# ---- the ring ------------------------------------------------------------------------------


Shapes = Sequence[Sequence[torch.Size]]  # shapes[src][i]: tensor i of rank src's payload
RingVisit = Callable[[int, list[torch.Tensor]], None]


def gather_payload_shapes(payload: Sequence[torch.Tensor], group: dist.ProcessGroup | None
                          ) -> list[list[torch.Size]]:
    """Every rank's payload shapes (one small all-gather), when the ranks cannot work them
    out themselves."""
    dims = [t.dim() for t in payload]
    mine = torch.tensor([d for t in payload for d in t.shape], dtype=torch.int64,
                        device=payload[0].device if payload else "cpu")
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    shapes = []
    for part in parts:
        values, at, rank_shapes = part.tolist(), 0, []
        for d in dims:
            rank_shapes.append(torch.Size(values[at:at + d]))
            at += d
        shapes.append(rank_shapes)
    return shapes


def ring_pass(payload: Sequence[torch.Tensor], visit: RingVisit,
              group: dist.ProcessGroup | None = None, shapes: Shapes | None = None) -> None:
    """Rotate every rank's payload around the ring; visit(src, tensors) runs once for each
    rank's payload (this rank's own first), while the next one is already in flight.

    shapes[src] are rank src's payload shapes (dtypes are the same everywhere); None gathers
    them. Every rank of `group` must call this with its payload."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    payload = [t.contiguous() for t in payload]
    if shapes is None:
        shapes = gather_payload_shapes(payload, group)
    peer_next = _global_rank(group, (rank + 1) % size)
    peer_prev = _global_rank(group, (rank - 1) % size)
    current = payload
    for step in range(size):
        src = (rank - step) % size
        incoming: list[torch.Tensor] = []
        requests: list[dist.Work] = []
        if step + 1 < size:
            # The block that rank - 1 holds now: it started on rank - step - 1.
            incoming_src = (rank - step - 1) % size
            incoming = [torch.empty(shapes[incoming_src][i], dtype=t.dtype, device=t.device)
                        for i, t in enumerate(payload)]
            ops = [dist.P2POp(dist.isend, t, peer_next, group, tag=i)
                   for i, t in enumerate(current) if t.numel()]
            ops += [dist.P2POp(dist.irecv, t, peer_prev, group, tag=i)
                    for i, t in enumerate(incoming) if t.numel()]
            requests = dist.batch_isend_irecv(ops) if ops else []
        visit(src, current)
        for request in requests:
            request.wait()
        current = incoming


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _may_see(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None) -> bool:
    """False when every key lies after every query (causal): the block is skipped."""
    if q_pos is None or k_pos is None:
        return True
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return False
    return bool(k_pos.min() <= q_pos.max())


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                   group: dist.ProcessGroup | None = None,
                   attend: BlockAttention = block_attention_reference
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries against every rank's K/V block, blocks rotating around `group`:
    (out [Tq, H, Dv], lse [Tq, H]) in fp32. Causal by absolute positions when given (each
    rank's k_pos travels with its block), full otherwise."""
    causal = q_pos is not None
    payload = [k, v] + ([k_pos] if causal and k_pos is not None else [])
    out, lse = empty_partial(q, v.shape[2])

    def visit(src: int, block: list[torch.Tensor]) -> None:
        nonlocal out, lse
        block_k, block_v = block[0], block[1]
        block_pos = block[2] if causal else None
        if not _may_see(q_pos, block_pos):
            return
        part_out, part_lse = attend(q, block_k, block_v, scale, q_pos, block_pos)
        out, lse = merge_attention(out, lse, part_out, part_lse)

    ring_pass(payload, visit, group)
    return out, lse


def simulate_ring_attention(qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor],
                            vs: Sequence[torch.Tensor], scale: float,
                            q_pos: Sequence[torch.Tensor] | None = None,
                            k_pos: Sequence[torch.Tensor] | None = None,
                            attend: BlockAttention = block_attention_reference
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ring_attention for len(qs) ranks in one process: the same block order (rank r sees
    blocks r, r - 1, ..., r + 1) and the same merge, with the ring's sends as list indexing.
    For tests and for reasoning about the schedule without processes."""
    size = len(qs)
    results = []
    for rank in range(size):
        out, lse = empty_partial(qs[rank], vs[rank].shape[2])
        for step in range(size):
            src = (rank - step) % size
            qp = q_pos[rank] if q_pos is not None else None
            kp = k_pos[src] if k_pos is not None else None
            if not _may_see(qp, kp):
                continue
            part = attend(qs[rank], ks[src], vs[src], scale, qp, kp)
            out, lse = merge_attention(out, lse, *part)
        results.append((out, lse))
    return results
