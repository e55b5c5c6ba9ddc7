"""Block attention on torch's CPU flash kernel (the "cpu" implementation of the registry's
block_attention op; the contract is pdserve/kernels/reference.py block_attention's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .partials import empty_partial, merge_attention
from .reference import block_attention as block_attention_reference
from .reference import check_block_attention


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention_reference's result from torch's CPU flash kernel, which returns the
    lse beside the output and never materialises the scores.

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
