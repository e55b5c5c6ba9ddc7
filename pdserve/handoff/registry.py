"""The hand-off transports by name, and the one function that chooses a worker's hand-off.

    TRANSPORTS   name -> "module:Class", imported only when chosen (a transport that needs
                 UCX, NIXL or a device library costs nothing to a worker that runs another)
    choose_handoff(flags)   the worker's flags -> HandoffChoice | None

Adding a transport is one file (a HandoffTransport, pdserve/handoff/base.py) and one line
here; the worker flag `--kv-handoff` then takes its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (this module imports no torch: the worker's flags read TRANSPORTS)
    from pdserve.handoff.base import HandoffTransport
    from pdserve.handoff.node_server import HandoffNode
    from pdserve.kvstore.connector import BlockBackend

TRANSPORTS: dict[str, str] = {
    "node": "pdserve.handoff.node:NodeHandoff",
    "store": "pdserve.handoff.store:StoreHandoff",
}
"""Every hand-off transport: its `--kv-handoff` name -> where its class lives."""

WIRES = ("raw", "fp8")
"""`--handoff-wire`: the pool's bytes, or FP8 with per-block scales (pdserve/handoff/wire_fp8.py;
the same names as its WIRES, kept here so that the flags import no torch)."""

AUTO = "auto"
"""`--kv-handoff auto`: "node" where the worker has a node (`--handoff-dram-gb` > 0), else
"store"."""


def transport_class(name: str) -> type[HandoffTransport]:
    """The transport class registered as `name`, imported now."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown hand-off transport {name!r}; known: {sorted(TRANSPORTS)}")
    module_name, _, class_name = TRANSPORTS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_transport(name: str, backend: BlockBackend | None,
                   connect: Callable[[str], BlockBackend] | None = None,
                   node: HandoffNode | None = None) -> HandoffTransport:
    """The transport `name` over the fleet store `backend` (None: none), reaching other
    workers' nodes with `connect(address)`; one that `needs_node` takes this worker's own
    `node`, and only it does."""
    from pdserve.handoff.peers import PeerNodes

    return transport_class(name)(backend, PeerNodes(connect, node), node)


@dataclass(frozen=True)
class HandoffChoice:
    """How this worker hands KV off."""

    transport: str
    """A transport by name (TRANSPORTS)."""
    shm: bool = True
    """Same host: the node stages prompts in shared memory, and this worker reads the
    segments of the nodes it loads from (`--handoff-shm`)."""
    follow: bool = True
    """With a node: a prefill announces its stagings, for decode workers to follow (on its
    host out of the segment, elsewhere by pulling each layer from the node)
    (`--handoff-follow`)."""
    wire: str = "raw"
    """How a node's offers cross (`--handoff-wire`, WIRES): raw, or fp8 (1 byte a value and
    per-block scales, pdserve/handoff/wire_fp8.py), encoded at offer. A layer pull moves the
    staging as it lies, so an fp8 wire is not followed (`follow` False)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown hand-off transport {self.transport!r}; known: "
                             f"{sorted(TRANSPORTS)}")
        if self.wire not in WIRES:
            raise ValueError(f"unknown hand-off wire {self.wire!r}; known: {list(WIRES)}")
        if self.wire != "raw" and self.follow:
            raise ValueError("an fp8 hand-off wire is not followed (a layer pull moves the "
                             "staging's raw bytes)")

    @property
    def needs_node(self) -> bool:
        """The transport serves offers from the worker's own data node (made for it)."""
        return transport_class(self.transport).needs_node


class HandoffFlags(Protocol):
    """What choose_handoff reads of a worker's configuration (its WorkerConfig)."""

    role: str
    store_address: str | None
    store_master_address: str | None
    handoff_dram_gb: float
    kv_handoff: str
    handoff_shm: bool
    handoff_follow: bool
    handoff_wire: str


def choose_handoff(flags: HandoffFlags) -> HandoffChoice | None:
    """The one place a worker's flags pick its hand-off; None: it hands nothing off (a
    colocated worker, or neither a node nor a store: decode recomputes). `--kv-handoff auto`
    (the default) is "node" with `--handoff-dram-gb` > 0, else "store". `--handoff-wire fp8`
    needs a node and turns following off (HandoffChoice.wire)."""
    has_store = flags.store_address is not None or flags.store_master_address is not None
    if flags.role == "colocated" or (not has_store and flags.handoff_dram_gb == 0):
        return None
    name = flags.kv_handoff
    if name == AUTO:
        name = "node" if flags.handoff_dram_gb > 0 else "store"
    wire = flags.handoff_wire
    choice = HandoffChoice(name, shm=flags.handoff_shm,
                           follow=flags.handoff_follow and wire == "raw", wire=wire)
    if wire != "raw" and not choice.needs_node:
        raise ValueError(f"--handoff-wire {wire} encodes a node's offers; --kv-handoff {name} "
                         "puts them in the fleet store, which keeps the pool's bytes")
    if choice.needs_node and flags.handoff_dram_gb <= 0:
        raise ValueError(f"--kv-handoff {name} needs a node: give --handoff-dram-gb > 0")
    if not choice.needs_node and not has_store:
        raise ValueError(f"--kv-handoff {name} hands off through the store: give --store "
                         "or --store-master")
    return choice
