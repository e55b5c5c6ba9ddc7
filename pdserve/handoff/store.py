"""The "store" hand-off transport: a prefill's prompt goes to the fleet store, and decode reads
it from the source a hand-off names (another worker's node), else from the fleet store.

    prefill ─ finish: put_many + pin ─► fleet store ◄─ receive: get_many ─ decode   (two hops)

Chosen with `--kv-handoff store` (and by default where `--handoff-dram-gb` is 0). It is also
the reading half of every transport: whichever transport a worker runs, a hand-off names its
source and decode reads from there (pdserve/handoff/node.py subclasses this one).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pdserve.handoff.base import HandoffTransport, Offer
from pdserve.handoff.layer_pull import LayerPull
from pdserve.handoff.wire_fp8 import decode_blocks
from pdserve.kvstore.connector import usable_prefix
from pdserve.kvstore.memory_tier import BytesLike
from pdserve.protocol.store.data import ShmSpan

logger = logging.getLogger(__name__)


class StoreHandoff(HandoffTransport):
    """Offers go to the fleet store (`backend`); decode reads the named source, else it."""

    name = "store"

    def _target(self) -> Any:
        if self.backend is None:
            raise RuntimeError("no data node and no store to save to")
        return self.backend

    def finish(self, keys: list[bytes], blocks: list[torch.Tensor],
               lease_ttl_s: float | None) -> Offer:
        num_stored, lease_id = 0, None
        try:
            target = self._target()
            offered = self._on_the_wire(blocks)
            stored = target.put_many(keys, offered)
            num_stored = next((i for i, ok in enumerate(stored) if not ok), len(stored))
            if lease_ttl_s is not None and num_stored:
                lease_id, _ = target.pin(keys[:num_stored], lease_ttl_s)
            # (encoded copies are not the staging: a decode worker on this host loads them)
            spans = (self.locate(blocks) if num_stored == len(blocks) and offered is blocks
                     else None)
        except Exception as e:  # a lost save only costs a future recompute
            return self._offered(num_stored, lease_id, None, repr(e), keys, blocks)
        return self._offered(num_stored, lease_id, spans, None, keys, blocks)

    def _on_the_wire(self, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The blocks as the offer holds them: the fleet store keeps the pool's bytes (other
        workers load them as a prefix), so this transport sends them raw."""
        return blocks

    def _offered(self, num_stored: int, lease_id: int | None, spans: list[ShmSpan] | None,
                 error: str | None, keys: list[bytes], blocks: list[torch.Tensor]) -> Offer:
        return Offer(num_stored, error, lease_id)

    def receive(self, keys: list[bytes], source: str, block_bytes: int) -> list[BytesLike]:
        """The leading run of present, well-formed blocks, as the backend returned them
        (FP8-encoded ones decoded, pdserve/handoff/wire_fp8.py): from `source`, else the
        fleet store, or the store first where the policy predicts it faster
        (KVSourcePolicy.reads_store_first); each failure logged and passed over. Each read's
        bytes and seconds go to the link meter."""
        names = ([source] if source else []) + ([""] if self.backend is not None else [])
        if len(names) == 2 and self.policy.reads_store_first(len(keys) * block_bytes, source):
            names.reverse()
        best: list[BytesLike] = []
        for name in names:
            if self.peers.recently_failed(name):
                continue
            start_s = time.perf_counter()
            try:
                backend = self.peers.backend_for(name) if name else self.backend
                assert backend is not None
                blocks = backend.get_many(keys) if keys else []
                seconds = time.perf_counter() - start_s
            except Exception as e:
                logger.warning("kv connector: reading from %s failed (%s)", name or "the store",
                               e)
                if isinstance(e, TimeoutError):  # (the link is at most this fast)
                    self.links.note(name, len(keys) * block_bytes,
                                    time.perf_counter() - start_s, upper_bound=True)
                if name:
                    self.peers.failed(name)
                continue
            usable = usable_prefix(decode_blocks(blocks, block_bytes), block_bytes)
            self.links.note(name, len(usable) * block_bytes, seconds)
            if len(usable) > len(best):
                best = usable
            if len(best) == len(keys):
                break
        return best

    def receive_layers(self, pull: LayerPull) -> bool:
        """One round trip of a layer pull (pdserve/handoff/layer_pull.py) from its node;
        whether to ask again. A node that does not answer is passed over as `receive` passes
        it over (its hand-off then loads from the fleet store)."""
        if self.peers.recently_failed(pull.source):
            pull.failed = True
            return False
        first, start_s = pull.next_layer, time.perf_counter()
        try:
            go_on = pull.step(self.peers.backend_for(pull.source))
            # (a lower bound on the link: the node may have waited for the layers)
            self.links.note(pull.source, (pull.next_layer - first) * pull.layer_bytes
                            * len(pull.keys), time.perf_counter() - start_s, lower_bound=True)
            return go_on
        except Exception as e:  # only an early start: the hand-off loads the usual way
            logger.warning("kv connector: pulling staging %d from %s failed (%s)",
                           pull.staging_id, pull.source, e)
            if isinstance(e, TimeoutError):  # (StoreUnavailable is one)
                self.peers.failed(pull.source)
                # not even one layer came in time: the link is at most that fast
                self.links.note(pull.source, pull.layer_bytes * len(pull.keys),
                                time.perf_counter() - start_s, upper_bound=True)
            pull.failed = True  # (last: the worker's loop acts on it at once)
            return False

    def release(self, lease_id: int, source: str) -> None:
        """Give a lease back to the node holding it; a failure leaves it to expire."""
        if self.peers.recently_failed(source):
            return  # the node is gone, and its leases with it
        try:
            backend = self.peers.backend_for(source) if source else self.backend
            if backend is not None:
                backend.release(lease_id)
        except Exception as e:
            logger.warning("kv connector: releasing lease %d failed (%s); it will expire",
                           lease_id, e)
            if source:
                self.peers.failed(source)
