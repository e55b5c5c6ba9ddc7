"""A decode worker's pull of a prompt that a prefill worker on another host is staging now:
each layer as it lands there, for the follower (pdserve/serve/worker/follow.py) to copy into the
blocks it reserved while the prefill's forward goes on.

    decode worker: connector job thread                  prefill worker's hand-off node
    get_layers(staging, first_layer = next) ───────────► waits (at most WAIT_S) for a layer
    ◄── the layers staged since, [blocks, layers, bytes]    past it, sends what is staged
    queued for the worker's loop (wakes it); asked again
    at the back of the job queue, until every layer came

One request per round trip and the node answers as soon as a layer is there, so a layer
crosses while the next one computes; a pull never holds the job thread longer than one
WAIT_S, so loads and releases queued behind it wait at most that long. A pull whose node
fails or says the staging is gone stops (`failed`): its hand-off then loads the usual way.
While the decode worker lends its idle cores to a prefill on its host (pdserve/serve/cpu/
core_share.py) its pull is paused: receiving and copying there would stall that prefill's
threads; it goes on when the worker takes its cores back, or when the hand-off comes.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

WAIT_S = 0.05
"""How long the node holds one request for a layer to land (then it is asked again)."""


class LayerPull:
    """One pull of a staging on another host: the layers received and not yet taken, and
    whether to go on (paused while the worker lends its cores, stopped once done or failed)."""

    def __init__(self, source: str, staging_id: int, keys: list[bytes], first_block: int,
                 block_shape: list[int], dtype: torch.dtype,
                 to_layers: Callable[[torch.Tensor, int, int], list[torch.Tensor]]) -> None:
        """Blocks `keys` (the staging's from index `first_block` on) of the staging
        `staging_id` at the node `source`; `block_shape` [num_layers, P, block_size, H, D];
        `to_layers(payload, num_blocks, num_layers)` views a payload per layer."""
        self.source, self.staging_id = source, staging_id
        self.keys, self.first_block = keys, first_block
        self.num_layers = block_shape[0]
        self.layer_bytes = int(np.prod(block_shape[1:])) * dtype.itemsize
        self._to_layers = to_layers
        self.next_layer = 0  # (the job thread's)
        self._received: deque[tuple[int, list[torch.Tensor]]] = deque()
        self.failed = False
        self.cancelled = threading.Event()
        self._lock = threading.Lock()  # paused and scheduled change together
        self._paused = False
        self._scheduled = False  # a step is queued or running

    # ---- pausing (the decode worker lends its cores to the prefill meanwhile) ---------------
    def pause(self) -> None:
        """Ask no more until resumed (the step under way, if any, ends as it is)."""
        with self._lock:
            self._paused = True

    def resume(self) -> bool:
        """Go on; whether the caller must queue a step (none is queued or running)."""
        with self._lock:
            self._paused = False
            if self._scheduled or self.done or self.failed or self.cancelled.is_set():
                return False
            self._scheduled = True
            return True

    def may_step(self) -> bool:
        """The job thread, before a step: False (and no step queued any more) while paused
        or cancelled."""
        with self._lock:
            if self._paused or self.cancelled.is_set():
                self._scheduled = False
                return False
            return True

    def stopped(self) -> None:
        """The job thread queued no next step (done, failed or cancelled)."""
        with self._lock:
            self._scheduled = False

    @property
    def done(self) -> bool:
        """Every layer came (the job thread's view: what `take` may still hold is not
        counted)."""
        return self.next_layer >= self.num_layers

    def step(self, peer) -> bool:
        """One round trip to the node (`peer`: its StoreClient); whether to ask again."""
        num_layers, payload, gone = peer.get_layers(
            self.staging_id, self.keys, self.first_block, self.next_layer, self.num_layers,
            self.layer_bytes, WAIT_S)
        if gone:
            logger.info("kv pull: staging %d at %s is gone", self.staging_id, self.source)
            self.failed = True
            return False
        if payload is not None:
            with warnings.catch_warnings():  # a ZeroMQ frame is read-only, and only read
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(payload)
            self._received.append((self.next_layer,
                                   self._to_layers(data, len(self.keys), num_layers)))
            self.next_layer += num_layers
        return not self.done and not self.cancelled.is_set()

    def take(self) -> list[tuple[int, list[torch.Tensor]]]:
        """What came since the last call: (first layer, per layer [P, n, block_size, h, D]
        views of the received bytes), in order (the worker's loop)."""
        taken = []
        while self._received:
            taken.append(self._received.popleft())
        return taken
