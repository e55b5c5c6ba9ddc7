"""Where each prompt's KV probably is: the router's view of prefix caches.

Two sources, both keyed by the chained block keys (pdserve/kvstore/block_key.py) that workers use:
  - the KV store master: which leading blocks the fleet-wide store holds (exact, shared by
    every prefill worker, asked per request with a short timeout);
  - this index: which prefill worker recently computed which blocks (an LRU approximation
    of each worker's own prefix cache, as SGLang's and Dynamo's routers keep).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.kvstore.block_key import block_keys, root_key

logger = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity_blocks = capacity_blocks
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def record(self, keys: Sequence[bytes], worker: str) -> None:
        for key in keys:
            holders = self._holders.pop(key, set())
            holders.add(worker)
            self._holders[key] = holders  # most recent last
        while len(self._holders) > self.capacity_blocks:
            self._holders.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        for key in list(self._holders):
            holders = self._holders[key]
            holders.discard(worker)
            if not holders:
                del self._holders[key]

    def num_leading_blocks(self, keys: Sequence[bytes], worker: str) -> int:
        n = 0
        for key in keys:
            if worker not in self._holders.get(key, ()):
                break
            n += 1
        return n


def request_block_keys(prompt_token_ids: Sequence[int], status_layout: dict, model_id: str,
                       cache_salt: str | None) -> list[bytes]:
    """The request's full-block keys as the workers compute them."""
    return block_keys(prompt_token_ids, int(status_layout["block_size"]),
                      root_key(model_id, status_layout, cache_salt))


class StoreLookup:
    """Asks the store master how many leading blocks it holds; 0 when it cannot answer, and
    0 at once for `hold_s` after it did not answer (requests would otherwise queue behind
    each other's timeouts on the one channel for the whole outage)."""

    def __init__(self, master_address: str, timeout_s: float = 0.5,
                 hold_s: float = 5.0) -> None:
        from pdserve.kvstore.client import StoreClient

        self._client = StoreClient(None, master_address, transport="zmq", timeout_s=timeout_s)
        self._timeout_s = timeout_s
        self._hold_s = hold_s
        self._held_until_s = 0.0

    async def num_cached_blocks(self, keys: Sequence[bytes]) -> int:
        if not keys or time.monotonic() < self._held_until_s:
            return 0
        try:
            lookup = await asyncio.wait_for(
                asyncio.to_thread(self._client.lookup_prefix, list(keys)), self._timeout_s * 2)
            return lookup.num_blocks
        except Exception as exc:  # a cache lookup never fails a request
            if isinstance(exc, TimeoutError):  # StoreUnavailable is one too
                self._held_until_s = time.monotonic() + self._hold_s
            logger.debug("store lookup failed: %s", exc)
            return 0

    def close(self) -> None:
        self._client.close()
