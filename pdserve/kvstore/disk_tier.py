"""The disk tier: one file per block under a directory, written behind by a background thread.

File layout (little endian):

    | b"PDKV" | key_len u16 | payload_len u64 | blake2b-128(key + payload) | key | payload |

A block is readable the moment it is inserted (from the pending-write map until the writer
thread has it on disk). A read verifies the checksum; a corrupted or truncated file is deleted
and reported as a miss (the KV cache is a cache: the engine recomputes). On start the tier
re-indexes the files already in its directory, oldest modification time first, so the LRU
order (an LRUIndex of key -> payload size, lru_index.py) survives a restart approximately.

Crashes: a block is written to `<key>.kv.tmp` and renamed into place, so a process killed
mid-write leaves a whole block or a .tmp file; a restart deletes .tmp files and files whose
size is not a whole block, and the checksum catches any other damage at read time. No fsync:
a killed process loses nothing the kernel took, and a block lost to a power cut is a miss.

Threads: the index is the TieredStore's to guard (it calls every index verb under its lock);
the pending map is shared with the writer thread under this tier's own lock. `load` reads a
block without touching the index, so the store can run it outside its lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections.abc import Iterator

import torch

from pdserve.kvstore.lru_index import LRUIndex
from pdserve.kvstore.memory_tier import as_uint8_tensor

logger = logging.getLogger(__name__)

_MAGIC = b"PDKV"
_HEADER = struct.Struct("<4sHQ16s")  # magic, key_len, payload_len, checksum
_SUFFIX = ".kv"


def _checksum(key: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(key)
    h.update(payload)
    return h.digest()


class DiskTier:
    """LRU index key -> file, capacity in blocks, write-behind, checksummed."""

    def __init__(self, name: str, capacity_blocks: int, directory: str,
                 max_pending_writes: int = 4096, backpressure_timeout_s: float = 30.0):
        if capacity_blocks <= 0:
            raise ValueError(f"{name}: capacity_blocks must be positive, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.directory = directory
        # Write-behind must not hold unbounded memory when blocks arrive faster than the disk
        # takes them: past this many queued writes, insert waits for the writer.
        self.max_pending_writes = max_pending_writes
        self.backpressure_timeout_s = backpressure_timeout_s
        self.num_backpressure_waits = 0
        os.makedirs(directory, exist_ok=True)
        self._index: LRUIndex[int] = LRUIndex()  # key -> payload bytes
        self.num_bytes = 0
        """Payload bytes indexed (the master's placement and status read it)."""
        self._pending: dict[bytes, torch.Tensor] = {}  # inserted, not yet on disk
        self._ops: queue.Queue[tuple[str, bytes, torch.Tensor | None] | None] = queue.Queue()
        self._lock = threading.Lock()  # guards _pending against the writer thread
        self._idle = threading.Condition(self._lock)
        self._num_outstanding = 0
        self.num_corrupted = 0
        self._reindex()
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer",
                                         daemon=True)
        self._writer.start()

    # ---- index ------------------------------------------------------------------------------
    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + _SUFFIX)

    def _reindex(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a write the previous process never finished
                continue
            if not entry.name.endswith(_SUFFIX):
                continue
            header = self._read_header(entry.path)
            if header is None or entry.stat().st_size != (
                    _HEADER.size + len(header[0]) + header[1]):  # torn: no whole block
                os.unlink(entry.path)
                continue
            key, payload_len = header
            found.append((entry.stat().st_mtime, key, payload_len))
        found.sort()
        for _, key, payload_len in found[-self.capacity_blocks:]:
            self._index.insert(key, payload_len)
            self.num_bytes += payload_len
        for _, key, _ in found[: max(0, len(found) - self.capacity_blocks)]:
            os.unlink(self._path(key))
        if found:
            logger.info("%s: re-indexed %d blocks from %s", self.name, len(self._index),
                        self.directory)

    def _read_header(self, path: str) -> tuple[bytes, int] | None:
        try:
            with open(path, "rb") as f:
                raw = f.read(_HEADER.size)
                magic, key_len, payload_len, _ = _HEADER.unpack(raw)
                key = f.read(key_len)
        except (OSError, struct.error):
            return None
        if magic != _MAGIC or len(key) != key_len or os.path.basename(path) != key.hex() + _SUFFIX:
            return None
        return key, payload_len

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def is_full(self) -> bool:
        return len(self._index) >= self.capacity_blocks

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def keys_oldest_first(self) -> Iterator[bytes]:
        """A live iterator: stop iterating before changing the tier."""
        return self._index.oldest_first()

    def touch(self, key: bytes) -> None:
        self._index.touch(key)

    # ---- data -------------------------------------------------------------------------------
    def insert(self, key: bytes, data: torch.Tensor, adopt: bool = False) -> None:
        """Queue `data` for writing; readable at once from the pending map. With `adopt` a
        host tensor is written from as it is (the caller gives it up), else from a copy."""
        src = as_uint8_tensor(data)
        buf = src if adopt and src.device.type == "cpu" else src.to("cpu", copy=True)
        self.num_bytes += buf.numel() - (self._index.get(key) or 0)
        self._index.insert(key, buf.numel())
        with self._lock:
            if len(self._pending) >= self.max_pending_writes:
                self.num_backpressure_waits += 1
                if not self._idle.wait_for(
                        lambda: len(self._pending) < self.max_pending_writes,
                        timeout=self.backpressure_timeout_s):
                    logger.warning("%s: the disk is %d writes behind after waiting %.0f s",
                                   self.name, len(self._pending), self.backpressure_timeout_s)
            self._pending[key] = buf
            self._num_outstanding += 1
        self._ops.put(("write", key, buf))

    def read(self, key: bytes) -> torch.Tensor | None:
        """The block, or None when absent or corrupted (then it is also dropped)."""
        if key not in self._index:
            return None
        payload = self.load(key)
        if payload is None:
            self.num_corrupted += 1
            logger.warning("%s: block %s is corrupted or missing on disk; dropped (a miss)",
                           self.name, key.hex())
            self.remove(key)
            return None
        return payload

    def load(self, key: bytes) -> torch.Tensor | None:
        """The block from the pending-write map or its file (checksum verified), None when
        neither has it intact. Touches no index: the TieredStore calls it without its lock,
        so a slow read holds up nobody, and confirms the placement afterwards."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        return self._read_file(key)

    def _read_file(self, key: bytes) -> torch.Tensor | None:
        try:
            with open(self._path(key), "rb") as f:
                raw = f.read()
        except OSError:
            return None
        if len(raw) < _HEADER.size:
            return None
        magic, key_len, payload_len, checksum = _HEADER.unpack_from(raw)
        start = _HEADER.size + key_len
        stored_key = raw[_HEADER.size:start]
        payload = memoryview(raw)[start:]
        if (magic != _MAGIC or stored_key != key or len(payload) != payload_len
                or _checksum(key, payload) != checksum):
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def remove(self, key: bytes) -> None:
        self.num_bytes -= self._index.pop(key)
        with self._lock:
            self._pending.pop(key, None)
            self._num_outstanding += 1
        self._ops.put(("delete", key, None))

    # ---- writer thread ----------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            op = self._ops.get()  # in-process queue; close() enqueues None to end this thread
            if op is None:
                return
            kind, key, buf = op
            try:
                if kind == "write":
                    self._write_file(key, buf)
                else:
                    try:
                        os.unlink(self._path(key))
                    except FileNotFoundError:
                        pass
            except OSError:
                logger.exception("%s: %s of block %s failed", self.name, kind, key.hex())
            finally:
                with self._lock:
                    if kind == "write" and self._pending.get(key) is buf:
                        del self._pending[key]
                    self._num_outstanding -= 1
                    self._idle.notify_all()

    def _write_file(self, key: bytes, buf: torch.Tensor | None) -> None:
        with self._lock:
            if self._pending.get(key) is not buf:
                return  # removed (or replaced) before we got to it
        assert buf is not None
        payload = buf.numpy()
        header = _HEADER.pack(_MAGIC, len(key), payload.nbytes, _checksum(key, payload.data))
        tmp = self._path(key) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(key)
            f.write(payload.data)
        os.replace(tmp, self._path(key))  # readers never see a half-written block

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and delete is on disk; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_outstanding == 0, timeout=timeout_s)

    def check_integrity(self) -> None:
        if len(self._index) > self.capacity_blocks:
            raise AssertionError(f"{self.name}: {len(self._index)} > {self.capacity_blocks}")
        with self._lock:
            stray = set(self._pending) - set(self._index.oldest_first())
        if stray:
            raise AssertionError(f"{self.name}: pending writes for unindexed keys {len(stray)}")

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (so a restart finds them) and stop the writer thread."""
        if not self.flush(timeout_s):
            logger.warning("%s: close timed out with writes still queued", self.name)
        self._ops.put(None)
        self._writer.join(timeout=timeout_s)
