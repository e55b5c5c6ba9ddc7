"""Every kernel op in plain torch (pdserve/kernels/registry.py lists the ops): the reference its
other implementations are tested against, its contract, and the path that runs where no other one
does. Attention over the paged KV cache first, then a decoder block's small ops (norm, SiLU,
rotary, linear), block attention with its log-sum-exp, and the argument checks the other
implementations share.

Paged layout (shared by every backend):

    kv_cache      [2, num_blocks, block_size, num_kv_heads, head_dim]   0 = K, 1 = V
    latent_cache  [num_blocks, block_size, kv_lora_rank + rope_dim]     MLA: [c_kv | k_rope]
    slot          block_id * block_size + offset_in_block

    block_tables[s] = [b0, b1, b2, pad, pad]      seq_lens[s] = 2 * block_size + 5
    position p of sequence s lives in block block_tables[s][p // block_size],
    row p % block_size. Entries past a sequence's last block may hold anything.

The cache may hold the model dtype or float8_e4m3fn (kv_cache_dtype fp8, a per-tensor scale
of 1.0): writes clamp to e4m3's range and round (to_cache_dtype), reads upcast to fp32.

Every function accumulates in fp32 and returns the query's dtype. Nothing loops per token:
decode rows are batched over sequences (contexts gathered, padded and masked, in chunks of
bounded memory); a prefill sequence of several rows gets one SDPA call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .partials import empty_partial, finite_lse

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def to_cache_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the cache stores them: an FP8 cache saturates at +-448 (every backend alike,
    where a bare cast's overflow behaviour differs), then rounds to nearest."""
    if is_fp8(dtype):
        return rows.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return rows.to(dtype)


def _split_slots(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    slot_mapping = slot_mapping.long()
    return slot_mapping // block_size, slot_mapping % block_size


def _skip_padding(slot_mapping: torch.Tensor, *rows: torch.Tensor) -> list[torch.Tensor]:
    """[slot_mapping, *rows] without the padding rows: a negative slot marks a row that writes
    nothing (a decode graph's bucket past the step's sequences,
    pdserve/serve/executor/cuda_graphs.py), in every backend. Indexed as it is, -1 would land in the
    pool's last block."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return [slot_mapping, *rows]
    return [slot_mapping[keep], *(r[keep] for r in rows)]


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ([T, Hkv, D]) into kv_cache at slot_mapping ([T]); a row
    whose slot is negative is skipped (padding)."""
    check_kv_cache_write(key, value, kv_cache, slot_mapping)
    slot_mapping, key, value = _skip_padding(slot_mapping, key, value)
    # Two-index advanced assignment writes in place whatever the cache's strides are.
    block_ids, offsets = _split_slots(slot_mapping, kv_cache.shape[2])
    kv_cache[0, block_ids, offsets] = to_cache_dtype(key, kv_cache.dtype)
    kv_cache[1, block_ids, offsets] = to_cache_dtype(value, kv_cache.dtype)


def write_latent_cache(latent: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Scatter MLA latent rows ([T, R + P]) into latent_cache at slot_mapping ([T]); a row
    whose slot is negative is skipped (padding)."""
    check_latent_cache_write(latent, latent_cache, slot_mapping)
    slot_mapping, latent = _skip_padding(slot_mapping, latent)
    block_ids, offsets = _split_slots(slot_mapping, latent_cache.shape[1])
    latent_cache[block_ids, offsets] = to_cache_dtype(latent, latent_cache.dtype)


# Batched paths gather every sequence's context, padded to the longest, in chunks of
# sequences whose fp32 copy stays under this many elements (128 MiB).
GATHER_BUDGET_ELEMENTS = 1 << 25


def _context_blocks(block_tables: torch.Tensor, s: int, seq_len: int,
                    block_size: int) -> torch.Tensor:
    """Block ids holding positions [0, seq_len) of sequence s (no padding entries)."""
    num_blocks = (seq_len + block_size - 1) // block_size
    return block_tables[s, :num_blocks].long()


def _padded_context(cache_rows: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[n, num_blocks * block_size, ...]: each sequence's first num_blocks blocks, in order.

    cache_rows is [total_blocks, block_size, ...]. Table entries past a sequence's own
    blocks may be anything, so they are replaced by block 0; callers mask those positions.
    """
    block_size = cache_rows.shape[1]
    cols = torch.arange(num_blocks, device=block_tables.device)
    owned = cols[None, :] * block_size < seq_lens[:, None]  # [n, num_blocks]
    tables = torch.where(owned, block_tables[:, :num_blocks].long(), 0)
    return cache_rows[tables].flatten(1, 2)


def _sequence_chunks(seq_lens: torch.Tensor, block_size: int, row_elements: int
                     ) -> list[tuple[slice, int]]:
    """Split sequences into chunks whose padded fp32 context fits GATHER_BUDGET_ELEMENTS;
    returns (sequence slice, blocks per sequence in the chunk)."""
    lens = seq_lens.tolist()
    chunks, start = [], 0
    while start < len(lens):
        end, longest = start, 0
        while end < len(lens):
            longest_next = max(longest, lens[end])
            padded = -(-longest_next // block_size) * block_size
            if end > start and (end - start + 1) * padded * row_elements > GATHER_BUDGET_ELEMENTS:
                break
            longest, end = longest_next, end + 1
        chunks.append((slice(start, end), -(-longest // block_size)))
        start = end
    return chunks


def _last_token_attention(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row of query ([n, H, D]) is its sequence's last token: it sees all seq_len keys.
    Batched over sequences (padded and masked) so a decode step costs a few large ops."""
    num_heads, head_dim = query.shape[1:]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    lens = seq_lens.long()
    for rows, num_blocks in _sequence_chunks(lens, block_size, 2 * num_kv_heads * head_dim):
        k = _padded_context(kv_cache[0], block_tables[rows], lens[rows], num_blocks).float()
        v = _padded_context(kv_cache[1], block_tables[rows], lens[rows], num_blocks).float()
        # [n, Hkv, group, D]: query head h uses KV head h // group; the group plays SDPA's
        # query-length role, so each KV head is read once for its whole group.
        q = query[rows].float().view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
        keep = torch.arange(k.shape[1], device=query.device)[None, :] < lens[rows][:, None]
        o = F.scaled_dot_product_attention(  # [n, Hkv, group, D]
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :],
            scale=scale)
        out[rows] = o.reshape(-1, num_heads, head_dim).to(query.dtype)
    return out


def _split_by_rows(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]:
    """The sequences with exactly one query row, as (indices, query rows): decodes riding
    along in a prefill batch, which the batched last-token paths take; and (s, q_start,
    q_end, seq_len) for every sequence with more. From one pass over two short lists (every
    layer of a step asks, and a few tensor ops per layer cost more than the lists)."""
    starts = cu_seqlens_q.tolist()
    single, multi = [], []
    for s, seq_len in enumerate(seq_lens.tolist()):
        if starts[s + 1] - starts[s] == 1:
            single.append(s)
        elif starts[s + 1] > starts[s]:
            multi.append((s, starts[s], starts[s + 1], seq_len))
    device = cu_seqlens_q.device
    index = torch.tensor(single, dtype=torch.long, device=device)
    rows = torch.tensor([starts[s] for s in single], dtype=torch.long, device=device)
    return index, rows, multi


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 enable_gqa: bool = False) -> torch.Tensor:
    """q [H, q_len, D] over k/v [H(kv), seq_len, D]: the last q_len of seq_len positions,
    causal. With nothing cached SDPA's own (top-left aligned) is_causal is that mask;
    otherwise it is built bottom-right aligned.

    SDPA runs on 4-D views ([1, H, L, D]): on CPU only those reach its flash kernel, and 3-D
    inputs fall back to the math path, which materialises the scores."""
    q_len, seq_len = q.shape[-2], k.shape[-2]
    if q_len == seq_len:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                              scale=scale, enable_gqa=enable_gqa)[0]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible,
                                          scale=scale, enable_gqa=enable_gqa)[0]


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      max_query_len: int,
                      last_token: Callable[..., torch.Tensor] | None = None,
                      key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                      causal: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention for a ragged batch whose K/V (cached prefix + new) sit in kv_cache.

    Query i of sequence s is at position seq_lens[s] - q_len_s + i and sees keys at
    positions <= its own:

        keys      0 1 2 3 4 5 6        seq_len 7, q_len 3 (4 cached, 3 new)
        query 0   x x x x x . .        position 4
        query 1   x x x x x x .        position 5
        query 2   x x x x x x x        position 6

    Sequences with one query row (decodes riding along with prefills) go through the batched
    last-token path (`last_token`, decode_attention's arguments: a backend's own decode
    kernel; default the torch one here); the others get one causal call each (`causal`,
    _causal_sdpa's arguments: a backend's own kernel; default SDPA).

    key, value: the step's own rows [T, Hkv, D], just written to the cache. A sequence with
    nothing cached before this step (a fresh prompt) then attends over them in place of a
    gathered copy of its blocks: the same values where the cache holds the model's dtype (an
    FP8 cache holds rounded ones, so it is always read back).
    """
    check_prefill(query, kv_cache, cu_seqlens_q, seq_lens, block_tables, max_query_len)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    out = torch.empty_like(query)
    index, rows, multi = _split_by_rows(cu_seqlens_q, seq_lens)
    if index.numel():
        out[rows] = (last_token or _last_token_attention)(query[rows], kv_cache, seq_lens[index],
                                                          block_tables[index], scale)
    fresh = key is not None and value is not None and key.dtype == kv_cache.dtype
    for s, q_start, q_end, seq_len in multi:
        if fresh and seq_len == q_end - q_start:
            k = key[q_start:q_end].transpose(0, 1)  # [Hkv, seq_len, D]
            v = value[q_start:q_end].transpose(0, 1)
        else:
            blocks = _context_blocks(block_tables, s, seq_len, block_size)
            # [seq_len, Hkv, D] -> [Hkv, seq_len, D]
            k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
            v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        o = (causal or _causal_sdpa)(q.float(), k.float(), v.float(), scale, enable_gqa=True)
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)
    return out


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence ([S, H, D]) attending to its whole context."""
    check_decode(query, kv_cache, seq_lens, block_tables)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    return _last_token_attention(query, kv_cache, seq_lens, block_tables, scale)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor,
                         latent_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA decode: every head attends over the shared latent rows [c_kv | k_rope].

        score[h, j] = scale * (q_latent[h] . c_kv[j] + q_rope[h] . k_rope[j])
        out[h]      = sum_j softmax(score[h])_j * c_kv[j]             -> [S, H, R]
    """
    check_mla_decode(q_latent, q_rope, latent_cache, seq_lens, block_tables)
    _, block_size, latent_dim = latent_cache.shape
    rank = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    lens = seq_lens.long()
    for rows, num_blocks in _sequence_chunks(lens, block_size, latent_dim):
        context = _padded_context(latent_cache, block_tables[rows], lens[rows], num_blocks)
        context = context.float()  # [n, L, R + P]
        q = torch.cat([q_latent[rows], q_rope[rows]], dim=-1).float()  # [n, H, R + P]
        scores = torch.einsum("nhc,nlc->nhl", q, context) * scale
        padding = torch.arange(context.shape[1], device=q.device)[None, :] >= lens[rows][:, None]
        scores.masked_fill_(padding[:, None, :], float("-inf"))
        o = torch.einsum("nhl,nlr->nhr", torch.softmax(scores, dim=-1), context[..., :rank])
        out[rows] = o.to(q_latent.dtype)
    return out


def mla_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor,
                          latent_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float,
                          max_query_len: int) -> torch.Tensor:
    """MLA prefill, expanded: each sequence's context latent is up-projected to per-head keys
    and values, the model's math as written (and as Hugging Face computes it):

        k[j, h] = [c_kv[j] W_UK[h]^T | k_rope[j]]       v[j, h] = c_kv[j] W_UV[h]^T
        out[i, h] = sum_j softmax_j(scale q[i, h] . k[j, h]) v[j, h]       (causal)

    q_nope [T, H, N], q_rope [T, H, P], w_uk [H, N, R], w_uv [H, V, R] -> [T, H, V]. With many
    query rows this is cheaper than the absorbed form (attention N + P wide, not R + P);
    single-row sequences (decodes riding along) take the absorbed decode path instead, as
    expanding a whole context for one query would cost more than it saves.
    """
    check_mla_prefill(q_nope, q_rope, latent_cache, w_uk, w_uv, cu_seqlens_q, seq_lens,
                      block_tables, max_query_len)
    num_heads, nope_dim, rank = w_uk.shape
    v_dim = w_uv.shape[1]
    out = q_nope.new_empty(q_nope.shape[0], num_heads, v_dim)
    index, rows, multi = _split_by_rows(cu_seqlens_q, seq_lens)
    if index.numel():
        q_latent = torch.einsum("shn,hnr->shr", q_nope[rows].float(), w_uk.float())
        o_latent = mla_decode_attention(q_latent, q_rope[rows].float(),
                                        latent_cache, seq_lens[index], block_tables[index],
                                        scale)
        out[rows] = torch.einsum("shr,hvr->shv", o_latent, w_uv.float()).to(out.dtype)
    # [R, H * N] and [R, H * V]: one matmul up-projects a whole context
    up_k = w_uk.reshape(-1, rank).t().float()
    up_v = w_uv.reshape(-1, rank).t().float()
    block_size = latent_cache.shape[1]
    for s, q_start, q_end, seq_len in multi:
        blocks = _context_blocks(block_tables, s, seq_len, block_size)
        context = latent_cache[blocks].flatten(0, 1)[:seq_len].float()  # [L, R + P]
        c_kv, k_rope = context[:, :rank], context[:, rank:]
        k = torch.cat([(c_kv @ up_k).view(seq_len, num_heads, nope_dim),
                       k_rope[:, None, :].expand(-1, num_heads, -1)], dim=-1)
        v = (c_kv @ up_v).view(seq_len, num_heads, v_dim)
        q = torch.cat([q_nope[q_start:q_end], q_rope[q_start:q_end]], dim=-1).float()
        o = _causal_sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


# ---- the small ops of a decoder block ----------------------------------------------------
# Each reproduces Hugging Face's arithmetic order (and its float32 upcasts), so the engine's
# logits match transformers to float32 rounding.


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * y / rms(y), y) for y = x + residual (y = x without one): the pre-norm block's
    add and norm in one op, the sum handed on as the next residual. fp32 math, cast back."""
    if residual is not None:
        x = x + residual
    residual = x
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2 * d] (gate | up) -> [.., d] = silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
           rotary_dim: int, is_interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, Hkv, D], cos / sin [T, 1, rotary_dim] -> rotated (query, key).
    The first rotary_dim dims rotate in pairs, (x[i], x[i + d/2]) in the NeoX layout,
    (x[2i], x[2i + 1]) interleaved (outputs then in rotate-half order); the rest pass."""
    rotate = _rotate_interleaved if is_interleaved else _rotate_neox
    return (_apply_rotary(rotate, query, cos_sin, rotary_dim),
            _apply_rotary(rotate, key, cos_sin, rotary_dim))


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The table is [freqs | freqs]: its first half has one entry per pair.
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def _apply_rotary(rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                  x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rotary_dim: int
                  ) -> torch.Tensor:
    cos, sin = cos_sin
    if rotary_dim == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat((rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b (W [out, in]); `packed`, another implementation's copy of W, is not read."""
    return F.linear(x, weight, bias)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """No packed copy: the plain weight is what `linear` reads."""
    return None


# ---- block attention: one query chunk against one K/V chunk, with its log-sum-exp ---------


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
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
    probs = torch.exp(scores - finite_lse(lse)[..., None])  # a row that sees nothing: zeros
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse.transpose(0, 1).contiguous()


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
    probs = torch.exp(scores - finite_lse(lse)[..., None])
    out = torch.einsum("skgl,slkd->skgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, v.shape[3]), lse.reshape(num_seqs, num_heads)


# ---- argument checks shared with the Triton wrappers ------------------------------------


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_tables(seq_lens: torch.Tensor, block_tables: torch.Tensor, num_seqs: int) -> None:
    _require(seq_lens.dim() == 1 and seq_lens.shape[0] == num_seqs,
             f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    _require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
             f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    _require(not seq_lens.is_floating_point() and not block_tables.is_floating_point(),
             "seq_lens and block_tables must be integer tensors")


def check_kv_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    _require(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
             f"kv_cache must be [2, blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    _require(key.shape == value.shape and key.dim() == 3,
             f"key/value must both be [T, Hkv, D], got {tuple(key.shape)}, {tuple(value.shape)}")
    _require(key.shape[1:] == kv_cache.shape[3:],
             f"key rows {tuple(key.shape[1:])} do not match the cache's {kv_cache.shape[3:]}")
    _require(slot_mapping.shape == (key.shape[0],) and not slot_mapping.is_floating_point(),
             f"slot_mapping must be integer [{key.shape[0]}], got {tuple(slot_mapping.shape)}")


def check_latent_cache_write(latent: torch.Tensor, latent_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    _require(latent_cache.dim() == 3,
             f"latent_cache must be [blocks, block_size, R + P], got {tuple(latent_cache.shape)}")
    _require(latent.dim() == 2 and latent.shape[1] == latent_cache.shape[2],
             f"latent must be [T, {latent_cache.shape[2]}], got {tuple(latent.shape)}")
    _require(slot_mapping.shape == (latent.shape[0],) and not slot_mapping.is_floating_point(),
             f"slot_mapping must be integer [{latent.shape[0]}], got {tuple(slot_mapping.shape)}")


def _check_query_and_cache(query: torch.Tensor, kv_cache: torch.Tensor, rows: str) -> None:
    """kv_cache [2, blocks, block_size, Hkv, D] and query [rows, H, D] with H % Hkv == 0."""
    _require(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
             f"kv_cache must be [2, blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    _require(query.dim() == 3 and query.shape[2] == kv_cache.shape[4],
             f"query must be [{rows}, H, {kv_cache.shape[4]}], got {tuple(query.shape)}")
    _require(query.shape[1] % kv_cache.shape[3] == 0,
             f"{query.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} KV heads")


def _check_ragged(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, max_query_len: int) -> None:
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _require(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] == num_seqs + 1,
             f"cu_seqlens_q must be [{num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    _check_tables(seq_lens, block_tables, num_seqs)
    _require(max_query_len >= 0, f"max_query_len must be >= 0, got {max_query_len}")


def check_prefill(query: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  max_query_len: int) -> None:
    _check_query_and_cache(query, kv_cache, "T")
    _check_ragged(cu_seqlens_q, seq_lens, block_tables, max_query_len)


def check_decode(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
    _check_query_and_cache(query, kv_cache, "S")
    _check_tables(seq_lens, block_tables, query.shape[0])


def check_mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
    _require(latent_cache.dim() == 3,
             f"latent_cache must be [blocks, block_size, R + P], got {tuple(latent_cache.shape)}")
    _require(q_latent.dim() == 3 and q_rope.dim() == 3
             and q_latent.shape[:2] == q_rope.shape[:2],
             f"q_latent [S, H, R] and q_rope [S, H, P] disagree: {tuple(q_latent.shape)}, "
             f"{tuple(q_rope.shape)}")
    _require(q_latent.shape[2] + q_rope.shape[2] == latent_cache.shape[2],
             f"R + P = {q_latent.shape[2]} + {q_rope.shape[2]} != cache row "
             f"{latent_cache.shape[2]}")
    _check_tables(seq_lens, block_tables, q_latent.shape[0])


def check_mla_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                      w_uk: torch.Tensor, w_uv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int) -> None:
    _require(w_uk.dim() == 3 and w_uv.dim() == 3 and w_uk.shape[0] == w_uv.shape[0]
             and w_uk.shape[2] == w_uv.shape[2],
             f"w_uk [H, N, R] and w_uv [H, V, R] disagree: {tuple(w_uk.shape)}, "
             f"{tuple(w_uv.shape)}")
    _require(q_nope.dim() == 3 and q_nope.shape[1:] == w_uk.shape[:2],
             f"q_nope must be [T, {w_uk.shape[0]}, {w_uk.shape[1]}], got {tuple(q_nope.shape)}")
    _require(q_rope.dim() == 3 and q_rope.shape[:2] == q_nope.shape[:2],
             f"q_rope must be [{q_nope.shape[0]}, {q_nope.shape[1]}, P], got "
             f"{tuple(q_rope.shape)}")
    _require(latent_cache.dim() == 3 and latent_cache.shape[2] == w_uk.shape[2] + q_rope.shape[2],
             f"latent_cache must be [blocks, block_size, {w_uk.shape[2]} + {q_rope.shape[2]}], "
             f"got {tuple(latent_cache.shape)}")
    _check_ragged(cu_seqlens_q, seq_lens, block_tables, max_query_len)


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
