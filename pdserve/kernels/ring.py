"""The ring: every rank's payload (a list of tensors) rotates around a torch.distributed group,
each rank visiting every payload once while the next is already in flight.

    step s on rank r:   visit(payload of rank (r - s) mod N)
                        meanwhile isend it to rank r + 1, irecv the next from rank r - 1

N - 1 transfers later every rank has visited every payload. Nothing here knows what the
payload means: ring attention (pdserve/kernels/ring_attention.py) sends K/V blocks, pdserve's
context parallelism (pdserve/serve/executor/context_parallel.py) its own K/V or latent blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

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
