"""A data-only node's link to its master: join, placement changes, heartbeats with usage.

Runs on its own thread with its own socket. Changes are sent in order soon after they happen
(the thread wakes on a change and waits FLUSH_DELAY_S to batch the ones that follow), so a
block a client wrote is findable at the master within milliseconds; heartbeats carry the
node's usage (capacity, blocks, bytes: placement spreads by it) every interval. If the
master does not know the node (it restarted, or dropped the node after missed heartbeats),
the node joins again and sends its whole inventory. On stop it says goodbye (`leave`), so
the master forgets its blocks at once rather than after node_ttl_s. A heartbeat's reply may
name blocks to copy to other nodes (a holder left and they fell under the store's
`--replicas`): the node writes them there itself, and the targets' reports index them. The
messages are the master's verbs of pdserve/protocol/store/: join, heartbeat, update, leave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from pdserve.kvstore.channel import ControlChannel, StoreRequestError, StoreUnavailable
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.master import Usage
from pdserve.protocol.store.master import (
    BlockCopy,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    NodeUsage,
    PlacementChange,
    UpdateReply,
    UpdateRequest,
)

logger = logging.getLogger(__name__)

Change = tuple[bytes, "str | None"]

FLUSH_DELAY_S = 0.005
"""After a change wakes the reporter, it waits this long for more before sending."""


class MasterReporter:
    def __init__(self, ctx: zmq.Context, master_address: str, node_id: str, data_address: str,
                 interval_s: float, timeout_s: float, inventory: Callable[[], list[Change]],
                 max_changes_per_message: int = 4096,
                 usage: Callable[[], Usage] | None = None,
                 read: Callable[[list[bytes]], list[Any]] | None = None):
        """`read`: this node's blocks by key (None for a missing one), for the copies the
        master asks for (re-replication)."""
        self._ctx = ctx
        self._master_address = master_address
        self._node_id = node_id
        self._data_address = data_address
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        # Heartbeats and updates wait a few intervals, not the request timeout: one sent to a
        # master that died is never answered, and the node joins the restarted master only
        # once it gives up (an update lost so is no loss: the join resends the inventory).
        self._beat_timeout_s = min(timeout_s, max(1.0, 4 * interval_s))
        self._inventory = inventory
        self._usage = usage
        self._read = read
        self._peers: dict[str, StoreClient] = {}  # target address -> client, for copies
        self._max_changes = max_changes_per_message
        self._changes: list[Change] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a change is waiting to be sent
        self._joined = False
        self._thread = threading.Thread(target=self._loop, name="master-reporter", daemon=True)

    def record(self, key: bytes, tier: str | None) -> None:
        with self._lock:
            self._changes.append((key, tier))
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        channel = ControlChannel(self._ctx, self._master_address, self._beat_timeout_s)
        next_beat_s = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_beat_s or not self._joined:
                        next_beat_s = time.monotonic() + self._interval_s
                        self._beat(channel)
                    self._send_changes(channel)
                except (StoreUnavailable, StoreRequestError) as e:
                    logger.warning("store node %s: master unreachable (%s)", self._node_id, e)
                    self._joined = False
                    channel.close()
                    channel = ControlChannel(self._ctx, self._master_address, self._beat_timeout_s)
                    self._stop.wait(self._interval_s)
                    continue
                self._wake.wait(max(0.0, next_beat_s - time.monotonic()))
                self._wake.clear()
                self._stop.wait(FLUSH_DELAY_S)  # let a burst of changes gather
            self._goodbye(channel)
        finally:
            channel.close()
            for peer in self._peers.values():
                peer.close()

    def _goodbye(self, channel: ControlChannel) -> None:
        """Leave the master: it forgets this node's blocks now, not after node_ttl_s."""
        channel.timeout_s = min(channel.timeout_s, 1.0)  # a gone master must not stall a stop
        try:
            channel.request(LeaveRequest, LeaveReply, node_id=self._node_id)
        except (StoreUnavailable, StoreRequestError):
            pass

    def _node_usage(self) -> NodeUsage | None:
        if self._usage is None:
            return None
        usage = self._usage()
        return NodeUsage(usage.capacity_blocks, usage.num_blocks, usage.num_bytes)

    def _beat(self, channel: ControlChannel) -> None:
        if self._joined:
            reply = channel.request(HeartbeatRequest, HeartbeatReply, node_id=self._node_id,
                                    usage=self._node_usage())
            self._joined = reply.known
            if reply.copies:
                self._copy(reply.copies)
        if not self._joined:
            channel.timeout_s = self._timeout_s  # a master just started may be slow to answer
            try:
                channel.request(JoinRequest, JoinReply, node_id=self._node_id,
                                address=self._data_address, usage=self._node_usage())
            finally:
                channel.timeout_s = self._beat_timeout_s
            # Outside self._lock: the inventory takes the store's lock, and the store calls
            # record() under it. Replaying buffered changes after the snapshot ends in the
            # current state, since each key's last change is the newest.
            inventory = self._inventory()
            with self._lock:
                self._changes = inventory + self._changes
            self._joined = True

    def _copy(self, copies: list[BlockCopy]) -> None:
        """Re-replication: write the named blocks of this node to their targets (a target
        that fails is skipped: the master plans again when the next holder leaves)."""
        if self._read is None:
            return
        by_target: dict[str, list[bytes]] = {}
        for copy in copies:
            by_target.setdefault(copy.target, []).append(copy.key)
        for target, keys in by_target.items():
            found = [(k, b) for k, b in zip(keys, self._read(keys), strict=True) if b is not None]
            if not found:
                continue
            try:
                peer = self._peers.get(target)
                if peer is None:
                    peer = self._peers[target] = StoreClient(target, transport="zmq",
                                                             timeout_s=self._timeout_s)
                peer.put_many([k for k, _ in found],
                              [b.view(-1).view(torch.uint8).numpy() if hasattr(b, "numpy")
                               else b for _, b in found])
            except Exception as e:  # a copy that fails leaves the block under its replicas
                logger.warning("store node %s: copying %d blocks to %s failed (%s)",
                               self._node_id, len(found), target, e)
                peer = self._peers.pop(target, None)
                if peer is not None:
                    peer.close()

    def _send_changes(self, channel: ControlChannel) -> None:
        with self._lock:
            changes, self._changes = self._changes, []
        for start in range(0, len(changes), self._max_changes):
            batch = [PlacementChange(k, t) for k, t in changes[start:start + self._max_changes]]
            reply = channel.request(UpdateRequest, UpdateReply, node_id=self._node_id,
                                    changes=batch)
            if not reply.known:  # dropped meanwhile: join again and send the inventory
                self._joined = False
                return
