"""Partial attention results and their merge: (out, lse) over a subset of the keys.

A partial of queries [T, H] over some keys is out [T, H, Dv] (the softmax-weighted values over
those keys) and lse [T, H] (the log of the softmax's denominator), both fp32. Two partials over
disjoint keys fold into the partial over both with the online-softmax rescale:

    lse = log(e^lse_a + e^lse_b)
    out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)

so the order of the parts does not matter; a part with lse -inf (it saw no key) is the
identity. Ring attention (pdserve/kernels/ring_attention.py) and a context-parallel decode
(pdserve/serve/executor/context_parallel.py) merge this way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BlockAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""The block attention op (pdserve/kernels/registry.py "block_attention"):
(q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], scale, q_pos=None, k_pos=None)
-> (out [Tq, H, Dv] fp32, lse [Tq, H] fp32)."""


def empty_partial(q: torch.Tensor, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, lse) of attending to nothing: zeros and -inf, the merge's identity."""
    return (q.new_zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float32),
            q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32))



def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partials of the same queries over disjoint keys -> the partial over both
    (out [T, H, D] and lse [T, H], fp32). A side with lse -inf contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = finite_lse(lse)
    weight_a = torch.exp(lse_a - base)[..., None]
    weight_b = torch.exp(lse_b - base)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials stacked on a leading axis (one per rank: outs [R, T, H, D], lses [R, T, H],
    as an all-gather returns them) -> one partial."""
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - finite_lse(lse)[None])[..., None]  # [R, T, H, 1]
    return (outs * weights).sum(dim=0), lse
