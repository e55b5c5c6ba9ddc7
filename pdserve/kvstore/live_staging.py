"""The prompts a hand-off node's worker is staging now, for decode workers on other hosts to
pull layer by layer while the prefill runs (GetLayersRequest, the network follow).

    prefill worker (its forward's thread)           hand-off node (a data thread)
    save_layer l: layer l's blocks copied to the    get_layers(staging, first_layer): wait
      staging, then progress(id, l + 1) ──────────►   until a layer past first_layer is
    save done: its blocks put in the node            staged, gather those layers of the
      (adopted, no copy), then end(id)               asked blocks into one buffer, send it

A save announces where it stages (StagingPlace, sent on as protocol/worker.py's KVStaging).
A staging is read only up to the layers its progress counts, which are written before it is
counted and never written again. Once it ended, its blocks are in the node's store under the
same keys (pinned by the hand-off's lease until decode releases it), and a pull reads what is
left from there: only the ended staging's own keys, at their place (the node remembers the
keys of its last stagings), so a request cannot read other blocks the node holds or ask for
more than the staging had. An aborted staging is in neither, and the pull is told it is gone.
On CUDA each layer's copy to the host staging is asynchronous: its event is waited on (by the
node's thread, never the forward's) before the layer is read.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.kvstore.memory_tier import BytesLike, as_uint8_tensor, back_to_back_runs, run_view
from pdserve.protocol.store.data import GetLayersRequest, ShmSegment, ShmSpan

MAX_LIVE_STAGINGS = 4096  # a worker stages one per prompt in its batch; far more is a leak
MAX_ENDED_KEYS = 1 << 20
"""Keys of ended stagings remembered (the oldest staging forgotten first): a pull that comes
after its staging was forgotten is told it is gone, and its hand-off loads the usual way."""


@dataclass
class _Staging:
    keys: list[bytes]
    blocks: torch.Tensor  # [n, num_layers, layer bytes] uint8, host memory
    num_staged: int = 0  # leading layers staged
    events: list[Any] = field(default_factory=list)  # CUDA: each staged layer's copy


@dataclass(frozen=True)
class StagingPlace:
    """Where a save is staging a prompt while the forward runs: what a decode worker needs to
    follow it layer by layer."""

    keys: list[bytes]
    source: str
    """The worker's hand-off node: a decode worker elsewhere pulls each layer from it as it
    lands (GetLayersRequest, pdserve/kvstore/live_staging.py)..."""
    staging_id: int
    """...naming the staging so."""
    segment: ShmSegment | None = None
    """Same host: the node's shared memory segment, when the staging lies in it, whose
    allocation header at `span` counts the layers staged (None: pull only)."""
    span: ShmSpan | None = None


class LiveStagings:
    """staging id -> a save in progress in this process (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stagings: dict[int, _Staging] = {}
        self._ended: OrderedDict[int, list[bytes]] = OrderedDict()  # oldest first
        self._num_ended_keys = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._stagings)

    def begin(self, staging_id: int, keys: Sequence[bytes], staging: torch.Tensor,
              num_layers: int) -> None:
        """A save started: `staging` holds its blocks (every layer of one block back to
        back), filled a layer at a time."""
        blocks = staging.view(torch.uint8).view(len(keys), num_layers, -1)
        with self._cond:
            if len(self._stagings) >= MAX_LIVE_STAGINGS:
                raise RuntimeError(f"{MAX_LIVE_STAGINGS} stagings in flight")
            self._stagings[staging_id] = _Staging(list(keys), blocks)

    def progress(self, staging_id: int, num_staged: int, event: Any = None) -> None:
        """Layers 0 .. num_staged - 1 are in the staging (`event`: the last one's CUDA copy,
        None where it is done)."""
        with self._cond:
            staging = self._stagings.get(staging_id)
            if staging is None:
                return
            if event is not None:
                staging.events.append(event)
            staging.num_staged = num_staged
            self._cond.notify_all()

    def end(self, staging_id: int) -> None:
        """The save is done (its blocks are in the node) or aborted; idempotent."""
        with self._cond:
            staging = self._stagings.pop(staging_id, None)
            if staging is None:
                return
            self._ended[staging_id] = staging.keys
            self._num_ended_keys += len(staging.keys)
            while self._num_ended_keys > MAX_ENDED_KEYS:
                self._num_ended_keys -= len(self._ended.popitem(last=False)[1])
            self._cond.notify_all()

    def is_ended_with(self, staging_id: int, keys: Sequence[bytes], first_block: int) -> bool:
        """Whether `staging_id` ended (and is remembered) with blocks `keys` from its block
        `first_block` on: then they may be read from the node's store."""
        with self._cond:
            ended = self._ended.get(staging_id)
            return ended is not None and _names(ended, keys, first_block)

    def wait(self, staging_id: int, keys: Sequence[bytes], first_block: int,
             first_layer: int, timeout_s: float) -> tuple[torch.Tensor | None, int]:
        """The staging's blocks [n, num_layers, layer bytes] and how many layers are staged,
        once more than `first_layer` are or `timeout_s` passed; (None, 0) when there is no
        such staging (ended, or it never named `keys` from `first_block`)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                staging = self._stagings.get(staging_id)
                if staging is None or not _names(staging.keys, keys, first_block):
                    return None, 0
                left = deadline - time.monotonic()
                if staging.num_staged > first_layer or left <= 0:
                    blocks, num_staged = staging.blocks, staging.num_staged
                    events = list(staging.events[:num_staged])
                    break
                self._cond.wait(left)
        for event in events[first_layer:]:  # (outside the lock: the next layers go on)
            event.synchronize()
        return blocks, num_staged


def read_layers(stagings: LiveStagings, get_many, request: GetLayersRequest
                ) -> tuple[int, np.ndarray | None, bool]:
    """What a GetLayersRequest is answered with: (layers, their payload, gone). From the live
    staging, else from the stored blocks (`get_many(keys)`, the node's store)."""
    keys, first, num_layers = request.keys, request.first_layer, request.num_layers
    blocks, num_staged = stagings.wait(request.staging_id, keys, request.first_block, first,
                                       request.wait_s)
    if blocks is not None:
        if num_staged <= first:
            return 0, None, False
        part = blocks[request.first_block:request.first_block + len(keys), first:num_staged]
        return num_staged - first, np.ascontiguousarray(part.numpy()), False
    if not stagings.is_ended_with(request.staging_id, keys, request.first_block):
        return 0, None, True  # never here, forgotten, or not its keys: nothing to read
    stored = get_many(keys)
    if any(block is None for block in stored):
        return 0, None, True
    payload = _layers_of(stored, num_layers, first)
    return (0, None, True) if payload is None else (num_layers - first, payload, False)


def _names(staging_keys: list[bytes], keys: Sequence[bytes], first_block: int) -> bool:
    """Whether `keys` are a staging's blocks from its block `first_block` on."""
    return list(keys) == staging_keys[first_block:first_block + len(keys)]


def _layers_of(stored: Sequence[BytesLike], num_layers: int, first: int) -> np.ndarray | None:
    """Layers `first` on of whole stored blocks, [n, layers, layer bytes]: a view where they
    lie back to back and every layer is asked for (a save's blocks do: sent as they lie),
    else one gather (None: a block that is not num_layers equal parts)."""
    blocks = [as_uint8_tensor(block) for block in stored]
    block_bytes = blocks[0].numel()
    if block_bytes % num_layers or any(block.numel() != block_bytes for block in blocks):
        return None
    if len(back_to_back_runs(blocks)) == 1:
        whole = run_view(blocks).numpy().reshape(len(blocks), num_layers, -1)
        return np.ascontiguousarray(whole[:, first:])
    return np.stack([block.numpy().reshape(num_layers, -1)[first:] for block in blocks])
