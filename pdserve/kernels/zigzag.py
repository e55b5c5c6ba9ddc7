"""The zig-zag split of a context-parallel prompt, so that causal work is even: the tokens cut
into 2 * CP chunks, and rank r takes chunk r and chunk 2 * CP - 1 - r (an early, cheap chunk
and a late, dear one):

    CP 2:  chunks  0 1 2 3        rank 0: 0 + 3     rank 1: 1 + 2
    CP 4:  chunks  0 1 2 3 4 5 6 7
           rank    0 1 2 3 3 2 1 0
"""

from __future__ import annotations

import torch


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
