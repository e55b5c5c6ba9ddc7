"""The worker's process group: how its ranks meet (on one host or several), and each rank's
place in it.

    node 0                                    node k > 0 (same CLI, --node-rank k)
    rank 0 (engine process)                   ranks k*R .. k*R+R-1 (R = ranks per node)
    Rendezvous: hosts the TCPStore ◄───────── Rendezvous: connects to master_addr:master_port
    ranks 1..R-1 (spawned, connect) ◄──┐      (a missing node 0: an error after join_timeout_s)
    init_tp_group:                     │      init_tp_group:
      arrive_and_wait("started") ◄─────┴────►   arrive_and_wait("started")
        (a missing node: an error naming it, after join_timeout_s)
      dist.init_process_group    ◄──────────►   dist.init_process_group (collectives time out)
      -> TPGroup(rank=0, size=N)                -> TPGroup(rank=r, size=N)
    lost_ranks(): whose beat stopped ◄───────── start_beating(): a counter in the store

Collectives go over gloo on CPU and NCCL on GPU, between whatever addresses the ranks'
interfaces have (ParallelConfig.dist_interface picks one); the store is only the meeting
point, and afterwards the place where every non-zero rank's liveness counter ticks, so that
when a collective fails rank 0 can say which rank (and node) is gone rather than "connection
reset". `TPGroup` is the value the parallel layers (pdserve/serve/layers/parallel.py) and the
models are handed to know their shard and to all-reduce. This module holds no nn layers.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

BEAT_INTERVAL_S = 0.5
"""How often a non-zero rank ticks its liveness counter in the rendezvous store."""
LOST_AFTER_S = 4 * BEAT_INTERVAL_S
"""After a collective failed: a rank whose counter did not move for this long is the lost one."""
SILENT_AFTER_S = 10.0
"""With no failure seen (the idle heartbeat's check): a rank silent this long is lost. Longer,
so that a live rank starved of CPU for a moment is never declared dead."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts placed whole on ranks (ParallelConfig)
    expert_capacity_factor: float | None = None  # MoE tokens per expert cap (ParallelConfig)
    group: Any = field(default=None, compare=False, repr=False)
    """The torch.distributed group of these ranks; None: the whole world (a pipeline stage's
    TP ranks have a subgroup of their own, pdserve/serve/layers/pipeline.py)."""

    def __post_init__(self) -> None:
        if self.size <= 0 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP rank {self.rank} of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
                   ) -> torch.Tensor:
        """Rows x[sum(send_counts[:r]) : ...] go to rank r; returns the rows every rank sent
        here, in rank order (recv_counts[r] from rank r)."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        if self.size == 1:
            return out.copy_(x)
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts,
                               group=self.group)
        return out


class RendezvousError(RuntimeError):
    """The ranks could not meet: a node that is missing or unreachable, a rank that died."""


class Rendezvous:
    """The worker's key-value store (hosted by rank 0, on node 0) and the stages every rank
    passes.

    Starting can take long (spawning, importing torch, reading a big checkpoint), far longer
    than a collective should ever wait, so the start is synchronised here with its own
    timeouts and not with collectives: `join_timeout_s` for every rank to show up (a node
    that was never started fails here, named), `start_timeout_s` for the later stages
    (loading). Rank 0 polls `peers_alive`, so a local rank that dies while starting fails the
    wait at once; other ranks notice a dead rank 0 by its store closing.
    """

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int,
                 start_timeout_s: float, join_timeout_s: float | None = None,
                 ranks_per_node: int | None = None) -> None:
        self.rank = rank
        self.size = size
        self.master_addr = master_addr
        self.master_port = master_port
        self.start_timeout_s = start_timeout_s
        self.join_timeout_s = join_timeout_s if join_timeout_s is not None else start_timeout_s
        self.ranks_per_node = ranks_per_node or size
        self._stop_beating = threading.Event()
        self._beats_seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it moved)
        self._beats_lock = threading.Lock()
        try:
            # A client retries its connection until the timeout: node 0 may start later.
            self.store = dist.TCPStore(
                master_addr, master_port, world_size=size, is_master=rank == 0,
                timeout=datetime.timedelta(seconds=self.join_timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            reason = (str(exc) or type(exc).__name__).splitlines()[0]  # not torch's C++ frames
            if rank == 0:
                raise RendezvousError(f"cannot host the rendezvous on port {master_port}: "
                                      f"{reason}") from None
            raise RendezvousError(
                f"rank {rank} (node {self.node_of(rank)}) could not reach the rendezvous at "
                f"{master_addr}:{master_port} within {self.join_timeout_s:.0f} s: is node 0 "
                f"running with --master-port {master_port}, and is the address reachable "
                f"from here? ({reason})") from None
        if rank == 0:
            self.master_port = self.store.port  # the kernel's pick when master_port is 0
        # Rank 0 serves the store and every other rank's collectives time out: after the
        # join, the store may wait as long as the slowest stage (loading) takes.
        self.store.set_timeout(datetime.timedelta(seconds=start_timeout_s))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def describe_ranks(self, ranks: list[int]) -> str:
        """'rank 3 (node 1)', 'ranks 2, 3 (node 1)', ... grouped by node."""
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.node_of(r), []).append(r)
        return "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} (node {node})"
            for node, rs in sorted(by_node.items()))

    def arrive_and_wait(self, stage: str, peers_alive: Callable[[], bool] | None = None,
                        timeout_s: float | None = None) -> None:
        """Mark this rank at `stage`, then wait until every rank is there (within timeout_s,
        default start_timeout_s)."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        self.store.set(f"pdserve/{stage}/{self.rank}", "1")
        keys = [f"pdserve/{stage}/{r}" for r in range(self.size)]
        if self.rank != 0:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
            except RuntimeError as exc:  # rank 0 gone (store closed) or the wait timed out
                raise RendezvousError(f"rank {self.rank}: the other ranks did not reach "
                                      f"{stage!r} within {timeout_s:.0f} s ({exc})") from None
            return
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if peers_alive is not None and not peers_alive():
                raise RendezvousError(f"a tensor-parallel worker died before {stage!r}")
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size)
                           if not self.store.check([f"pdserve/{stage}/{r}"])]
                hint = ""
                if any(self.node_of(r) != 0 for r in missing):
                    nodes = sorted({self.node_of(r) for r in missing} - {0})
                    hint = (f": start node{'s' if len(nodes) > 1 else ''} "
                            f"{', '.join(map(str, nodes))} with the same command and "
                            f"--node-rank, --master-addr {self.master_addr} "
                            f"--master-port {self.master_port}")
                raise RendezvousError(f"{self.describe_ranks(missing)} did not reach "
                                      f"{stage!r} within {timeout_s:.0f} s{hint}")
            time.sleep(0.05)

    # ---- liveness: which rank is gone when a collective fails ---------------------------

    def start_beating(self) -> None:
        """A non-zero rank: tick pdserve/beat/<rank> in the store until this process ends
        (a daemon thread on a connection of its own)."""
        if self.rank == 0:
            return
        threading.Thread(target=self._beat_loop, name="pdserve-rank-beat",
                         daemon=True).start()

    def stop_beating(self) -> None:
        self._stop_beating.set()

    def _beat_loop(self) -> None:
        key = f"pdserve/beat/{self.rank}"
        try:
            store = dist.TCPStore(self.master_addr, self.master_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=10))
            while True:
                store.add(key, 1)
                if self._stop_beating.wait(BEAT_INTERVAL_S):
                    return
        except Exception:  # rank 0 and its store are gone: nobody to tell
            return

    def lost_ranks(self, wait_s: float = LOST_AFTER_S + BEAT_INTERVAL_S,
                   lost_after_s: float = LOST_AFTER_S) -> list[int]:
        """Rank 0: the ranks whose beat has not moved for lost_after_s (since this process
        first looked), watching up to `wait_s` more for a rank that just died to show it.
        Safe from two threads (the heartbeat's and the engine's)."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            lost = []
            with self._beats_lock:
                for r in range(1, self.size):
                    count = self.store.add(f"pdserve/beat/{r}", 0)
                    seen, moved_at = self._beats_seen.get(r, (-1, now))
                    if count != seen:
                        self._beats_seen[r] = (count, now)
                    elif now - moved_at >= lost_after_s:
                        lost.append(r)
            if lost or now >= deadline:
                return lost
            time.sleep(BEAT_INTERVAL_S / 2)


def init_tp_group(rendezvous: Rendezvous | None, backend: str, timeout_s: float,
                  peers_alive: Callable[[], bool] | None = None) -> TPGroup:
    """Join the process group (None: a single rank); every collective times out."""
    if rendezvous is None or rendezvous.size == 1:
        return TPGroup(rank=0, size=1)
    rendezvous.arrive_and_wait("started", peers_alive, rendezvous.join_timeout_s)
    dist.init_process_group(backend=backend, store=rendezvous.store, rank=rendezvous.rank,
                            world_size=rendezvous.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    rendezvous.start_beating()
    return TPGroup(rank=rendezvous.rank, size=rendezvous.size)
