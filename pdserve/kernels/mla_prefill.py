"""MLA prefill on the Triton backend: the absorbed form through the paged prefill kernel.

W_UK folds into the query and W_UV applies after attention, so every query head attends over
the cached latent rows themselves, as multi-query attention with one KV "head" R + P wide
whose key and value are the same row (the latent cache expanded to two planes, stride 0):

    query[t, h] = [q_nope[t, h] W_UK[h] | q_rope[t, h]]                  [T, H, R + P]
    o[t, h]     = prefill_attention(query, latent as K and V)[:, :, :R]  [T, H, R]
    out[t, h]   = o[t, h] W_UV[h]^T                                       [T, H, V]

No per-head K/V is materialised, so a long cached prefix costs no up-projection; the price is
attention R + P wide instead of N + P (reference.mla_prefill_attention computes the expanded
form, the same result). Same arguments and result as the reference.
"""

from __future__ import annotations

import torch

from . import prefill_attention as _prefill  # looked up per call: the module may be reloaded
from .reference import check_mla_prefill


def mla_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor,
                          latent_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float,
                          max_query_len: int) -> torch.Tensor:
    check_mla_prefill(q_nope, q_rope, latent_cache, w_uk, w_uv, cu_seqlens_q, seq_lens,
                      block_tables, max_query_len)
    rank = w_uk.shape[2]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk.to(q_nope.dtype))
    query = torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)
    as_kv = latent_cache[None, :, :, None, :].expand(2, -1, -1, -1, -1)
    o = _prefill.prefill_attention(query, as_kv, cu_seqlens_q, seq_lens, block_tables, scale,
                                   max_query_len)
    return torch.einsum("thr,hvr->thv", o[..., :rank], w_uv.to(o.dtype))
