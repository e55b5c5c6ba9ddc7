"""A data-only node's link to its master: join, placement changes, heartbeats.

Runs on its own thread with its own socket. Changes are buffered and sent in order each
heartbeat interval; if the master does not know the node (it restarted, or dropped the node
after missed heartbeats), the node joins again and sends its whole inventory. The messages
are the master's verbs of pdserve/protocol/store.py: join, heartbeat, update, leave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from pdserve.kvstore.channel import ControlChannel, StoreRequestError, StoreUnavailable
from pdserve.protocol.store import (
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    PlacementChange,
    UpdateReply,
    UpdateRequest,
)

logger = logging.getLogger(__name__)

Change = tuple[bytes, "str | None"]


class MasterReporter:
    def __init__(self, ctx: zmq.Context, master_address: str, node_id: str, data_address: str,
                 interval_s: float, timeout_s: float, inventory: Callable[[], list[Change]],
                 max_changes_per_message: int = 4096):
        self._ctx = ctx
        self._master_address = master_address
        self._node_id = node_id
        self._data_address = data_address
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._inventory = inventory
        self._max_changes = max_changes_per_message
        self._changes: list[Change] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._joined = False
        self._thread = threading.Thread(target=self._loop, name="master-reporter", daemon=True)

    def record(self, key: bytes, tier: str | None) -> None:
        with self._lock:
            self._changes.append((key, tier))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        channel = ControlChannel(self._ctx, self._master_address, self._timeout_s)
        try:
            while not self._stop.is_set():
                try:
                    self._report(channel)
                except (StoreUnavailable, StoreRequestError) as e:
                    logger.warning("store node %s: master unreachable (%s)", self._node_id, e)
                    self._joined = False
                    channel.close()
                    channel = ControlChannel(self._ctx, self._master_address, self._timeout_s)
                self._stop.wait(self._interval_s)
            try:
                channel.request(LeaveRequest, LeaveReply, node_id=self._node_id)
            except (StoreUnavailable, StoreRequestError):
                pass
        finally:
            channel.close()

    def _report(self, channel: ControlChannel) -> None:
        if self._joined:
            reply = channel.request(HeartbeatRequest, HeartbeatReply, node_id=self._node_id)
            self._joined = reply.known
        if not self._joined:
            channel.request(JoinRequest, JoinReply, node_id=self._node_id,
                            address=self._data_address)
            # Outside self._lock: the inventory takes the store's lock, and the store calls
            # record() under it. Replaying buffered changes after the snapshot ends in the
            # current state, since each key's last change is the newest.
            inventory = self._inventory()
            with self._lock:
                self._changes = inventory + self._changes
            self._joined = True
        with self._lock:
            changes, self._changes = self._changes, []
        for start in range(0, len(changes), self._max_changes):
            batch = [PlacementChange(k, t) for k, t in changes[start:start + self._max_changes]]
            channel.request(UpdateRequest, UpdateReply, node_id=self._node_id, changes=batch)
