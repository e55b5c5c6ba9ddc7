"""Leases: a pin with a deadline, so a client that crashes never pins blocks forever.

A holder acquires a lease on some keys for ttl seconds and renews it while it still needs the
blocks; release ends it early. `expire()` returns the leases whose deadline passed; the owner
(the data server) then unpins their blocks. Lease ids are random 63-bit numbers, so one client
cannot guess and release another's lease.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Lease:
    lease_id: int
    holder: str
    keys: tuple[bytes, ...]
    expires_at_s: float  # on the table's clock (monotonic)


class LeaseTable:
    """lease id -> Lease, with expiry on an injectable monotonic clock (tests fake time)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._leases: dict[int, Lease] = {}

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_leased_keys(self) -> int:
        """Keys summed over leases (a key in two leases counts twice, like its pins)."""
        return sum(len(lease.keys) for lease in self._leases.values())

    def acquire(self, holder: str, keys: Sequence[bytes], ttl_s: float) -> Lease:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        lease_id = secrets.randbits(63)
        while lease_id in self._leases:
            lease_id = secrets.randbits(63)
        lease = Lease(lease_id, holder, tuple(keys), self._clock() + ttl_s)
        self._leases[lease_id] = lease
        return lease

    def renew(self, lease_id: int, ttl_s: float) -> bool:
        """Push the deadline out; False if the lease is unknown (expired or released)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.expires_at_s = self._clock() + ttl_s
        return True

    def release(self, lease_id: int) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def expire(self) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = self._clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at_s <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired

    def release_all(self) -> list[Lease]:
        leases = list(self._leases.values())
        self._leases.clear()
        return leases
