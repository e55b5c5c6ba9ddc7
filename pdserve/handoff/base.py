"""The interface every hand-off transport implements: how a prefill's prompt KV reaches decode.

Connector-shaped (vLLM's KV connector is the model): the hand-off connector
(pdserve/handoff/connector.py) stages a prompt's blocks layer by layer and calls its transport
at each step; the decode worker's admission (pdserve/serve/worker/admission.py) calls the
decode side through KVTransfer. A transport moves bytes; it never sees the engine: block ids
are plain ints, and the pool is written through the `write` callable it is given.

    prefill side                           decode side
    staging_buffer(nbytes)  where to stage  reserve(request_id, block_ids)   blocks to land in
    begin_save(save)        a save starts   receive(keys, source)   the blocks a hand-off names
    save_layer(save, n)     n layers staged receive_layers(pull)    the layers staged so far
    finish(keys, blocks)    the offer       install(write, ids, layers)      into the pool
    end_save(save)          staging unread  release(lease_id, source)        the offer's lease

A pull transport ("node", "store") does its work on the decode side: `receive` reads the
offered blocks, `receive_layers` asks the prefill's node for the layers staged since the last
ask, and `install` copies them into the blocks decode allocated. A push transport (a one-sided
write into decode's registered memory, NIXL-style) would do it on the prefill side instead:
`reserve` registers decode's blocks and sends their addresses with the follow, `save_layer`
writes each staged layer into them, and `receive_layers` / `install` only report what landed
(nothing to copy). Every method may fail: a failure is a miss and the request recomputes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pdserve.handoff.link_policy import KVSourcePolicy, LinkMeter
from pdserve.kvstore.connector import BlockBackend, Save
from pdserve.kvstore.memory_tier import BytesLike
from pdserve.protocol.store.data import ShmSegment, ShmSpan

if TYPE_CHECKING:
    from pdserve.handoff.layer_pull import LayerPull
    from pdserve.handoff.node_server import HandoffNode
    from pdserve.handoff.peers import PeerNodes
    from pdserve.handoff.wire_fp8 import Fp8Wire

WriteBlocks = Callable[[list[int], list[torch.Tensor]], None]
"""Writes blocks per layer ([P, n, block_size, heads, head_dim]) into pool blocks (the
runner's write_kv_blocks)."""


@dataclass(frozen=True)
class Offer:
    """What a finished save stored, and where decode finds it."""

    num_stored: int
    """Leading blocks stored."""
    error: str | None = None
    lease_id: int | None = None
    """The lease pinning them until decode has read them (None: no lease TTL, or none stored)."""
    source: str = ""
    """The data node holding them and the lease ("": the fleet store)."""
    shm_segment: ShmSegment | None = None
    """The node's shared memory segment, when every block lies in it..."""
    shm_spans: list[ShmSpan] | None = None
    """...and where each of them does (a decode worker on this host maps them in place)."""
    write_back: Callable[[], None] | None = None
    """Off the critical path, after the offer is announced: copy the blocks to the fleet store."""


class HandoffTransport(ABC):
    """One way a prompt's KV crosses from a prefill worker to a decode worker (see the module
    docstring). Made by the registry (pdserve/handoff/registry.py) from the fleet store
    (`backend`, None: none), the clients of other workers' nodes (`peers`) and, for a
    transport that serves its offers itself, this worker's own data node (`node`)."""

    name: ClassVar[str]
    """The registry name (`--kv-handoff`)."""
    needs_node: ClassVar[bool] = False
    """The transport serves its offers from this worker's own data node (made for it)."""
    offers_in_process: ClassVar[bool] = False
    """`finish` does no I/O: the connector runs it on the forward's thread, at once."""

    def __init__(self, backend: BlockBackend | None, peers: PeerNodes,
                 node: HandoffNode | None = None) -> None:
        if self.needs_node != (node is not None):
            raise ValueError(f"the {self.name!r} hand-off transport "
                             f"{'needs' if self.needs_node else 'takes no'} data node")
        self.backend = backend
        self.peers = peers
        self.node = node
        """This worker's own data node, where offers land (None: they do not)."""
        self.links = LinkMeter()
        """What each peer's transfers to this worker gave (pdserve/handoff/link_policy.py)."""
        self.policy = KVSourcePolicy(self.links, has_store=backend is not None)
        """Where a hand-off's KV comes from, by predicted time (decode's choice)."""
        self.wire: Fp8Wire | None = None
        """How this worker's offers cross (`--handoff-wire`): None raw, else encoded by it
        (pdserve/handoff/wire_fp8.py); a receiver decodes whatever it is sent."""

    # ---- prefill side ----------------------------------------------------------------------
    def staging_buffer(self, nbytes: int) -> torch.Tensor | None:
        """Host memory (uint8) of `nbytes` for a save's blocks where decode can read them
        while they stage (a shared memory segment); None: the connector allocates plain
        host memory. Called on the forward's thread."""
        return None

    def begin_save(self, save: Save) -> None:
        """A save is about to stage its first layer (`save.keys`, `save.staging`, named by
        `save.staging_id`). A transport that lets decode follow the staging registers it
        here. Called on the forward's thread; must not block."""
        return None  # (optional: a transport without the step has nothing to do)

    def save_layer(self, save: Save, num_staged: int, event: Any = None) -> None:
        """The save's first `num_staged` layers are staged (their device copies recorded in
        `event` on CUDA, None on CPU). A pull transport publishes the progress for followers;
        a push transport writes the new layers to decode's reserved blocks. Called on the
        forward's thread, in layer order; must not block on the network."""
        return None  # (optional: a transport without the step has nothing to do)

    @abstractmethod
    def finish(self, keys: list[bytes], blocks: list[torch.Tensor],
               lease_ttl_s: float | None) -> Offer:
        """Every layer is staged: offer the blocks (whole stored blocks, uint8) for decode,
        pinned under a lease of `lease_ttl_s`, and say where they are (the hand-off carries
        the Offer). Runs on the connector's job thread unless `offers_in_process`. Never
        raises: a failure is an Offer with `error` (decode then recomputes)."""

    def end_save(self, save: Save) -> None:
        """The save's staging is no longer read (offered, or aborted): followers read what is
        left from the offer."""
        return None  # (optional: a transport without the step has nothing to do)

    # ---- decode side -----------------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: list[int]) -> None:
        """Decode reserved `block_ids` for a prompt it follows (before the hand-off comes).
        A pull transport needs nothing; a push transport registers them for the prefill
        to write into."""
        return None  # (optional: a transport without the step has nothing to do)

    @abstractmethod
    def receive(self, keys: list[bytes], source: str, block_bytes: int) -> list[BytesLike]:
        """The leading blocks of an offer (`keys`, at `source`: a node's address, "" for the
        fleet store), each of `block_bytes`; fewer (possibly none) where the rest could not
        be read. Runs on the connector's job thread; never raises."""

    @abstractmethod
    def receive_layers(self, pull: LayerPull) -> bool:
        """One step of following a staging on another host: hand `pull` the layers landed
        since the last step (pull.step); whether to call again. A failure sets `pull.failed`
        (the hand-off then takes the usual path). Runs on the connector's job thread."""

    def install(self, write: WriteBlocks, block_ids: list[int],
                layers: list[torch.Tensor]) -> None:
        """Put received blocks (per layer, [P, n, block_size, heads, head_dim]) into pool
        blocks `block_ids` through `write`. A push transport, whose bytes landed there
        already, has nothing to copy."""
        write(block_ids, layers)

    @abstractmethod
    def release(self, lease_id: int, source: str) -> None:
        """Give an offer's lease back to `source` once decode has its blocks (or a prefill
        whose hand-off was dropped); a failure leaves it to expire. Job thread."""

    # ---- what a worker reports and closes --------------------------------------------------
    @property
    def staging_segment(self) -> ShmSegment | None:
        """The shared memory segment that `staging_buffer` allocates in (None: none)."""
        return None

    def locate(self, blocks: Sequence[torch.Tensor]) -> list[ShmSpan] | None:
        """Where blocks allocated by `staging_buffer` lie in its segment (None: not all)."""
        return None

    @property
    def num_leases(self) -> int:
        """Leases of offers not read yet that this worker holds (a store's are not)."""
        return 0

    def close(self) -> None:
        """Close the clients of other workers' nodes (the worker closes its own node)."""
        self.peers.close()
