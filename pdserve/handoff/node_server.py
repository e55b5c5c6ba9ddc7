"""A worker's own data node: where its prefill hand-offs land, and whence decode reads them.

    prefill worker process                                   decode worker process
      engine ─► connector ─► HandoffNode (in process:        StoreClient(source) ─► get_many
                             put + pin, no copy, no hop)  ◄── over UCX (or ZeroMQ), one hop
                             └─ served by a data-role StoreServer on its own port

Mooncake's transfer engine reads KV from the memory of the node that computed it, and this
does the same with pdserve's own store parts: the node is a `pdserve store --role data`
server (pdserve/kvstore/server.py) running inside the worker, so decode workers reach it with the
ordinary StoreClient (UCX when both sides have it), leases pin a hand-off's blocks until the
decode worker has read them (or the lease expires), and then the node drops them (nothing
reads them again: the fleet store keeps the prefix), so their memory is reused warm. The
worker's connector calls it in process: a put adopts the staged blocks (no copy) and a pin
goes through the data service's own handler and locks.

While a prompt is staged its layers can be pulled as they land (get_layers, by a decode
worker following the prefill from another host: pdserve/kvstore/live_staging.py); a long poll holds
one of the node's threads, hence four. They run at nice 19: the sends over TCP cost the
sender's CPU, and on a busy core the prefill's forward goes first (its TTFT unchanged, the
layers crossing as it leaves room; docs/benchmarks.md has the numbers).

With `shm_bytes` the node stages prompts in a shared memory segment (pdserve/kvstore/shm_segment.py,
`allocate_staging`), and a decode worker on the same host copies them straight out of it: one
user-space copy, no UCX rendezvous, no kernel copy. A staging that does not fit there (or a
decode worker on another host) goes over UCX as before.

It is not registered with the fleet's master: the fleet store gets a write-back copy of every
saved prompt instead (pdserve/handoff/node.py), which later requests find there.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from pdserve.addresses import advertised
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.live_staging import LiveStagings
from pdserve.kvstore.memory_tier import BytesLike
from pdserve.kvstore.server import StoreServer
from pdserve.kvstore.service import Peer
from pdserve.protocol.store.data import PinRequest, ReleaseRequest, ShmSegment, ShmSpan

logger = logging.getLogger(__name__)

_LOCAL = Peer(b"in-process", [])
_request_ids = itertools.count(1)


class HandoffNode:
    """This worker's own data node: put, pin and release in process, served to decode
    workers on its own port (see the module docstring)."""

    def __init__(self, name: str, host: str, capacity_blocks: int, lease_ttl_s: float,
                 timeout_s: float, transport: str = "ucx", port: int = 0,
                 shm_bytes: int = 0) -> None:
        """`capacity_blocks` blocks of host DRAM, staged in a shared memory segment of
        `shm_bytes` (0: none) while it has room; served on `host`:`port` (0: any free)."""
        config = StoreConfig(role="data", host=host, data_port=port, node_id=name,
                             dram_capacity_blocks=capacity_blocks, transport=transport,
                             lease_ttl_s=lease_ttl_s, request_timeout_s=timeout_s,
                             num_data_threads=4, data_thread_nice=19,
                             shm_bytes=shm_bytes, drop_released=True)
        self.name = name
        self._server = StoreServer(config).start()
        assert self._server.data_service is not None and self._server.data_address
        self._service = self._server.data_service
        self._service.start_prober_early()
        self.address: str = advertised(self._server.data_address)
        """Where decode workers reach it: a wildcard bind is named by this host's address."""
        logger.info("hand-off node %s: %d blocks of DRAM at %s", name, capacity_blocks,
                    self.address)

    @property
    def stagings(self) -> LiveStagings:
        """The prompts this worker is staging now, which decode workers on other hosts pull
        layer by layer (pdserve/kvstore/live_staging.py)."""
        return self._service.stagings

    def allocate_staging(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` (uint8) in the node's shared memory segment, for a save to stage a prompt
        in; None without a segment or room in it. Freed once the tensor and its views are
        gone (the tiers keep views of the blocks put)."""
        shm = self._service.shm
        data = None if shm is None else shm.allocate(nbytes)
        return None if data is None else torch.from_numpy(data)

    @property
    def shm_segment(self) -> ShmSegment | None:
        shm = self._service.shm
        return None if shm is None else shm.segment

    def locate(self, blocks: Sequence[torch.Tensor]) -> list[ShmSpan] | None:
        """Where each block lies in the segment, for a hand-off to name; None unless all do."""
        shm = self._service.shm
        return None if shm is None else shm.locate_blocks(list(blocks))

    def set_progress(self, span: ShmSpan, value: int) -> None:
        """Publish how much of a staging in the segment is filled (ShmArena.set_progress)."""
        shm = self._service.shm
        if shm is not None:
            shm.set_progress(span.header, value)

    # ---- the connector's backend verbs, in process ------------------------------------------
    def put_many(self, keys: Sequence[bytes], blocks: Sequence[BytesLike]) -> list[bool]:
        """Keep `blocks` (nobody writes them after a save: adopted, not copied)."""
        return self._service.store.put_many(list(keys), list(blocks), adopt=True)

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        return self._service.store.get_many(list(keys))

    def pin(self, keys: Sequence[bytes], ttl_s: float) -> tuple[int, list[bool]]:
        answer = self._service.pin(
            PinRequest(next(_request_ids), list(keys), self.name, ttl_s), _LOCAL)
        reply = answer.reply
        return reply.lease_id, list(reply.pinned)

    def release(self, lease_id: int) -> bool:
        answer = self._service.release(ReleaseRequest(next(_request_ids), lease_id), _LOCAL)
        return bool(answer.reply.known)

    # ---- what tests and metrics look at -----------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        return self._service.store.num_pinned_blocks

    @property
    def num_leases(self) -> int:
        return self._service.leases.num_leases

    @property
    def num_shm_allocations(self) -> int:
        """Live allocations in the shared memory segment (0 without one)."""
        shm = self._service.shm
        return 0 if shm is None else shm.num_allocations

    def check_integrity(self) -> None:
        self._server.check_integrity()

    def close(self, timeout_s: float = 5.0) -> None:
        self._server.stop(timeout_s)
