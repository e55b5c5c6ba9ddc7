"""The tensor-parallel process group: how the ranks start it, and each rank's place in it.

    rank 0 (engine process)              ranks 1..N-1 (spawned by serve/model_runner.py)
    Rendezvous: hosts the TCPStore ◄──── Rendezvous: connects to it
    init_tp_group:                       init_tp_group:
      arrive_and_wait("started") ◄─────►   arrive_and_wait("started")
      dist.init_process_group    ◄─────►   dist.init_process_group   (collectives time out)
      -> TPGroup(rank=0, size=N)           -> TPGroup(rank=r, size=N)

`TPGroup` is the value the parallel layers (serve/parallel.py) and the models are handed to
know their shard and to all-reduce. This module holds no nn layers.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts placed whole on ranks (ParallelConfig)

    def __post_init__(self) -> None:
        if self.size <= 0 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP rank {self.rank} of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
                   ) -> torch.Tensor:
        """Rows x[sum(send_counts[:r]) : ...] go to rank r; returns the rows every rank sent
        here, in rank order (recv_counts[r] from rank r)."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        if self.size == 1:
            return out.copy_(x)
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
        return out


class Rendezvous:
    """The TP group's key-value store (hosted by rank 0) and the stages every rank passes.

    Starting can take long (spawning, importing torch, reading a big checkpoint), far longer
    than a collective should ever wait, so the start is synchronised here with its own
    timeout and not with collectives. Rank 0 polls `peers_alive`, so a worker that dies
    while starting fails the wait at once; workers notice a dead rank 0 by its store closing.
    """

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int,
                 start_timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.start_timeout_s = start_timeout_s
        self.store = dist.TCPStore(
            master_addr, master_port, world_size=size, is_master=rank == 0,
            timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False,
        )

    def arrive_and_wait(self, stage: str, peers_alive: Callable[[], bool] | None = None
                        ) -> None:
        """Mark this rank at `stage`, then wait until every rank is there."""
        self.store.set(f"pdserve/{stage}/{self.rank}", "1")
        keys = [f"pdserve/{stage}/{r}" for r in range(self.size)]
        if self.rank != 0:
            self.store.wait(keys)  # bounded by the store's timeout
            return
        deadline = time.monotonic() + self.start_timeout_s
        while not self.store.check(keys):
            if peers_alive is not None and not peers_alive():
                raise RuntimeError(f"a tensor-parallel worker died before {stage!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP workers did not reach {stage!r} within "
                                   f"{self.start_timeout_s:.0f} s")
            time.sleep(0.05)


def init_tp_group(rendezvous: Rendezvous | None, backend: str, timeout_s: float,
                  peers_alive: Callable[[], bool] | None = None) -> TPGroup:
    """Join the process group (None: a single rank); every collective times out."""
    if rendezvous is None or rendezvous.size == 1:
        return TPGroup(rank=0, size=1)
    rendezvous.arrive_and_wait("started", peers_alive)
    dist.init_process_group(backend=backend, store=rendezvous.store, rank=rendezvous.rank,
                            world_size=rendezvous.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank=rendezvous.rank, size=rendezvous.size)
