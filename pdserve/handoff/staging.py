"""A decode worker's view of the prefill workers' staging on its host: their hand-off nodes'
shared memory segments (pdserve/kvstore/shm_segment.py), mapped read-only, and the blocks in them.

    prefill worker: save_layer stages each layer in its node's segment (the connector)
      │  the hand-off (or, while it stages, Output.staging) names the segment and spans
      ▼
    decode worker: map_blocks / map_staging here ─► views per layer, copied into its pool

A segment that cannot be mapped here (another host or container, not allowed) is remembered
as such, and hand-offs from it load over the network; segments of prefill workers that are
gone are unmapped (a mapping would keep their memory alive). Main thread only.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pdserve.kvstore.shm_segment import ShmReader
from pdserve.protocol.store.data import ShmSegment, ShmSpan

logger = logging.getLogger(__name__)

MAX_MAPPED_SEGMENTS = 256

# [n, num_layers, P, block_size, H, D] as flat bytes -> per layer [P, n, block_size, h, D]
ToLayers = Callable[[torch.Tensor, int], list[torch.Tensor]]
# whole stored blocks -> per layer [P, n, block_size, h, D]
PerLayer = Callable[[Sequence[np.ndarray]], list[torch.Tensor]]


class SegmentMaps:
    """The segments of prefill workers on this host, mapped read-only, and views of the
    blocks or stagings in them (see the module docstring)."""

    def __init__(self, block_bytes: int, to_layers: ToLayers, per_layer: PerLayer) -> None:
        self.block_bytes = block_bytes
        self._to_layers = to_layers
        self._per_layer = per_layer
        # segments of prefill workers on this host, mapped (None: cannot be)
        self._segments: OrderedDict[tuple[int, int, int], ShmReader | None] = OrderedDict()

    def _reader(self, segment: ShmSegment) -> ShmReader | None:
        key = (segment.pid, segment.fd, segment.inode)
        if key not in self._segments:
            self._drop_gone_segments()
            try:
                self._segments[key] = ShmReader(segment)
                logger.info("kv connector: hand-offs from process %d are copied in place, out "
                            "of its shared memory segment", segment.pid)
            except OSError as e:  # another host or container, or not allowed: load instead
                logger.info("kv connector: cannot map the segment of process %d (%s); "
                            "hand-offs from it load over the network", segment.pid, e)
                self._segments[key] = None
            while len(self._segments) > MAX_MAPPED_SEGMENTS:
                _, old = self._segments.popitem(last=False)
                if old is not None:
                    old.close()
        return self._segments[key]

    def map_blocks(self, segment: ShmSegment, spans: list[ShmSpan]
                   ) -> tuple[list[torch.Tensor], Callable[[], bool]] | None:
        """Blocks that lie in another process's segment on this host (a prefill worker's
        hand-off), in place: per layer, and a check to call once they were copied (False: one
        was freed meanwhile, the copy is not the blocks). None where the segment cannot be
        mapped here or a block is gone already."""
        reader = self._reader(segment)
        if reader is None:
            return None
        try:
            run = reader.run(spans, self.block_bytes)  # a save's blocks: one run
            blocks = None if run is not None else reader.views(spans, self.block_bytes)
        except ValueError as e:
            logger.warning("kv connector: a hand-off names blocks outside its segment (%s)", e)
            return None
        with warnings.catch_warnings():
            # the mapping is read-only, and its views are only ever read (copied from)
            warnings.simplefilter("ignore", UserWarning)
            if run is not None:
                layers = self._to_layers(torch.from_numpy(run), len(spans))
            elif blocks is not None:
                layers = self._per_layer(blocks)
            else:  # freed already
                return None
        return layers, lambda: all(reader.intact(spans))

    def staging_spans(self, span: ShmSpan, num_blocks: int) -> list[ShmSpan]:
        """Each block's span in a staging whose first block lies at `span` (back to back, one
        allocation): what the save's hand-off will name."""
        return [ShmSpan(span.offset + i * self.block_bytes, span.header, span.serial)
                for i in range(num_blocks)]

    def map_staging(self, segment: ShmSegment, span: ShmSpan, num_blocks: int
                    ) -> tuple[list[torch.Tensor], Callable[[], int], Callable[[], bool]] | None:
        """A save that another process on this host is staging now (its connector announced
        it): per layer as map_blocks gives them, how many layers are staged so far, and the
        check to make once copied. None where it cannot be mapped or is gone already."""
        mapped = self.map_blocks(segment, self.staging_spans(span, num_blocks))
        reader = self._segments.get((segment.pid, segment.fd, segment.inode))
        if mapped is None or reader is None:
            return None
        layers, intact = mapped
        return layers, lambda: reader.progress(span), intact

    def _drop_gone_segments(self) -> None:
        """Unmap the segments of prefill workers that are gone (a mapping would keep their
        memory alive)."""
        for key, reader in list(self._segments.items()):
            pid, fd, inode = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
            except OSError:
                alive = False
            if not alive:
                del self._segments[key]
                if reader is not None:
                    reader.close()

    def close(self) -> None:
        for reader in self._segments.values():
            if reader is not None:
                reader.close()
        self._segments.clear()
