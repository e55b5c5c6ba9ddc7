"""The scheduler half of pdserve's vLLM connector, on plain values (no vLLM import).

Per request it keeps the prompt's chain of block keys (pdserve's, pdserve/kvstore/block_key.py),
asks the store master how many leading blocks are stored, and turns vLLM's allocation and each
step's schedule into a StepPlan: the loads (keys -> vLLM block ids, pinned under a lease) and
the saves (the prompt blocks the step completes that the store did not hold):

    prompt    | block 0 | block 1 | block 2 | block 3 |  partial  |
    vLLM hit  |<------->|                                            local prefix cache
    store hit |<------------------------->|                         master lookup
    load                |<--------------->|                         keys[1:3] -> block ids
    save                                  |<------->|  (as the step that completes it runs)

A load never covers the prompt's last token (vLLM computes at least one to sample); the
partial last block and generated tokens are never saved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.kvstore.block_key import KVLayout, block_keys, root_key
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.master import PrefixLookup

logger = logging.getLogger(__name__)


# ---- the plan: what the scheduler tells the worker each step ----------------------------------


@dataclass
class BlockTransfer:
    """Blocks `keys` of one request, to or from vLLM blocks `block_ids` (one per key)."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    lease_id: int | None = None
    """Load: the store lease pinning the blocks (the worker releases it once read)."""

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys but {len(self.block_ids)} block ids")


@dataclass
class StepPlan:
    """One step's transfers (the body of the connector metadata vLLM carries)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(frozen=True)
class ScheduledRequest:
    """What the plan needs of one request that a step schedules (from vLLM's
    SchedulerOutput)."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    block_ids: list[int]
    """A new or resumed request: all its blocks; a running one: the blocks added this step."""
    replaces_blocks: bool  # new or resumed from preemption


@dataclass
class _RequestState:
    root: bytes
    keys: list[bytes]  # every full block of the tokens seen so far
    num_prompt_tokens: int
    num_local_tokens: int = 0  # vLLM's own (block-aligned) prefix hit at the last lookup
    num_stored_blocks: int = 0  # leading blocks the store held at the last lookup
    num_saved_blocks: int = 0
    block_ids: list[int] = field(default_factory=list)


# ---- scheduler side ----------------------------------------------------------------------------


class PdserveScheduler:
    """The scheduler half, on plain values: lookups, load plans, save plans."""

    def __init__(self, layout: KVLayout, model_id: str, client: StoreClient | None,
                 can_load: bool, can_save: bool, lease_ttl_s: float = 0.0,
                 data_address: str | None = None):
        """`client` asks the master (lookups) and pins on our data server, `data_address`
        (None: count every holder)."""
        self.layout = layout
        self.model_id = model_id
        self.block_size = layout.block_size
        self.client = client
        self.can_load, self.can_save = can_load, can_save
        self.lease_ttl_s = lease_ttl_s
        self._roots: dict[str | None, bytes] = {}
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []
        self.node_id = self._own_node_id(data_address)

    def root(self, cache_salt: str | None) -> bytes:
        if cache_salt not in self._roots:
            self._roots[cache_salt] = root_key(self.model_id, self.layout, cache_salt)
        return self._roots[cache_salt]

    def _own_node_id(self, data_address: str | None) -> str | None:
        """The node id the master knows our data server by (None: no master, or not found,
        and then every holder counts)."""
        if self.client is None or data_address is None:
            return None
        try:
            nodes = self.client.nodes()
        except ValueError:  # no master: lookups ask the data server itself
            return None
        except Exception as e:  # lookups still work, only unfiltered
            logger.warning("pdserve connector: cannot list the store's nodes (%s)", e)
            return None
        return next((node for node, address in nodes.items() if address == data_address),
                    None)

    def _state(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
               cache_salt: str | None) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            root = self.root(cache_salt)
            state = _RequestState(root, [], num_prompt_tokens)
            self._requests[request_id] = state
        num_full = len(token_ids) // self.block_size
        if len(state.keys) < num_full:  # extend the chain (a resumed request has more tokens)
            state.keys.extend(block_keys(token_ids, self.block_size, state.root,
                                         start_key=state.keys[-1] if state.keys else None,
                                         start_block=len(state.keys)))
        return state

    def _lookup(self, keys: list[bytes]) -> int:
        """Leading blocks our data node holds (0 when the store cannot be asked)."""
        if self.client is None or not keys:
            return 0
        try:
            found = self.client.lookup_prefix(keys)
        except Exception as e:  # a cache lookup never fails a request
            logger.warning("pdserve connector: lookup failed (%s); a miss", e)
            return 0
        return leading_blocks_on(found, self.node_id)

    def num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int],
                               num_prompt_tokens: int, num_computed_tokens: int,
                               cache_salt: str | None = None) -> int:
        """Tokens past vLLM's own hit (`num_computed_tokens`, block-aligned) that the store
        can supply; 0 when this connector does not load."""
        state = self._state(request_id, token_ids, num_prompt_tokens, cache_salt)
        state.num_stored_blocks = self._lookup(state.keys)
        state.num_local_tokens = num_computed_tokens
        if not self.can_load:
            return 0
        num_loadable = (len(token_ids) - 1) // self.block_size  # the last token is computed
        num_hit_tokens = min(state.num_stored_blocks, num_loadable) * self.block_size
        return max(0, num_hit_tokens - num_computed_tokens)

    def update_after_alloc(self, request_id: str, block_ids: Sequence[int],
                           num_external_tokens: int) -> None:
        """Plan the load of the `num_external_tokens` vLLM granted, into `block_ids` (all the
        request's blocks)."""
        state = self._requests.get(request_id)
        if num_external_tokens <= 0 or state is None or not self.can_load:
            return
        first = state.num_local_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        if end > len(state.keys) or end > len(block_ids):
            raise ValueError(f"request {request_id}: a load of blocks [{first}, {end}) past "
                             f"its {len(state.keys)} keys / {len(block_ids)} blocks")
        keys = state.keys[first:end]
        self._pending_loads.append(
            BlockTransfer(request_id, keys, list(block_ids[first:end]), self._pin(keys)))

    def _pin(self, keys: list[bytes]) -> int | None:
        if self.client is None or self.lease_ttl_s <= 0:
            return None
        try:
            lease_id, _ = self.client.pin(keys, self.lease_ttl_s)
        except Exception as e:  # unpinned blocks may be evicted: then a failed load, recomputed
            logger.warning("pdserve connector: pin failed (%s)", e)
            return None
        return lease_id

    def build_plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """This step's loads (planned at allocation) and saves: the prompt blocks the step
        completes, past those the store already held."""
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = []
        for request in scheduled:
            state = self._requests.get(request.request_id)
            if state is None:
                continue
            if request.replaces_blocks:
                state.block_ids = list(request.block_ids)
            else:
                state.block_ids.extend(request.block_ids)
            if not self.can_save:
                continue
            num_done_tokens = min(request.num_computed_tokens + request.num_scheduled_tokens,
                                  state.num_prompt_tokens)
            end = min(num_done_tokens // self.block_size, len(state.keys),
                      len(state.block_ids))
            first = max(state.num_saved_blocks, state.num_stored_blocks)
            if end > first:
                plan.saves.append(BlockTransfer(request.request_id, state.keys[first:end],
                                                state.block_ids[first:end]))
                state.num_saved_blocks = end
        return plan

    def request_finished(self, request_id: str) -> None:
        """Forget a request (vLLM frees its blocks now: nothing of ours outlives the step)."""
        self._requests.pop(request_id, None)
        dropped = [t for t in self._pending_loads if t.request_id == request_id]
        self._pending_loads = [t for t in self._pending_loads if t.request_id != request_id]
        for transfer in dropped:
            self._release(transfer.lease_id)

    def _release(self, lease_id: int | None) -> None:
        if lease_id is None or self.client is None:
            return
        try:
            self.client.release(lease_id)
        except Exception as e:  # the lease expires on its own
            logger.debug("pdserve connector: release failed (%s)", e)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def leading_blocks_on(found: PrefixLookup | int, node_id: str | None) -> int:
    """Leading blocks of a lookup that node `node_id` holds (every holder counts when None, or
    when the store gave no holders)."""
    if isinstance(found, int):
        return found
    if node_id is None or not found.holders:
        return found.num_blocks
    count = 0
    for holders in found.holders[: found.num_blocks]:
        if not any(node == node_id for node, _ in holders):
            break
        count += 1
    return count
