"""The engine's one attention dispatch point: step metadata in, paged-KV attention out.

A step is a ragged batch of chunks (see pdserve/protocol/tp.py). Its metadata, built once per step
and shared by every layer:

    chunks:        A: start 0, 5 tokens       B: start 9, 1 token (decode)
    positions      [0 1 2 3 4                 9]
    cu_seqlens_q   [0, 5, 6]                  query rows of chunk s: [cu[s], cu[s+1])
    seq_lens       [5, 10]                    context INCLUDING this step's tokens
    slot_mapping   slot = block_table[pos // block_size] * block_size + pos % block_size
    block_tables   [num_seqs, max_blocks] int32, rows padded with 0 (never read past seq_len)

The attention math itself lives in pdserve.kernels (Triton on CUDA, plain torch on CPU);
this module only picks the backend and calls it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pdserve import envs
from pdserve.protocol.tp import StepInput
from pdserve.serve.layers.uploads import to_device


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # int64 [num_tokens]: absolute position of each token
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    max_query_len: int
    is_decode_only: bool  # every chunk is exactly one token: the decode kernel applies
    token_seq_lens: torch.Tensor | None = None
    """A verify step (every chunk one token plus its drafts, pdserve/serve/engine/spec_decode.py):
    int32 [num_tokens], each token's context up to and including itself, so a decode kernel can
    take every token as its own query row; None otherwise."""
    token_block_tables: torch.Tensor | None = None
    """With token_seq_lens: int32 [num_tokens, max_blocks], each token's sequence's table."""
    context_parallel: Any = None
    """A context-parallel step's plan (pdserve/serve/context_parallel.ContextParallelStep): this
    rank's rows only, and attention goes round the ring instead of to the kernels."""


def build_attention_metadata(step: StepInput, block_size: int, device: torch.device
                             ) -> AttentionMetadata:
    """Metadata for one step; per-chunk Python work only, never per token.

    Assumes a valid step (the runner validates before any rank starts it): every block
    table covers its chunk's last position.
    """
    chunks = step.chunks
    if chunks and all(len(c.token_ids) == 1 and not c.num_draft_tokens for c in chunks):
        return DecodeMetadata(chunks, block_size, device)
    query_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64,
                             count=len(chunks))
    start_pos = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=len(chunks))
    seq_lens = start_pos + query_lens
    block_tables = padded_block_tables(chunks, np.int64)
    cu_seqlens_q = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    # Token t of chunk s sits at position start_pos[s] + (t - cu_seqlens_q[s]).
    seq_of_token = np.repeat(np.arange(len(chunks)), query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(
        start_pos - cu_seqlens_q[:-1], query_lens
    )
    slot_mapping = (block_tables[seq_of_token, positions // block_size] * block_size
                    + positions % block_size)
    return AttentionMetadata(
        positions=to_device(torch.from_numpy(positions), device),
        slot_mapping=to_device(torch.from_numpy(slot_mapping), device),
        cu_seqlens_q=to_device(torch.from_numpy(cu_seqlens_q.astype(np.int32)), device),
        seq_lens=to_device(torch.from_numpy(seq_lens.astype(np.int32)), device),
        block_tables=to_device(torch.from_numpy(block_tables.astype(np.int32)), device),
        max_query_len=int(query_lens.max(initial=0)),
        is_decode_only=bool(len(chunks) > 0 and (query_lens == 1).all()),
        **_verify_rows(chunks, query_lens, positions, seq_of_token, block_tables, device),
    )


def padded_block_tables(chunks: list, dtype: type) -> np.ndarray:
    """[num_chunks, max(1, longest table)] of `dtype`, each row a chunk's table padded with 0."""
    lengths = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64,
                          count=len(chunks))
    # every id in one pass (chain iterates in C), then scattered row by row in one assignment
    ids = np.fromiter(itertools.chain.from_iterable(c.block_table for c in chunks), dtype=dtype,
                      count=int(lengths.sum()))
    block_tables = np.zeros((len(chunks), max(1, int(lengths.max(initial=0)))), dtype=dtype)
    block_tables[np.arange(block_tables.shape[1]) < lengths[:, None]] = ids
    return block_tables


class DecodeMetadata(AttentionMetadata):
    """build_attention_metadata for a step of one token per chunk (a decode step): each row's
    position is its length - 1, and the positions and slot mapping are built on first read.
    The fused decode loop (pdserve/serve/layers/fused_decode.py) reads neither: it derives both from
    the lengths and tables, so a step it takes builds two tensors, not five."""

    def __init__(self, chunks: list, block_size: int, device: torch.device) -> None:
        self._last = np.fromiter((c.start_pos for c in chunks), dtype=np.int64,
                                 count=len(chunks))
        self._tables = padded_block_tables(chunks, np.int32)
        self._block_size = block_size
        self._device = device
        self.cu_seqlens_q = torch.arange(len(chunks) + 1, dtype=torch.int32, device=device)
        self.seq_lens = to_device(torch.from_numpy((self._last + 1).astype(np.int32)), device)
        self.block_tables = to_device(torch.from_numpy(self._tables), device)
        self.max_query_len = 1
        self.is_decode_only = True
        self.token_seq_lens = self.token_block_tables = self.context_parallel = None

    @functools.cached_property
    def positions(self) -> torch.Tensor:  # type: ignore[override]
        return to_device(torch.from_numpy(self._last), self._device)

    @functools.cached_property
    def slot_mapping(self) -> torch.Tensor:  # type: ignore[override]
        last, size = self._last, self._block_size
        slots = (self._tables[np.arange(len(last)), last // size].astype(np.int64) * size
                 + last % size)
        return to_device(torch.from_numpy(slots), self._device)


def _verify_rows(chunks: list, query_lens: np.ndarray, positions: np.ndarray,
                 seq_of_token: np.ndarray, block_tables: np.ndarray, device: torch.device
                 ) -> dict[str, torch.Tensor]:
    """Per-token decode rows of a verify step: every chunk is 1 + num_draft_tokens tokens
    with some drafts. Token t of a chunk at position p attends to positions <= p: causal
    within the chunk, the whole context before it."""
    drafts = np.fromiter((c.num_draft_tokens for c in chunks), dtype=np.int64,
                         count=len(chunks))
    if not drafts.any() or not (query_lens == drafts + 1).all():
        return {}
    return {"token_seq_lens": to_device(torch.from_numpy((positions + 1).astype(np.int32)), device),
            "token_block_tables": to_device(torch.from_numpy(
                block_tables[seq_of_token].astype(np.int32)), device)}


def default_backend_name(device: torch.device) -> str:
    """PDSERVE_ATTENTION_BACKEND if set, else triton on CUDA and, on CPU, the compiled "cpu"
    backend (plain "torch" where its kernel cannot be built)."""
    from pdserve.serve.layers.ops import cpu_kernels

    chosen = envs.attention_backend()
    if chosen is not None:
        return chosen
    if device.type == "cuda":
        return "triton"
    return "cpu" if cpu_kernels() is not None else "torch"


class Attention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend_name: str) -> None:
        super().__init__()
        from pdserve.kernels import get_attention_backend  # lazy: Triton only when chosen

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: Any = get_attention_backend(backend_name)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], kv_cache [2, blocks, bs, Hkv, D] -> [T, H, D]."""
        if meta.context_parallel is not None:
            return meta.context_parallel.gqa_attention(query, key, value, kv_cache, self.scale,
                                                       self.backend)
        self.backend.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self.backend.decode_attention(
                query, kv_cache, meta.seq_lens, meta.block_tables, self.scale
            )
        return self.backend.prefill_attention(
            query, kv_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, self.scale,
            meta.max_query_len, key=key, value=value,
        )
