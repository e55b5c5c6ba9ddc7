"""Paged decode attention for CPUs: a small C++ kernel that reads the paged cache in place.

The plain-torch path (pdserve/kernels/reference.py) gathers every sequence's whole context out of
the paged cache into a padded copy, per layer and step, before SDPA: on a decode step that copy
is most of the attention's work. This kernel walks each sequence's block table instead and
reads every K and V row once, where it lies:

    work item (s, chunk)     a sequence's context, or a chunk of whole blocks of it when
                             there are fewer long sequences than threads can share
      q     = scale * q[s]                                            fp32 [H, Dk]
      pass 1: block by block: score[h, t] = q_h . K[t, kv head of h]  8 rows per register
                 tile; every KV head's rows of a token lie side by side, so a block streams
                 once, and the next block (anywhere in the pool) is prefetched meanwhile
      e^(score - max) per h (a vectorised exp)
      pass 2: block by block: acc[h] += p[h, t] V[t, kv head of h]    acc in registers
    chunks of one sequence merge by their maxima and sums (flash-decoding)

One kernel serves both cache kinds through strided K and V views of the same pool:
    mha: K = kv_cache[0], V = kv_cache[1]       [blocks, bs, Hkv, D]
    mla: K = latent[:, :, None, :] (R + P wide), V = its first R columns, Hkv = 1
so MLA's absorbed decode (every head over the shared latent) is the G = H case.

A prefill step's prompts take pdserve/kernels/csrc/prefill_attention.cpp instead of SDPA where the
build has AVX-512 (flash attention's tiling, 16 query rows by 16 keys, an online softmax lane-wise
over the rows), which keeps the scores in registers where SDPA's CPU path does not.

The decode kernel is pdserve/kernels/csrc/paged_attention.cpp, built with pdserve's other CPU
kernels (pdserve/kernels/cpu_ops.py). Lengths and block ids are checked before any read (a bad table
is a ValueError, never a read outside the pool). Queries may be fp32, bf16 or fp16, the cache the
query's dtype or float8_e4m3fn (kv_cache_dtype fp8: each block's rows upcast as they are
read, as bf16 ones are); the math is fp32. Writes into an FP8 cache take the plain-torch
path (reference.to_cache_dtype: clamp, round).
"""

from __future__ import annotations

import torch

from . import cpu_ops, reference
from .reference import check_decode, check_kv_cache_write, check_mla_decode, is_fp8


def last_token_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float
                         ) -> torch.Tensor:
    """query [S, H, Dk] (each row its sequence's last token), k_cache [blocks, bs, Hkv, Dk],
    v_cache [blocks, bs, Hkv, Dv] -> [S, H, Dv]. The caller checked shapes and tables."""
    module = cpu_ops.load()
    assert module is not None, "call only when cpu_ops.load() succeeded"
    return module.paged_last_token_attention(
        query if query.stride(-1) == 1 else query.contiguous(), k_cache, v_cache,
        seq_lens.to(torch.int32), block_tables.to(torch.int32).contiguous(), float(scale))


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """reference.decode_attention's contract, reading the paged cache in place."""
    check_decode(query, kv_cache, seq_lens, block_tables)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    return last_token_attention(query, kv_cache[0], kv_cache[1], seq_lens, block_tables, scale)


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      max_query_len: int, key: torch.Tensor | None = None,
                      value: torch.Tensor | None = None) -> torch.Tensor:
    """reference.prefill_attention's contract; the decode rows riding along in a prefill step
    read the cache in place here too, not through the torch path's gathered copy (served,
    they are most steps' rows), and
    the prompts' rows take the C++ causal kernel where it applies (_causal_rows)."""
    return reference.prefill_attention(query, kv_cache, cu_seqlens_q, seq_lens, block_tables,
                                       scale, max_query_len, last_token=_rows_last_token,
                                       key=key, value=value, causal=_causal_rows)


def _causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 enable_gqa: bool = True) -> torch.Tensor:
    """reference._causal_sdpa's contract (fp32 q [H, Lq, D] over k / v [Hkv, Lk, D]) on
    pdserve/kernels/csrc/prefill_attention.cpp, where the build has AVX-512 and the head dims are
    multiples of 16; SDPA otherwise."""
    module = cpu_ops.load()
    if (module is None or not module.causal_attention_available() or q.shape[-1] % 16
            or v.shape[-1] % 16 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1):
        return reference._causal_sdpa(q, k, v, scale, enable_gqa=enable_gqa)
    return module.causal_attention(q, k, v, float(scale))


def _rows_last_token(query: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    return last_token_attention(query, kv_cache[0], kv_cache[1], seq_lens, block_tables, scale)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor,
                         latent_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """reference.mla_decode_attention's contract: one latent "KV head" shared by every query
    head, K = the whole row [c_kv | k_rope], V = its c_kv part."""
    check_mla_decode(q_latent, q_rope, latent_cache, seq_lens, block_tables)
    if q_latent.shape[0] == 0:
        return torch.empty_like(q_latent)
    rows = latent_cache[:, :, None, :]  # [blocks, bs, 1, R + P]
    query = torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)
    return last_token_attention(query, rows, rows[..., :q_latent.shape[-1]], seq_lens,
                                block_tables, scale)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """reference.write_kv_cache's contract: one row copy per token and KV head, no index
    tensors built; slots are checked against the pool before any write, and a negative one
    (padding) is skipped."""
    check_kv_cache_write(key, value, kv_cache, slot_mapping)
    module = cpu_ops.load()
    assert module is not None, "call only when cpu_ops.load() succeeded"
    if (key.stride(-1) != 1 or value.stride(-1) != 1 or not kv_cache.is_contiguous()
            or is_fp8(kv_cache.dtype)):
        reference.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    module.write_kv_cache(key, value, kv_cache, slot_mapping)
