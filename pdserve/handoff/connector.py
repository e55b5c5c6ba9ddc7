"""The hand-off connector: the store connector (pdserve/kvstore/connector.py) whose saves and
loads go through a hand-off transport (pdserve/handoff/base.py).

    prefill: save_layer ─► transport.staging_buffer / begin_save / save_layer (per layer)
                        └► transport.finish (every layer staged) ─► TransferResult: the offer
    decode:  start_load(source) ─► transport.receive ─► TransferResult.layers ─► install
             start_pull ─► transport.receive_layers (per step) ─► LayerPull.take
             release(lease, source) ─► transport.release

With a worker's own data node (the "node" transport) a save lands there, in process and pinned
under a lease, and the hand-off names that node (`source`), so the decode worker reads the
blocks straight from the prefill worker's memory, one hop; the fleet store (`backend`) gets a
write-back copy off the critical path, and a decode worker that cannot reach the source loads
from it instead. With the "store" transport saves go to the fleet store directly (two hops).
A node with a shared memory segment stages saves in it, and a decode worker on the same host
maps them (pdserve/handoff/staging.py). A save staging in a node is announced (`on_staged`),
for a decode worker to follow it layer by layer.

Loads, saves, pulls and releases run on one background thread (but a save into this worker's
own node, in process, runs as its last layer is staged); the fills of the fleet store on a
second one at the lowest priority (the store connector's).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from pdserve.handoff.base import HandoffTransport
from pdserve.handoff.layer_pull import LayerPull
from pdserve.handoff.staging import SegmentMaps
from pdserve.kvstore.block_key import KVLayout
from pdserve.kvstore.connector import (
    BlockBackend,
    Save,
    StoreConnector,
    TransferResult,
)
from pdserve.kvstore.live_staging import StagingPlace
from pdserve.kvstore.memory_tier import BytesLike
from pdserve.kvstore.tiered_store import TieredStore

logger = logging.getLogger(__name__)


# (request id, where, every layer staged) -> whether it was announced
OnStaged = Callable[[str, StagingPlace, bool], bool]


class HandoffConnector(StoreConnector):
    """A worker's connector when it hands KV off: saves are offered through its transport,
    loads read the node a hand-off names, stagings can be followed and pulled."""

    def __init__(self, backend: BlockBackend | None, layout: KVLayout, tp_rank: int = 0,
                 tp_size: int = 1, timeout_s: float = 10.0, lease_ttl_s: float | None = None,
                 handoff_node: Any = None,
                 connect: Callable[[str], BlockBackend] | None = None,
                 on_staged: OnStaged | None = None,
                 transport: HandoffTransport | None = None) -> None:
        """`backend`, `lease_ttl_s`: see StoreConnector. `transport`: how saves are offered
        and loads read (pdserve/handoff/registry.py make_transport); without it, "node" over
        `handoff_node` (this worker's own data node, a HandoffNode) when given, else "store",
        with `connect(address)` opening a client to another worker's node, the source of a
        load. `on_staged`: called (on the forward's thread) when a save into a node starts
        staging: (request id, its StagingPlace, False); the node's live stagings (and the
        staging's header, where it lies in the node's segment) then count the layers staged,
        for a decode worker to follow. If it returns False (not announced now), it is called
        again, with True, once every layer is staged."""
        from pdserve.handoff.registry import make_transport

        super().__init__(backend, layout, tp_rank, tp_size, timeout_s, lease_ttl_s)
        self.transport: HandoffTransport = transport or make_transport(
            "node" if handoff_node is not None else "store", backend, connect, handoff_node)
        self._on_staged = on_staged
        self.segments = SegmentMaps(self.block_bytes, self._layers, self._per_layer)
        """Other workers' staging on this host, mapped (main thread only)."""
        self._staging_ids = itertools.count(1)

    @property
    def handoff_node(self) -> Any:
        """This worker's own data node, where saves land (None: the fleet store)."""
        return self.transport.node

    # ---- prefill: the store connector's hooks, through the transport -------------------------
    @property
    def _puts_in_process(self) -> bool:  # type: ignore[override]
        return self.transport.offers_in_process

    def _staging(self, num_blocks: int, pinned: bool) -> torch.Tensor:
        """Host memory for a save's blocks: in the transport's buffer (a node's shared memory
        segment, whence a decode worker on this host copies them) where it has room, else
        plain (pinned for a CUDA pool's asynchronous copies)."""
        if not pinned:
            data = self.transport.staging_buffer(num_blocks * self.block_bytes)
            if data is not None:
                return data.view(self.dtype).view(num_blocks, *self.block_shape)
        return super()._staging(num_blocks, pinned)

    def _save_started(self, request_id: str, save: Save) -> None:
        save.staging_id = next(self._staging_ids)
        self.transport.begin_save(save)
        self._announce(request_id, save)

    def _layers_staged(self, request_id: str, save: Save, num_staged: int, event: Any) -> None:
        self.transport.save_layer(save, num_staged, event)
        if save.announce_when_staged and num_staged == self.layout.num_layers:
            self._announce(request_id, save, staged=True)

    def _announce(self, request_id: str, save: Save, staged: bool = False) -> None:
        """A save staging in the node: say where (on_staged), so that a decode worker can
        copy each layer as it is counted, from the node's segment on this host or pulled
        from the node elsewhere (`staged`: the second call, every layer is)."""
        node = self.transport.node
        if self._on_staged is None or node is None:
            return
        segment = self.transport.staging_segment
        if save.span is None and segment is not None:
            spans = self.transport.locate([save.staging.view(-1)])
            save.span = spans[0] if spans is not None else None  # (None: it was full)
        place = StagingPlace(save.keys, node.address, save.staging_id,
                             segment if save.span is not None else None, save.span)
        try:
            announced = self._on_staged(request_id, place, staged)
        except Exception as e:  # only an optimisation: the hand-off still says where
            logger.warning("kv connector: announcing the staging of %s failed (%s)",
                           request_id, e)
            return
        save.announce_when_staged = not announced and not staged

    def _offer(self, request_id: str, keys: list[bytes], blocks: list[torch.Tensor]
               ) -> TransferResult:
        """Offer the staged blocks where decode reads them (the transport's), pinned."""
        offer = self.transport.finish(keys, blocks, self.lease_ttl_s)
        return TransferResult(request_id, "save", offer.num_stored, offer.error,
                              offer.lease_id, offer.source, shm_segment=offer.shm_segment,
                              shm_spans=offer.shm_spans, write_back=offer.write_back)

    def _end_staging(self, save: Save) -> None:
        self.transport.end_save(save)

    # ---- decode --------------------------------------------------------------------------------
    def _fetch(self, keys: list[bytes], source: str) -> list[BytesLike]:
        """The blocks from the data node at `source` (a prefill worker's), else (or when that
        fails) from the fleet store."""
        return self.transport.receive(keys, source, self.block_bytes)

    def _release(self, lease_id: int, source: str) -> None:
        self.transport.release(lease_id, source)

    # ---- pull (decode, following a prefill on another host) --------------------------------
    def start_pull(self, source: str, staging_id: int, keys: list[bytes], first_block: int,
                   paused: bool = False) -> LayerPull:
        """Pull the layers of a prompt the node at `source` is staging now (its blocks `keys`,
        from the staging's block `first_block` on) as they land, in the background: the
        returned pull's `take` gives them, per layer, and the wake-up fd says when.
        `paused`: not before resume_pull."""
        pull = LayerPull(source, staging_id, keys, first_block, self.block_shape, self.dtype,
                         self._pulled_layers)
        if paused:
            pull.pause()
        else:
            self.resume_pull(pull)
        return pull

    def resume_pull(self, pull: LayerPull) -> None:
        """Go on with a paused pull (a no-op for one under way)."""
        if pull.resume():
            self._jobs.put(lambda: self._pull(pull))

    def _pull(self, pull: LayerPull) -> None:
        if not pull.may_step():
            return
        go_on = self.transport.receive_layers(pull)
        self._wake()
        if go_on:  # behind the jobs queued meanwhile
            self._jobs.put(lambda: self._pull(pull))
        else:
            pull.stopped()

    def _pulled_layers(self, payload: torch.Tensor, num_blocks: int,
                       num_layers: int) -> list[torch.Tensor]:
        """[n, layers, P, block_size, H, D] (flat bytes) -> per layer [P, n, block_size, this
        rank's h, D], views."""
        data = payload.view(self.dtype).view(num_blocks, num_layers, *self.block_shape[1:])
        return [data[:, j, :, :, self._heads].transpose(0, 1) for j in range(num_layers)]

    def _closed(self) -> None:
        self.transport.close()
        self.segments.close()


def make_in_process_connector(layout: KVLayout, dram_capacity_blocks: int,
                              disk_capacity_blocks: int = 0, disk_dir: str | None = None,
                              **kwargs: Any) -> HandoffConnector:
    """A connector over a private in-process TieredStore (tests, single-process runs)."""
    store = TieredStore.build(dram_capacity_blocks, disk_capacity_blocks, disk_dir)
    return HandoffConnector(store, layout, **kwargs)
