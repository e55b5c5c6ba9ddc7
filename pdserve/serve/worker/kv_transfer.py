"""The worker's side of the prefill -> decode KV hand-off (pdserve/handoff/): the engine-aware
half, which reads and writes the pool and the block manager, over the hand-off connector.

    prefill worker                                                    decode worker
    forward: each layer's blocks staged as the layer completes
    first token sampled ─► the staged prompt goes into this worker's own data node
      (pdserve/handoff/node_server.py: in process, no copy), pinned under a lease; the hand-off
      (keys, lease, the node's address) goes to the router at once ──► GenerateRequest
                                                  + hand-off ─► start_load: read the blocks
                                                  from the prefill worker's node over UCX
                                                  (one hop; the fleet store if that fails),
                                                  then fresh blocks, scatter to this
                                                  worker's TP ranks, join the batch
    meanwhile: a write-back copy goes to the fleet store (prefixes for later requests)

Which hand-off a worker runs is chosen by its flags, in one place (pdserve/handoff/registry.py
choose_handoff): `--kv-handoff` names the transport (node | store; auto: node with
`--handoff-dram-gb` > 0), `--handoff-shm` the same-host segment, `--handoff-follow` the
following of a staging. make_kv_transfer builds what was chosen; the gateway, the roles and the
connector get it through their constructors.

Stored blocks are TP-independent ([num_layers, P, block_size, all KV heads, head_dim], P = 2
for K/V or 1 for an MLA latent; see pdserve/kvstore/connector.py), and this side always moves
whole-head blocks through the runner's gather/scatter, so prefill and decode may run different
TP degrees. Every full prompt block is stored under its chained block key; the last, partial
block too, under the chain's next key over its tokens, so decode recomputes nothing. A failed
or partial load is a miss: the decode worker recomputes the prompt (the KV cache is a cache).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.handoff.connector import HandoffConnector, OnStaged
from pdserve.handoff.layer_pull import LayerPull
from pdserve.handoff.link_policy import KVSource
from pdserve.handoff.registry import HandoffChoice, choose_handoff, make_transport
from pdserve.handoff.wire_fp8 import Fp8Wire
from pdserve.kvstore.block_key import block_keys, next_key
from pdserve.kvstore.connector import TransferResult, block_nbytes
from pdserve.protocol.store.data import ShmSegment, ShmSpan
from pdserve.protocol.worker import KVHandoff, KVStaging
from pdserve.serve.engine.block_manager import NoFreeBlocksError
from pdserve.serve.engine.kv_tiers import KVOffload, TierCosts
from pdserve.serve.engine.request import Request
from pdserve.serve.worker.kv_source import EnginePrefillSpeed, KVSources

if TYPE_CHECKING:
    from pdserve.serve.worker.server import WorkerConfig

logger = logging.getLogger(__name__)

PEER_TIMEOUT_S = 3.0


def make_kv_transfer(config: WorkerConfig, engine, on_staged: OnStaged | None = None
                     ) -> KVTransfer | None:
    """The worker's KV transfer, as its flags choose it (pdserve/handoff/registry.py
    choose_handoff); None for a colocated worker or
    when neither a node nor a store can be had (decode then recomputes prompts).
    `on_staged`: a prefill's announcer of its stagings (pdserve/serve/worker/follow.py), used where
    following is chosen."""
    choice = choose_handoff(config)
    if choice is None:
        if config.role == "colocated" and (config.store_address or config.store_master_address):
            # no hand-off, but the fleet store is the tier below its host DRAM
            choice = HandoffChoice("store", shm=False, follow=False)
        else:
            return None
    node = None
    try:
        if choice.needs_node:
            from pdserve.handoff.node_server import HandoffNode

            layout = engine.runner.spec.kv_layout(engine.runner.block_size)
            nbytes = int(config.handoff_dram_gb * (1 << 30))
            node = HandoffNode(config.name, config.host,
                               max(1, nbytes // block_nbytes(layout)),
                               config.kv_lease_ttl_s, config.store_timeout_s,
                               shm_bytes=nbytes if choice.shm else 0)
        transfer = KVTransfer.connect(
            engine.runner, engine.block_manager, config.store_address,
            config.store_master_address, timeout_s=config.store_timeout_s,
            lease_ttl_s=config.kv_lease_ttl_s, transport_name=choice.transport,
            handoff_node=node, shm=choice.shm, on_staged=on_staged if choice.follow else None)
        transfer.attach_host_tier(getattr(engine, "kv_offload", None))
        transfer.saves_answers = config.save_answers
        transport = transfer.connector.transport
        if choice.wire == "fp8":
            transport.wire = Fp8Wire.for_block_shape(list(transfer.connector.block_shape),
                                                     transfer.connector.dtype)
        transfer.sources = KVSources(transport.policy, transfer.connector.block_bytes,
                                     EnginePrefillSpeed(engine))
        return transfer
    except Exception as exc:  # the KV cache is a cache: serve by recomputing
        logger.warning("KV transfer unavailable (store %s: %s): decode will recompute prompts",
                       config.store_address, exc)
        if node is not None:
            node.close()
        return None


@dataclass
class PendingLoad:
    num_blocks: int
    lease_id: int = 0
    source: str = ""  # the data node holding the blocks and the lease ("": the fleet store)


@dataclass
class TransferDone:
    request_id: str
    kind: str  # "save" | "load" | "answer" (save_answer's put)
    ok: bool
    keys: list[bytes]
    staging: list[torch.Tensor] | None = None
    """Load: the loaded blocks per layer [P, n, block_size, heads, head_dim] (views into the
    received buffer), for `install`."""
    lease_id: int | None = None
    """Save: the store lease pinning the blocks until the decode worker loaded them."""
    source: str = ""
    """Save: the data node holding the blocks and the lease ("": the fleet store)."""
    seconds: float = 0.0
    """How long the transfer took."""
    shm_segment: ShmSegment | None = None
    """Save: the node's shared memory segment, when the blocks lie in it..."""
    shm_spans: list[ShmSpan] | None = None
    """...and where each of them does (the hand-off names them)."""
    write_back: Callable[[], None] | None = None
    """Save: the copy into the fleet store, to start once the hand-off is out
    (start_write_back)."""


class KVTransfer:
    """Moves a request's KV between this worker's pool and the store: the prefill role's KV
    saver (pdserve/serve/engine/roles.py) and the loads of the hand-off component
    (pdserve/serve/worker/gateway.py, admission.py)."""

    def __init__(self, runner, block_manager, connector: HandoffConnector) -> None:
        self.runner = runner
        """The model runner: every TP rank's pool, read and written whole-head."""
        self.block_manager = block_manager
        """Block tables and block keys of the engine's requests."""
        self.connector = connector
        self._save_keys: dict[str, list[bytes]] = {}
        self._loads: dict[str, tuple[list[bytes], PendingLoad]] = {}
        self._answers: dict[str, list[bytes]] = {}  # request id -> keys of its answer's put
        self._failed: list[TransferDone] = []
        self._started_s: dict[tuple[str, str], float] = {}
        self._layer_save_s: dict[str, float] = {}  # request id -> seconds in layer_done
        self._totals = {"saved_bytes": 0.0, "loaded_bytes": 0.0, "save_seconds": 0.0,
                        "load_seconds": 0.0, "save_count": 0.0, "load_count": 0.0,
                        "layerwise_save_count": 0.0, "in_place_count": 0.0,
                        "followed_count": 0.0, "pulled_count": 0.0, "store_hit_tokens": 0.0,
                        "store_read_bytes": 0.0, "handoff_bytes": 0.0,
                        "handoff_reused_bytes": 0.0, "answer_saved_blocks": 0.0,
                        "answer_dropped_blocks": 0.0}
        self.saves_answers = True
        """A decode worker writes a finished answer's blocks through to the fleet store
        (save_answer; `--save-answers`)."""
        self.sources: KVSources | None = None
        """Decode: where each hand-off's KV comes from, by predicted time (kv_source.py;
        make_kv_transfer sets it; None: always as offered)."""
        self.offload: KVOffload | None = None
        """The engine's host tier (pdserve/serve/engine/kv_tiers.py), whose evictions this writes
        down to the store and whose cost rule it asks (make_kv_transfer sets it)."""

    @classmethod
    def connect(cls, runner, block_manager, data_address: str | None,
                master_address: str | None = None, timeout_s: float = 10.0,
                lease_ttl_s: float = 30.0, handoff_node=None, shm: bool = True,
                on_staged: OnStaged | None = None, transport_name: str | None = None
                ) -> KVTransfer:
        """A transfer over this worker's hand-off node (a HandoffNode: saves land there and
        decode workers read them from it) and/or the fleet store at `data_address`. Saved
        blocks stay pinned under a lease of `lease_ttl_s` until the decode worker has loaded
        them (or the lease expires). `shm`: read the segments of the nodes this worker loads
        from on its host (HandoffChoice.shm); `on_staged`: see HandoffConnector;
        `transport_name`: a registered transport (default: "node" with a node, else
        "store")."""
        from pdserve.kvstore.client import StoreClient
        from pdserve.kvstore.fleet_client import connect_store

        holder = f"worker-{id(runner):x}"
        client = None
        if data_address is not None or master_address is not None:
            # with a master (given, or the data node's own): every data node it indexes
            client = connect_store(data_address, master_address, timeout_s=timeout_s,
                                   holder=holder)
            logger.info("KV store at %s (KV bytes over %s)", data_address or master_address,
                        client.transport)

        def connect(address: str) -> StoreClient:
            # a prefill worker answers in milliseconds or is gone: fall back to the store soon
            peer = StoreClient(address, timeout_s=min(timeout_s, PEER_TIMEOUT_S), holder=holder,
                               shm=shm)
            logger.info("hand-off source %s (KV bytes over %s)", address, peer.transport)
            return peer

        layout = runner.spec.kv_layout(runner.block_size)
        _log_memory_choice(runner.device, client)
        transport = make_transport(
            transport_name or ("node" if handoff_node is not None else "store"), client,
            connect, handoff_node)
        return cls(runner, block_manager, HandoffConnector(
            client, layout, timeout_s=timeout_s, lease_ttl_s=lease_ttl_s,
            on_staged=on_staged, transport=transport))

    def prompt_keys(self, request: Request, block_keys: list[bytes]) -> list[bytes]:
        """Keys of every block holding the prompt: the full ones, then the partial tail."""
        bm = self.block_manager
        tail = request.prompt_token_ids[len(block_keys) * bm.block_size:]
        if not tail:
            return list(block_keys)
        parent = block_keys[-1] if block_keys else bm.root(request.cache_salt)
        return list(block_keys) + [next_key(parent, tail)]

    # ---- prefill side ----------------------------------------------------------------------
    def store_prefix_keys(self, request: Request) -> list[bytes]:
        """Keys of the prompt's leading full blocks worth loading from the store: those it
        holds, when they reach past what this worker's own prefix cache already has. None
        where prefix caching is off: then nothing is reused, the store's copy included."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return []
        keys = block_keys(request.prompt_token_ids, bm.block_size, bm.root(request.cache_salt))
        num_local = self.num_local_tokens(request) // bm.block_size
        if len(keys) <= num_local:
            return []
        num_stored = self.connector.lookup(keys)
        if num_stored <= num_local:
            return []
        costs = self.costs
        if costs is not None and not costs.worth_loading(
                "store", (num_stored - num_local) * bm.block_size,
                num_stored * self.connector.block_bytes):
            return []
        return keys[:num_stored]

    def num_local_tokens(self, request: Request) -> int:
        """Leading prompt tokens this worker holds itself: its pool, then its host tier."""
        num_device = self.block_manager.num_cached_tokens(request)
        offload = self.offload
        return offload.count_prefix(request, num_device) if offload is not None else num_device

    @property
    def costs(self) -> TierCosts | None:
        """Fetch or recompute, as the host tier's cost rule measures it (None: always fetch)."""
        offload = self.offload
        return offload.costs if offload is not None else None

    # ---- decode side: the prompt blocks this worker holds already ---------------------------
    def hold_prefix(self, request_id: str, num_blocks: int, keys: list[bytes]
                    ) -> tuple[list[int], int] | None:
        """Reserve `num_blocks` pool blocks for a hand-off whose blocks are named `keys`
        (BlockManager.reserve): the leading ones this worker holds come from its own pool
        (shared) or its host tier (copied in now), so only the rest need to move. Returns
        (the reserved blocks, how many of them are held here; counted by note_handoff once
        the hand-off joins); None when nothing is held or no blocks are free now (then every
        block moves, as before)."""
        bm = self.block_manager
        if not keys or not bm.enable_prefix_caching or not self.can_write_layers:
            return None
        try:
            block_ids = bm.reserve(request_id, num_blocks, prefix_keys=keys)
        except NoFreeBlocksError:
            return None
        held = bm.num_reserved_hits(request_id)
        load = (self.offload.pin(keys[held:num_blocks]) if self.offload is not None
                else None)
        if load is not None:
            self.offload.load(load, block_ids[held:held + len(load.keys)])
            held += len(load.keys)
        if held == 0:
            bm.unreserve(request_id)
            return None
        return block_ids, held

    def note_handoff(self, moved_bytes: int, num_held_blocks: int = 0) -> None:
        """A hand-off's KV is in this worker's pool: the bytes it moved there and the leading
        blocks it held already (hold_prefix). Called once per hand-off, by the path that
        completed it: a follow that failed first (its reservation given back, its pulled
        layers loaded again) counts nothing."""
        self._totals["handoff_bytes"] += moved_bytes
        self._totals["handoff_reused_bytes"] += num_held_blocks * self.connector.block_bytes

    def attach_host_tier(self, offload: KVOffload | None) -> None:
        """Stand below the engine's host tier: its evictions go down to the store, and its
        cost rule decides store loads too."""
        self.offload = offload
        if offload is not None and self.connector.backend is not None:
            offload.write_down = self.write_down

    def write_down(self, keys: list[bytes], blocks: list[torch.Tensor]) -> bool:
        """The host tier's evictions go to the fleet store (StoreConnector.write_down)."""
        return self.connector.write_down(keys, blocks)

    def note_store_hit(self, num_tokens: int, nbytes: int, seconds: float) -> None:
        """A prefix loaded from the store joined the batch: counted, and its read measured
        for the cost rule."""
        self._totals["store_hit_tokens"] += num_tokens
        self._totals["store_read_bytes"] += nbytes
        if self.costs is not None:
            self.costs.note_read("store", nbytes, seconds)

    def start_layerwise_save(self, requests: list[Request]) -> Callable[[int], None] | None:
        """Engine hook before a step in which `requests` complete their prompt: returns the
        runner's per-layer callback that hands each layer's blocks to the connector as soon
        as the layer wrote them, so the transfer overlaps the rest of the forward. TP > 1
        MHA pools hold a head slice per rank: those save after the step (save_handoff); an
        MLA latent is whole on rank 0, which saves it layer by layer at any TP degree."""
        runner, bm = self.runner, self.block_manager
        if runner.tensor_parallel_size > 1 and self.connector.layout.kind == "mha" \
                and not getattr(runner, "layer_callbacks_see_whole_heads", False):
            return None
        if getattr(runner, "context_parallel_size", 1) > 1:  # rank 0 holds its blocks only
            return None
        if getattr(runner, "pipeline_parallel_size", 1) > 1:  # rank 0 holds stage 0's layers
            return None
        plans = []
        for request in requests:
            full = block_keys(request.prompt_token_ids, bm.block_size,
                              bm.root(request.cache_salt))
            keys = self.prompt_keys(request, full)
            block_ids = bm.block_table(request.request_id)[:len(keys)]
            plans.append((request.request_id, keys, block_ids))
            self._save_keys[request.request_id] = keys
            self._started_s["save", request.request_id] = time.monotonic()
            self._totals["saved_bytes"] += len(keys) * self.connector.block_bytes
            self._totals["layerwise_save_count"] += 1
        kv_caches = runner.kv_caches
        request_ids = [request.request_id for request in requests]

        def layer_done(layer: int) -> None:
            start_s = time.perf_counter()
            for plan in list(plans):
                request_id, keys, block_ids = plan
                try:
                    self.connector.save_layer(request_id, layer, keys, block_ids,
                                              kv_caches[layer])
                except Exception as exc:  # never fail the forward: decode recomputes
                    logger.warning("saving layer %d of %s failed: %s", layer, request_id, exc)
                    plans.remove(plan)
                    self._fail_save(request_id, keys)
            seconds = time.perf_counter() - start_s
            for request_id in request_ids:  # each one's forward waited for all of it
                self._layer_save_s[request_id] = self._layer_save_s.get(request_id, 0.0) + seconds

        return layer_done

    def take_layer_save_s(self, request_id: str) -> float:
        """Seconds the request's prefill forward spent in the per-layer save hook (it falls
        inside the prefill, so the request's phases report it apart); forgotten once taken."""
        return self._layer_save_s.pop(request_id, 0.0)

    def _fail_save(self, request_id: str, keys: list[bytes]) -> None:
        self.connector.abort(request_id)
        self._save_keys.pop(request_id, None)
        self._started_s.pop(("save", request_id), None)
        self._failed.append(TransferDone(request_id, "save", False, keys))

    def save_handoff(self, request: Request, block_ids: list[int], block_keys: list[bytes]
                     ) -> None:
        """Role hook, called before the request's blocks are freed: unless its layers are
        already on their way (start_layerwise_save), gather its blocks from every TP rank
        and let the connector put them in the background."""
        if request.request_id in self._save_keys:
            return
        keys = self.prompt_keys(request, block_keys)
        try:
            staged = self.runner.read_kv_blocks(block_ids[:len(keys)])
            local_ids = list(range(len(keys)))
            for layer, layer_blocks in enumerate(staged):  # [P, n, bs, all heads, D]
                self.connector.save_layer(request.request_id, layer, keys, local_ids,
                                          layer_blocks)
        except Exception as exc:  # never let a transfer stop the engine: decode recomputes
            logger.warning("saving the KV of %s failed: %s", request.request_id, exc)
            self._fail_save(request.request_id, keys)
            return
        self._save_keys[request.request_id] = keys
        self._started_s["save", request.request_id] = time.monotonic()
        self._totals["saved_bytes"] += sum(t.nbytes for t in staged)

    # ---- decode side: a finished answer, for the next turn ----------------------------------
    def save_answer(self, request: Request, block_ids: list[int], block_keys: list[bytes]
                    ) -> None:
        """Role hook (decode), called before a finished request's blocks are freed: its full
        blocks past the prompt's (the answer's, chained on the prompt's keys) go through to
        the fleet store, so the prefill worker of the conversation's next turn, whose prompt
        holds this answer, finds them with its store lookup (store_prefix_keys). The prompt's
        own full blocks are there already (the prefill's write-back). The blocks are copied
        here, on the engine's thread, and put on the connector's job thread, not at nice 19:
        the gateway holds the request's last Output until they are in (a client's next turn
        follows at once, and would miss them), ANSWER_HOLD_S at most. Nothing is pinned. Off
        without a store, without prefix caching, or with `saves_answers` False."""
        bm = self.block_manager
        first = len(request.prompt_token_ids) // bm.block_size
        if (not self.saves_answers or self.connector.backend is None
                or not bm.enable_prefix_caching or len(block_keys) <= first):
            return
        keys = list(block_keys[first:])
        try:
            layers = self.runner.read_kv_blocks(list(block_ids[first:len(block_keys)]))
            # per layer [P, n, bs, H, D] -> per block [num_layers, P, bs, H, D]
            blocks = list(torch.stack(layers).permute(2, 0, 1, 3, 4, 5).unbind(0))
        except Exception as exc:  # never let a cache copy fail a request
            logger.warning("reading the answer of %s failed: %s", request.request_id, exc)
            self._totals["answer_dropped_blocks"] += len(keys)
            return
        self._answers[request.request_id] = keys
        self.connector.put_blocks(request.request_id, keys, blocks)

    def is_saving_answer(self, request_id: str) -> bool:
        """The request's answer is on its way to the store (save_answer): poll() reports an
        "answer" TransferDone once it is there, or failed."""
        return request_id in self._answers

    # ---- decode side -----------------------------------------------------------------------
    def start_load(self, request_id: str, keys: list[bytes], lease_id: int = 0,
                   source: str = "") -> None:
        """Fetch blocks in the background, from the data node at `source` (else the fleet
        store); then release the lease that pinned them for this load (0: none). The blocks
        arrive in the TransferDone (`staging`, per layer) and `install` copies them into the
        pool blocks allocated then: one copy from the received buffer to the pool."""
        self._loads[request_id] = (keys, PendingLoad(len(keys), lease_id, source))
        self._started_s["load", request_id] = time.monotonic()
        self.connector.start_load(request_id, keys, list(range(len(keys))), None, source)

    def decide_source(self, handoff: KVHandoff, num_prompt_tokens: int) -> KVSource:
        """Decode, a hand-off whose KV would cross a link: where it comes from
        (KVSources.choose: transfer, store or recompute), counted; an offer that will not be
        read gives its lease back now."""
        if self.sources is None:
            return "transfer"
        choice = self.sources.choose(num_prompt_tokens, len(handoff.block_keys),
                                     handoff.source_address)
        self.sources.note(choice)
        if choice == "recompute":
            self.release(handoff.lease_id, handoff.source_address)
        return choice

    def map_handoff(self, handoff: KVHandoff
                    ) -> tuple[list[torch.Tensor], Callable[[], bool]] | None:
        """A hand-off's blocks where they lie, in the prefill worker's shared memory segment
        on this host: per layer, for `install` (straight into the pool, no load job and no
        request to the prefill worker), and the check to make once installed (False: freed
        meanwhile, the lease having expired). None: load them (another host, no segment)."""
        if handoff.shm_segment is None or not handoff.shm_spans:
            return None
        return self.connector.segments.map_blocks(handoff.shm_segment, handoff.shm_spans)

    def map_staging(self, staging: KVStaging
                    ) -> tuple[list[torch.Tensor], Callable[[], int], Callable[[], bool]] | None:
        """A prompt a prefill worker on this host is staging now (pdserve/serve/worker/follow.py):
        per layer, the number of layers staged so far, and the check to make once copied; None
        where it cannot be mapped."""
        return self.connector.segments.map_staging(staging.segment, staging.span,
                                                   staging.num_blocks)

    def names_staging(self, handoff: KVHandoff, staging: KVStaging) -> bool:
        """Whether a hand-off names the blocks of that staging (what map_staging mapped, or
        start_pull pulls)."""
        if staging.segment is None or staging.span is None:
            return (handoff.source_address == staging.source_address
                    and handoff.block_keys == staging.block_keys)
        return (handoff.shm_segment == staging.segment and handoff.shm_spans
                == self.connector.segments.staging_spans(staging.span, staging.num_blocks))

    def start_pull(self, staging: KVStaging, first_block: int, paused: bool = False
                   ) -> LayerPull:
        """Pull the layers of a staging on another host as they land, its blocks from
        `first_block` on (pdserve/serve/worker/follow.py; pdserve/handoff/layer_pull.py); `paused`:
        not before resume_pull."""
        return self.connector.start_pull(staging.source_address, staging.staging_id,
                                         staging.block_keys[first_block:], first_block, paused)

    def resume_pull(self, pull: LayerPull) -> None:
        self.connector.resume_pull(pull)

    def reserved(self, request_id: str, block_ids: list[int]) -> None:
        """Blocks were reserved for a followed prompt (HandoffTransport.reserve: a push
        transport registers them for the prefill to write into)."""
        self.connector.transport.reserve(request_id, block_ids)

    @property
    def can_write_layers(self) -> bool:
        """The pool takes a layer at a time (install_layer): one rank holds all of it, or
        each TP rank every layer (not a pipeline or context-parallel pool)."""
        return bool(getattr(self.runner, "can_write_kv_layers", False))

    def install_layer(self, layer: int, block_ids: list[int], blocks: torch.Tensor) -> None:
        """`install` of one layer [P, n, block_size, heads, head_dim] (can_write_layers)."""
        self.connector.transport.install(
            lambda ids, layers: self.runner.write_kv_layer(layer, ids, layers[0]), block_ids,
            [blocks])
        self._totals["loaded_bytes"] += blocks.nbytes

    def note_in_place(self, seconds: float, followed: bool = False,
                      pulled: bool = False) -> None:
        """A hand-off was admitted from its mapped blocks (map_handoff): a load, in place;
        `followed`: copied layer by layer while its prefill ran (pdserve/serve/worker/follow.py),
        out of the segment or, `pulled`, from the prefill worker's node (not in place then)."""
        self._totals["load_seconds"] += seconds
        self._totals["load_count"] += 1
        self._totals["in_place_count"] += not pulled
        self._totals["followed_count"] += followed
        self._totals["pulled_count"] += pulled
        if pulled and self.sources is not None:  # (its pull was the link policy's choice)
            self.sources.note("transfer")

    def install(self, block_ids: list[int], staging: list[torch.Tensor]) -> None:
        """Scatter a completed load into this worker's pool (every TP rank), as the transport
        installs (HandoffTransport.install)."""
        self.connector.transport.install(self.runner.write_kv_blocks, block_ids, staging)
        self._totals["loaded_bytes"] += sum(t.nbytes for t in staging)

    # ---- completions -----------------------------------------------------------------------
    def poll(self) -> list[TransferDone]:
        done, self._failed = self._failed, []
        for result in self.connector.poll():
            finished = self._finish(result)
            if finished is not None:
                done.append(finished)
        return done

    @property
    def has_failed(self) -> bool:
        """A failure noted in this thread waits for poll() (no transfer will wake the loop)."""
        return bool(self._failed)

    def totals(self) -> dict[str, float]:
        """Bytes moved and time spent since start (the worker reports them as metrics), the
        leases its hand-off node holds now (hand-offs not yet read by decode) and the saves
        it is staging there (pulled by decode workers elsewhere)."""
        node = self.connector.handoff_node
        sources = self.sources.totals() if self.sources is not None else {}
        return {**self._totals, **sources,
                "num_handoff_leases": float(self.connector.transport.num_leases),
                "num_live_stagings": float(len(node.stagings)) if node is not None else 0.0}

    def _finish(self, result: TransferResult) -> TransferDone | None:
        started_s = self._started_s.pop((result.kind, result.request_id), None)
        seconds = 0.0
        if started_s is not None:
            seconds = time.monotonic() - started_s
            self._totals[f"{result.kind}_seconds"] += seconds
            self._totals[f"{result.kind}_count"] += 1
        if result.kind == "put":  # an answer (save_answer)
            keys = self._answers.pop(result.request_id, None)
            if keys is None:  # forgotten meanwhile
                return None
            self._totals["answer_saved_blocks"] += result.num_blocks
            self._totals["answer_dropped_blocks"] += len(keys) - result.num_blocks
            ok = result.error is None and result.num_blocks == len(keys)
            return TransferDone(result.request_id, "answer", ok, keys)
        if result.kind == "save":
            keys = self._save_keys.pop(result.request_id, None)
            if keys is None:  # aborted meanwhile: nobody will load these blocks
                self.release(result.lease_id, result.source)
                self.start_write_back(result.write_back)
                return None
            ok = result.error is None and result.num_blocks == len(keys)
            return TransferDone(result.request_id, "save", ok, keys, lease_id=result.lease_id,
                                source=result.source, shm_segment=result.shm_segment,
                                shm_spans=result.shm_spans, write_back=result.write_back)
        entry = self._loads.pop(result.request_id, None)
        if entry is None:
            return None
        keys, pending = entry
        # loaded (or missed): the blocks need no pin now
        self.release(pending.lease_id, pending.source)
        ok = result.error is None and result.num_blocks == pending.num_blocks
        return TransferDone(result.request_id, "load", ok, keys, result.layers, seconds=seconds)

    def start_write_back(self, job: Callable[[], None] | None) -> None:
        """A save's copy into the fleet store (a later request's prefix), on the connector's
        fill thread."""
        if job is not None:
            self.connector.fill(job)

    def release(self, lease_id: int | None, source: str = "") -> None:
        if lease_id:
            self.connector.release(lease_id, source)

    def forget(self, request_id: str) -> None:
        """The request was aborted: drop its transfers' results when they come."""
        self._save_keys.pop(request_id, None)
        self._answers.pop(request_id, None)
        entry = self._loads.pop(request_id, None)
        if entry is not None:
            self.release(entry[1].lease_id, entry[1].source)
        self._started_s.pop(("save", request_id), None)
        self._started_s.pop(("load", request_id), None)
        self.connector.abort(request_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._save_keys) + len(self._loads) + len(self._answers)

    def close(self) -> None:
        self.connector.close()
        for part in (self.connector.backend, self.connector.handoff_node):
            if part is not None and hasattr(part, "close"):
                part.close()


def _log_memory_choice(device, client) -> None:
    """Say at start which memory the KV bytes cross: on CPU the pool is host memory and UCX
    reads it in place; on CUDA each layer's blocks are copied to pinned host staging (page-
    locked, so the device-to-host copy is asynchronous) and UCX moves host buffers. Device
    memory is never handed to UCX here, even where UCX was built with CUDA support."""
    transport = client.transport if client is not None else "ucx where both sides have it"
    if device.type == "cuda":
        logger.info("KV hand-off memory: device -> pinned host staging per layer, then %s "
                    "over host buffers (no GPU-direct UCX: a host bounce per block)", transport)
    else:
        logger.info("KV hand-off memory: host DRAM (the KV pool itself), staged per layer, "
                    "moved by %s (UCX_TLS=%s)", transport, os.environ.get("UCX_TLS", "default"))
