"""The "node" hand-off transport: a prefill's prompt lands in the worker's own data node.

    prefill worker                                         decode worker
    save_layer: staged in the node's shared memory  ──►   same host: copied straight out of
      segment (live staging: followers count layers)       the segment (admission InPlace,
    finish: put + pin in the node, in process               or Followed as it stages)
      (no copy, no hop); write-back to the fleet store  other host: receive (UCX, or ZeroMQ
      off the critical path                                 frames), one hop; receive_layers
                                                            pulls each layer as it lands

The node (pdserve/handoff/node_server.py) is a data-role store server inside the worker.
Chosen with `--kv-handoff node` (the default where `--handoff-dram-gb` > 0); its same-host
segment with `--handoff-shm`, and the following of a staging with `--handoff-follow`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.handoff.base import Offer
from pdserve.handoff.store import StoreHandoff
from pdserve.kvstore.connector import Save
from pdserve.protocol.store.data import ShmSegment, ShmSpan

logger = logging.getLogger(__name__)


class NodeHandoff(StoreHandoff):
    """Offers land in this worker's own data node (in process, no copy), and a write-back copy
    goes to the fleet store; a node with a shared memory segment stages prompts in it, and
    every staging can be followed layer by layer (its live stagings)."""

    name = "node"
    needs_node = True
    offers_in_process = True

    def _target(self) -> Any:
        return self.node

    def _on_the_wire(self, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Raw (adopted, no copy), or each block FP8-encoded (`--handoff-wire fp8`): decode
        workers read the offer over a slow link at 1 byte a value; the write-back to the
        fleet store keeps the raw blocks."""
        if self.wire is None:
            return blocks
        return [self.wire.encode(block) for block in blocks]

    def _offered(self, num_stored: int, lease_id: int | None, spans: list[ShmSpan] | None,
                 error: str | None, keys: list[bytes], blocks: list[torch.Tensor]) -> Offer:
        assert self.node is not None
        backend, write_back = self.backend, None
        if backend is not None and num_stored:
            keys, blocks = keys[:num_stored], blocks[:num_stored]

            def write_back() -> None:
                try:
                    backend.put_many(keys, blocks)
                except Exception as e:  # the store is a cache: the prefix is just not kept
                    logger.warning("kv connector: write-back of %d blocks failed (%s)",
                                   len(keys), e)

        return Offer(num_stored, error, lease_id, self.node.address,
                     self.node.shm_segment if spans else None, spans, write_back)

    # ---- prefill side: stagings a decode worker can follow ---------------------------------
    def staging_buffer(self, nbytes: int) -> torch.Tensor | None:
        assert self.node is not None
        return self.node.allocate_staging(nbytes)

    def begin_save(self, save: Save) -> None:
        """Register the staging (pulled layer by layer by a decode worker elsewhere)."""
        assert self.node is not None
        self.node.stagings.begin(save.staging_id, save.keys, save.staging,
                                 save.staging.shape[1])

    def save_layer(self, save: Save, num_staged: int, event: Any = None) -> None:
        """Count the layers staged: in the segment's allocation header (same host) and in
        the node's live stagings (pulls)."""
        assert self.node is not None
        if save.span is not None:
            self.node.set_progress(save.span, num_staged)
        if save.staging_id:
            self.node.stagings.progress(save.staging_id, num_staged, event)

    def end_save(self, save: Save) -> None:
        assert self.node is not None
        if save.staging_id:
            self.node.stagings.end(save.staging_id)

    @property
    def staging_segment(self) -> ShmSegment | None:
        assert self.node is not None
        return self.node.shm_segment

    def locate(self, blocks: Sequence[torch.Tensor]) -> list[ShmSpan] | None:
        assert self.node is not None
        return self.node.locate(blocks)

    @property
    def num_leases(self) -> int:
        assert self.node is not None
        return self.node.num_leases
