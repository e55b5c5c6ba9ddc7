"""Ring attention: causal attention over a sequence whose tokens are split over the ranks of a
context-parallel (CP) group, K/V blocks rotating around the ring (Liu et al., Ring Attention).

Every rank holds its queries (a zig-zag share, pdserve/kernels/zigzag.py) and its own K/V block. In
step s it attends its queries to the block that started on rank (r - s) mod CP, while the
ring (pdserve/kernels/ring.py) already passes that block on. Each step gives a partial (out, lse),
folded into the running result by merge_attention (pdserve/kernels/partials.py), so the order of
blocks does not matter. A block whose first key lies after the rank's last query is skipped
(causal: it is all in the future).

The unit of compute is block attention (q chunk x K/V chunk -> (out, lse), full or causal by
absolute positions), an op of the kernel registry (pdserve/kernels/registry.py): the plain-torch
reference (pdserve/kernels/reference.py block_attention), torch's CPU flash kernel
(pdserve/kernels/cpu_block_attention.py) or Triton's (pdserve/kernels/block_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .partials import BlockAttention, empty_partial, merge_attention
from .reference import block_attention as block_attention_reference
from .ring import ring_pass


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
