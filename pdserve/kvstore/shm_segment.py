"""Same-host KV reads in one user-space copy: a data node's blocks in a shared memory segment
that a reader on the same host maps read-only.

UCX's shared-memory transport moves a message past its eager size with the kernel's
cross-process copy (CMA: process_vm_readv), which pins the other process's pages as it goes
and is slower than a memcpy (benchmarks/kv_transfer.py measures both, `cma`
against `memcpy`, in docs/benchmarks.md); the one-copy transports (xpmem, knem)
are not in PyPI's libucx. So a node whose blocks are read on its own host (a prefill worker's
hand-off node) keeps them in a memfd segment (`ShmArena`), and a client on that host
(`ShmReader`: same boot, same PID namespace) opens it as /proc/<pid>/fd/<fd>, checks that it
is that file (inode, size), maps it read-only and copies a block straight out of it, where a
get's reply says it lies (pdserve/kvstore/data_service.py). Nothing is left behind when a process
dies: a memfd has no name, and its memory goes with the last mapping.

    segment   [alloc 0: header 64 B | data] [free ...] [alloc 1: header | data] ...
    header    uint64 serial: unique and non-zero while the allocation lives, 0 once freed;
              uint64 progress: how much of the data its writer has filled (a save staging a
              prompt counts its layers, so a reader can follow it layer by layer)

An allocation is freed when its data array and every view of it are gone (the tiers hold
views, so an evicted block's memory comes back by itself). A reader copies the data, then
reads the serial again: unchanged, the copy is the block the reply named. (A free zeroes the
serial before the memory can be handed out again; on x86 the stores of the reuse cannot be
seen before that store, nor the reader's serial load pass its copy's loads.) The progress
word works the same way: the writer stores it after the data it counts, so a reader on x86
that loads it first sees that data (`TOTAL_STORE_ORDER`; elsewhere a reader waits for the
message that says the writer is done).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import mmap
import os
import platform
import threading
import weakref
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from pdserve.protocol.store.data import ShmSegment, ShmSpan

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

HEADER_BYTES = 64  # serial and progress, padded to a cache line: the data starts aligned
TOTAL_STORE_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
ALIGN = 4096  # allocations start on pages


@cache
def host_identity() -> str:
    """Who can open this process's /proc/<pid>/fd: the same boot of the same kernel, and the
    same PID namespace (another container's PIDs name other processes). "" where there is no
    such thing (not Linux): no segment is shared then."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return f"{boot_id}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class ShmArena:
    """`capacity_bytes` of a memfd segment, handed out as uint8 arrays (first fit, freed when
    the array and its views are gone)."""

    def __init__(self, capacity_bytes: int, name: str = "pdserve-kv") -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if not hasattr(os, "memfd_create") or not host_identity():
            raise OSError("no memfd or /proc here: segments need Linux")
        self.size = _round_up(capacity_bytes, ALIGN)
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size)  # sparse: pages are taken as they are written
            self._map = mmap.mmap(self._fd, self.size)
        except OSError:
            os.close(self._fd)
            raise
        self._words = np.frombuffer(self._map, np.uint64)  # the headers' serials
        self.segment = ShmSegment(host_identity(), os.getpid(), self._fd,
                                  os.fstat(self._fd).st_ino, self.size)
        self._lock = threading.RLock()  # a free may run inside allocate (a collected view)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, bytes), by offset
        self._live: dict[int, tuple[int, int, int]] = {}  # offset -> (bytes, serial, data bytes)
        self._starts: list[int] = []  # sorted offsets of _live
        self._serials = itertools.count(1)
        self._closed = False

    # ---- allocation ---------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A uint8 array of `nbytes` in the segment, or None when no free run is large enough."""
        size = _round_up(nbytes + HEADER_BYTES, ALIGN)
        with self._lock:
            if self._closed:
                return None
            i = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if i is None:
                return None
            offset, free = self._free[i]
            if free == size:
                del self._free[i]
            else:
                self._free[i] = (offset + size, free - size)
            serial = next(self._serials)
            self._live[offset] = (size, serial, nbytes)
            bisect.insort(self._starts, offset)
            self._words[offset // 8] = serial
            self._words[offset // 8 + 1] = 0  # progress
        data = (ctypes.c_uint8 * nbytes).from_buffer(self._map, offset + HEADER_BYTES)
        finalizer = weakref.finalize(data, self._release, offset)
        finalizer.atexit = False
        return np.frombuffer(data, np.uint8)  # keeps `data` (and so the allocation) alive

    def _release(self, offset: int) -> None:
        with self._lock:
            size = self._live.pop(offset)[0]
            self._starts.pop(bisect.bisect_left(self._starts, offset))
            self._words[offset // 8] = 0  # before the memory can be handed out again
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # coalesce with the next free run, then with the previous one
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                start, before = self._free.pop(i - 1)
                self._free[i - 1] = (start, before + self._free[i - 1][1])

    def locate(self, address: int, nbytes: int) -> ShmSpan | None:
        """Where `nbytes` at `address` (a block: a view of an allocation) lie in the segment,
        for a reader; None when they are not all inside one live allocation."""
        offset = address - self._words.ctypes.data
        if not 0 <= offset < self.size:
            return None
        with self._lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            if i < 0:
                return None
            start = self._starts[i]
            _, serial, data_bytes = self._live[start]
            if offset < start + HEADER_BYTES or offset + nbytes > start + HEADER_BYTES + data_bytes:
                return None
        return ShmSpan(offset, start, serial)

    def set_progress(self, header: int, value: int) -> None:
        """Publish how much of the allocation at `header` is filled (after filling it)."""
        self._words[header // 8 + 1] = value

    def locate_blocks(self, blocks: list[torch.Tensor]) -> list[ShmSpan] | None:
        """`locate` of each block (contiguous tensors), or None unless every one lies here."""
        spans = [self.locate(block.data_ptr(), block.nbytes) for block in blocks]
        return None if None in spans else spans

    # ---- what tests and metrics look at -------------------------------------------------------
    @property
    def num_allocations(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def check_integrity(self) -> None:
        """Free runs and live allocations tile the segment, without overlap."""
        with self._lock:
            runs = sorted([*self._free, *((o, live[0]) for o, live in self._live.items())])
            position = 0
            for offset, size in runs:
                if offset != position or size <= 0:
                    raise AssertionError(f"shm arena: run at {offset} (expected {position})")
                position += size
            if position != self.size or self._starts != sorted(self._live):
                raise AssertionError("shm arena: runs do not cover the segment")

    def close(self) -> None:
        """Stop handing out memory. The mapping itself lives on while arrays into it do (the
        segment goes with the process, or with the last reader's mapping)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self._fd)


class ShmReader:
    """A read-only mapping of another process's segment on this host."""

    def __init__(self, segment: ShmSegment) -> None:
        if not segment.host or segment.host != host_identity():
            raise OSError("the segment is on another host (or PID namespace)")
        fd = os.open(f"/proc/{segment.pid}/fd/{segment.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.fstat(fd)
            if stat.st_ino != segment.inode or stat.st_size != segment.size:
                raise OSError(f"/proc/{segment.pid}/fd/{segment.fd} is not the segment named "
                              "(the process or its descriptor was replaced)")
            self._map = mmap.mmap(fd, segment.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.segment = segment
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._words = np.frombuffer(self._map, np.uint64)

    def views(self, spans: list[ShmSpan], nbytes: int) -> list[np.ndarray] | None:
        """Read-only views of blocks of `nbytes` at `spans` (no copy); None if one of them is
        freed already. Whoever copies out of them checks `intact(spans)` afterwards."""
        if not self._all_live(spans, nbytes):
            return None
        return [self._bytes[span.offset:span.offset + nbytes] for span in spans]

    def _all_live(self, spans: list[ShmSpan], nbytes: int) -> bool:
        """Every span lies inside the segment (else ValueError) and is not freed yet."""
        for span in spans:
            self._check(span, nbytes)
        return all(self.intact(spans))

    def _check(self, span: ShmSpan, nbytes: int) -> None:
        if (span.header % 8 or span.header + HEADER_BYTES > span.offset
                or span.offset + nbytes > self.segment.size):
            raise ValueError("shm: a span outside the segment")

    def run(self, spans: list[ShmSpan], nbytes: int) -> np.ndarray | None:
        """One read-only view over blocks of `nbytes` at `spans` when they lie back to back
        (a save's staged blocks do), else None; None too if one of them is freed already."""
        if not spans or any(span.offset != spans[0].offset + i * nbytes
                            for i, span in enumerate(spans)):
            return None
        if not self._all_live(spans, nbytes):
            return None
        return self._bytes[spans[0].offset:spans[0].offset + len(spans) * nbytes]

    def intact(self, spans: list[ShmSpan]) -> list[bool]:
        """Per span: is its allocation still the one it names (not freed since)?"""
        serials = {header: int(self._words[header // 8])
                   for header in {span.header for span in spans}}  # a save's share one
        return [serials[span.header] == span.serial for span in spans]

    def progress(self, span: ShmSpan) -> int:
        """The progress its writer published for the allocation `span` names (0 once freed:
        check `intact` too)."""
        self._check(span, 0)
        return int(self._words[span.header // 8 + 1])

    def copy(self, spans: list[ShmSpan], sizes: list[int], out: np.ndarray) -> list[bool]:
        """Copy block i (`sizes[i]` bytes at spans[i]) into `out`, back to back; per block,
        whether it was still the one named when the copy ended (False: freed meanwhile, its
        bytes in `out` are garbage)."""
        if len(spans) != len(sizes) or sum(sizes) > out.nbytes:
            raise ValueError("shm copy: one size per span, and room for them all in out")
        for span, size in zip(spans, sizes, strict=True):
            self._check(span, size)
        valid = self.intact(spans)
        position = 0
        for span, size in zip(spans, sizes, strict=True):
            out[position:position + size] = self._bytes[span.offset:span.offset + size]
            position += size
        return [before and after for before, after in zip(valid, self.intact(spans),
                                                          strict=True)]

    def close(self) -> None:
        del self._bytes, self._words
        try:
            self._map.close()
        except BufferError:  # an array into it is still referenced somewhere: leave it
            logger.debug("shm reader: mapping still in use at close")
