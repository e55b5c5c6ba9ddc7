"""A decode worker follows a prefill layer by layer (the decode side of FollowPrefill,
protocol/worker.py): on the prefill worker's host out of its shared memory segment, from
another host by pulling each layer from its hand-off node (pdserve/handoff/layer_pull.py).

Without it a hand-off's blocks are copied into the decode pool when the hand-off arrives: on
one core that copy is the whole wait between the prefill's last layer and the request joining
the batch. With it:

    prefill worker                           decode worker
    forward, layer 0 staged in the segment   FollowPrefill: reserve the prompt's blocks, map
      (StagingAnnouncer: Output.staging       the staging (pdserve/serve/worker/gateway.py -> here)
       -> router) ------------------------->
    layer 1 ... L-1: each layer's copy,      each loop turn: copy the layers the header counts
      then header progress = l + 1             into the reserved blocks (copy_ready)
    save put, lease, hand-off Output ------> GenerateRequest(handoff): copy what is left (the
                                               last layer), check the serial, claim the
                                               reserved blocks: in the batch (finish)

From another host (or where the segment cannot be mapped) the same reservation is filled by a
pull: the connector's job thread asks the prefill worker's node for the layers staged since
its last ask (the node answers as soon as one lands) and each loop turn copies what came. A
hand-off that arrives with layers still crossing waits for them (`pending`); a pull that
fails gives its reservation back, and the hand-off loads the usual way.

The decode worker only ever reads the prefill's memory and writes its own blocks, so nothing
the prefill does can corrupt it: a staging freed meanwhile (the prefill aborted it, or its
lease expired) changes the allocation's serial, which the check after the last copy sees
(the request then recomputes, before any of its block keys is published). Reserved blocks go
back on abort, when the hand-off does not match the staging, and after FOLLOW_IDLE_S without
progress or hand-off (a router that died between the two messages).

Early copies rely on the progress word being stored after the data it counts, which x86
guarantees (pdserve/kvstore/shm_segment.py, TOTAL_STORE_ORDER); elsewhere the reservation is made
early and every layer is copied when the hand-off arrives. Nor does an idle decode worker
that lends its cores to the prefill (pdserve/serve/cpu/core_share.py) copy layers while they come:
the copies would only stall the prefill's thread on its core (the worker says so:
`copy_early`). It copies them all once every layer is staged (the prefill on borrowed cores
announces its staging only then, StagingAnnouncer), overlapping the forward's tail and the
hand-off's trip instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.handoff.layer_pull import LayerPull
from pdserve.kvstore.live_staging import StagingPlace
from pdserve.kvstore.shm_segment import TOTAL_STORE_ORDER
from pdserve.protocol.worker import FollowPrefill, KVHandoff, KVStaging, Output
from pdserve.serve.engine.block_manager import NoFreeBlocksError

logger = logging.getLogger(__name__)

FOLLOW_IDLE_S = 60.0  # no progress and no hand-off for this long: the reservation goes back


class StagingAnnouncer:
    """The prefill side: when a save starts staging in the worker's node, say where at once
    (mid-forward, on its thread: the node, the staging, and its place in the segment if it
    lies there), for the router to forward to the decode worker it picks. The connector calls
    it (HandoffConnector on_staged) where following is chosen (pdserve/handoff/registry.py
    choose_handoff)."""

    def __init__(self, engine, send: Callable[[Output], None]) -> None:
        """`send`: sends an Output at once (the worker's)."""
        self.engine = engine
        self.send = send
        self.borrowing_cores = False
        """This worker runs on an idle decode worker's cores now (pdserve/serve/cpu/core_share.py).
        A staging that starts then is announced only once every layer is staged: during the
        forward that decode worker would copy nothing (Followers.copy_early), and the
        messages would only take core time from this forward's thread there; after it, the
        copy overlaps the forward's tail instead."""

    def __call__(self, request_id: str, place: StagingPlace, staged: bool) -> bool:
        """A save started staging (`staged`: it is complete now). Returns whether it was
        said (False: ask again when every layer is staged)."""
        engine = self.engine
        if engine.role.name != "prefill":
            return True  # (nothing to say, ever)
        if self.borrowing_cores and not staged:
            return False
        if self.borrowing_cores and place.segment is None:
            # a pull now would take cores from the sampling and the hand-off's send, and
            # gain a millisecond or two: decode reads the prompt once it is handed off
            return True
        kv_cache_dtype = engine.spec.kv_layout(engine.block_manager.block_size).dtype
        self.send(Output(request_id, [], "", staging=KVStaging(
            place.segment, place.span, len(place.keys), kv_cache_dtype, list(place.keys),
            place.source, place.staging_id)))
        return True


@dataclass
class _Follow:
    staging: KVStaging
    block_ids: list[int]
    active_s: float  # when it last made progress
    num_held: int = 0  # leading blocks this worker held already (not copied)
    num_copied: int = 0
    num_moved_bytes: int = 0  # copied into the reserved blocks (counted once it completes)
    # on the prefill's host:
    layers: list[torch.Tensor] | None = None  # the staging, per layer, mapped read-only
    progress: Callable[[], int] | None = None  # layers staged so far
    intact: Callable[[], bool] = lambda: True  # the staging is still the one named
    # elsewhere:
    pull: LayerPull | None = None


class Followers:
    """The requests this decode worker follows: their reserved blocks and what is copied."""

    def __init__(self, engine, kv_transfer) -> None:
        self.engine = engine
        self.kv_transfer = kv_transfer
        self._follows: dict[str, _Follow] = {}
        self.num_layers = kv_transfer.connector.layout.num_layers
        self._copy_early = True

    @property
    def copy_early(self) -> bool:
        """Copy layers as they land (False: this worker lends its idle cores to the prefill
        now, which the copies would stall; they wait until every layer is staged, and pulls
        are paused until the worker takes its cores back or the hand-off comes)."""
        return self._copy_early

    @copy_early.setter
    def copy_early(self, value: bool) -> None:
        if value == self._copy_early:
            return
        self._copy_early = value
        for follow in self._follows.values():
            if follow.pull is not None:
                if value:
                    self.kv_transfer.resume_pull(follow.pull)
                else:
                    follow.pull.pause()

    def __len__(self) -> int:
        return len(self._follows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._follows

    @property
    def has_layers_to_copy(self) -> bool:
        """A followed prefill still has layers to come, to copy now (the worker loop wakes
        for them)."""
        return self.copy_early and TOTAL_STORE_ORDER and any(
            f.pull is None and f.num_copied < self.num_layers for f in self._follows.values())

    def start(self, message: FollowPrefill, kv_cache_dtype: str) -> bool:
        """Reserve blocks for the request and map its staging; False where it cannot be
        followed (it then takes the usual path when its hand-off comes)."""
        request_id, staging = message.request_id, message.staging
        bm = self.engine.block_manager
        if (request_id in self._follows or request_id in self.engine.scheduler.requests
                or not self.kv_transfer.can_write_layers
                or staging.num_blocks != bm.num_blocks_for(message.num_prompt_tokens)
                or (staging.kv_cache_dtype and staging.kv_cache_dtype != kv_cache_dtype)):
            return False
        mapped = None if staging.segment is None else self.kv_transfer.map_staging(staging)
        if mapped is None and not (staging.source_address
                                   and len(staging.block_keys) == staging.num_blocks):
            return False
        sources = self.kv_transfer.sources  # a pull crosses a link: worth it? (kv_source.py)
        if mapped is None and sources is not None and sources.choose(
                message.num_prompt_tokens, staging.num_blocks, staging.source_address,
                during_prefill=True) != "transfer":
            return False  # (its hand-off chooses again, and is counted then)
        # (with a block to spare for each running request's next token: a reservation must
        # not make the batch preempt)
        if bm.num_free_blocks - staging.num_blocks < len(self.engine.scheduler.running):
            return False
        held = self.kv_transfer.hold_prefix(request_id, staging.num_blocks, staging.block_keys)
        if held is not None:  # the leading blocks are here already: copy only the others
            block_ids, num_held = held
        else:
            try:
                block_ids, num_held = bm.reserve(request_id, staging.num_blocks), 0
            except NoFreeBlocksError:
                return False
        follow = self._follows[request_id] = _Follow(staging, block_ids, time.monotonic(),
                                                     num_held)
        self.kv_transfer.reserved(request_id, block_ids[num_held:])
        if mapped is not None:
            follow.layers, follow.progress, follow.intact = mapped
        elif num_held < staging.num_blocks:
            follow.pull = self.kv_transfer.start_pull(staging, num_held,
                                                      paused=not self.copy_early)
        else:  # every block is here already
            follow.num_copied = self.num_layers
        return True

    def copy_ready(self) -> None:
        """Copy the layers staged since the last call into the reserved blocks (x86: see the
        module docstring); drop follows idle for FOLLOW_IDLE_S."""
        now = time.monotonic()
        for request_id, follow in list(self._follows.items()):
            if follow.pull is not None:
                if self._take_pulled(follow):
                    follow.active_s = now
                if follow.pull.failed:
                    self.drop(request_id)  # (its hand-off loads the usual way)
                    continue
            elif TOTAL_STORE_ORDER and follow.num_copied < self.num_layers:
                staged = min(follow.progress(), self.num_layers)
                if (self.copy_early or staged == self.num_layers) and self._copy(follow, staged):
                    follow.active_s = now
            if now - follow.active_s > FOLLOW_IDLE_S:
                logger.warning("no hand-off for followed request %s in %.0f s; its blocks go "
                               "back", request_id, FOLLOW_IDLE_S)
                self.drop(request_id)

    def _take_pulled(self, follow: _Follow) -> bool:
        """Copy the layers a pull received since the last call; whether any came."""
        assert follow.pull is not None
        taken = follow.pull.take()
        for first, layers in taken:
            self._install(follow, first, layers)
        return bool(taken)

    def pending(self, request_id: str, handoff: KVHandoff) -> bool:
        """The hand-off of a pulled follow arrived while layers are still crossing (finish
        once they came: the worker's loop asks again every turn)."""
        follow = self._follows.get(request_id)
        if follow is None or follow.pull is None or follow.pull.failed:
            return False
        if not self.kv_transfer.names_staging(handoff, follow.staging):
            return False  # (finish drops it)
        self.kv_transfer.resume_pull(follow.pull)  # (paused while lending: it is wanted now)
        if self._take_pulled(follow):
            follow.active_s = time.monotonic()
        return follow.num_copied < self.num_layers and not follow.pull.failed

    def _copy(self, follow: _Follow, until: int) -> bool:
        assert follow.layers is not None
        copied, held = follow.num_copied, follow.num_held
        self._install(follow, copied, [follow.layers[layer][:, held:]
                                       for layer in range(copied, until)])
        return follow.num_copied > copied

    def _install(self, follow: _Follow, first: int, layers: list[torch.Tensor]) -> None:
        """Layers `first`, `first` + 1, ... of the blocks this worker lacks ([P, n, block_size,
        heads, head_dim] each) into the follow's reserved blocks after the held ones."""
        for layer, blocks in enumerate(layers, start=first):
            self.kv_transfer.install_layer(layer, follow.block_ids[follow.num_held:], blocks)
            follow.num_moved_bytes += blocks.nbytes
        if layers:
            follow.num_copied = max(follow.num_copied, first + len(layers))

    def finish(self, request_id: str, handoff: KVHandoff
               ) -> tuple[list[int], Callable[[], bool], bool] | None:
        """The hand-off of a followed request arrived: copy the layers left, and return the
        reserved blocks (now holding the prompt's KV; for the engine to claim), the check to
        make before they count, and whether they were pulled. None: not followed, or the
        hand-off names other blocks, or the pull failed (its reservation went back; the
        usual path takes it)."""
        follow = self._follows.get(request_id)
        if follow is None:
            return None
        if handoff.choice_first_tokens or not self.kv_transfer.names_staging(
                handoff, follow.staging):
            self.drop(request_id)
            return None
        if follow.pull is not None:
            self._take_pulled(follow)
            if follow.num_copied < self.num_layers:  # (the pull failed: load instead)
                self.drop(request_id)
                return None
        elif follow.layers is not None:
            self._copy(follow, self.num_layers)
        del self._follows[request_id]
        self.kv_transfer.note_handoff(follow.num_moved_bytes, follow.num_held)
        return follow.block_ids, follow.intact, follow.pull is not None

    def drop(self, request_id: str) -> None:
        """Give a follow's reserved blocks back (abort, a hand-off elsewhere); idempotent."""
        follow = self._follows.pop(request_id, None)
        if follow is not None:
            if follow.pull is not None:
                follow.pull.cancelled.set()
            self.engine.block_manager.unreserve(request_id)
