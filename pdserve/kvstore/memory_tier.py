"""A memory tier: blocks in an LRUIndex (lru_index.py), on a device (GPU pool) or in host DRAM.

Each block is a 1-D uint8 torch tensor owned by the tier (put copies in, so callers may reuse
their buffers). Host buffers are pinned when CUDA is present, so device<->host copies can be
asynchronous. The tier only stores and orders; which block leaves, and to where, is decided by
the TieredStore above it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch

from pdserve.kvstore.lru_index import LRUIndex

BytesLike = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


def fp8_as_bytes(kv):
    """An FP8 KV tensor (or a pool of them) seen as its bytes, same shape; others unchanged.
    CPU torch has no index_copy_ and gloo no transfer for float8 types, their bytes do."""
    return kv.view(torch.uint8) if kv.element_size() == 1 else kv


def as_uint8_tensor(data: BytesLike) -> torch.Tensor:
    """A flat uint8 view (no copy where possible) of a block payload; may alias a read-only
    buffer, so treat it as read-only."""
    if isinstance(data, torch.Tensor):
        return data.detach().reshape(-1).view(torch.uint8) if data.is_contiguous() else (
            data.detach().contiguous().reshape(-1).view(torch.uint8)
        )
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    view = memoryview(data)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer (bytes, a ZeroMQ frame) is not writable; every
        # tier copies on insert, so the view is only ever read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _span(block: torch.Tensor | np.ndarray) -> tuple[object, int, int] | None:
    """(the buffer it lives in, start address, bytes) of a contiguous block; None for other
    kinds (bytes, frames) or a strided one."""
    if isinstance(block, torch.Tensor):
        if not block.is_contiguous():
            return None
        storage = block.untyped_storage()
        return storage.data_ptr(), block.data_ptr(), block.nbytes
    if isinstance(block, np.ndarray):
        base = block.base
        if not (block.flags.c_contiguous and isinstance(base, np.ndarray)
                and base.flags.c_contiguous):
            return None
        return id(block.base), block.ctypes.data, block.nbytes
    return None


def back_to_back_runs(blocks: list[torch.Tensor] | list[np.ndarray]) -> list[tuple[int, int]]:
    """[(start, stop)] over `blocks`: each run lies back to back in one buffer, in order (a
    hand-off's blocks, views of the save's one staging tensor, are one run)."""
    runs: list[tuple[int, int]] = []
    previous = None
    for i, block in enumerate(blocks):
        span = _span(block)
        if (runs and span is not None and previous is not None and span[0] == previous[0]
                and span[1] == previous[1] + previous[2]):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
        previous = span
    return runs


def run_view(blocks: list[torch.Tensor] | list[np.ndarray]) -> torch.Tensor:
    """One flat uint8 tensor over blocks that back_to_back_runs puts in one run (no copy)."""
    first = blocks[0]
    if len(blocks) == 1:
        return as_uint8_tensor(first)
    nbytes = sum(b.nbytes for b in blocks)
    if isinstance(first, np.ndarray):
        base = first.base.reshape(-1).view(np.uint8)
        start = first.ctypes.data - base.ctypes.data
        return torch.from_numpy(base[start:start + nbytes])
    flat = as_uint8_tensor(first)
    return torch.as_strided(flat, (nbytes,), (1,), flat.storage_offset())


class MemoryTier:
    """LRU map key -> uint8 tensor with a capacity in blocks."""

    def __init__(self, name: str, capacity_blocks: int, device: str | torch.device = "cpu"):
        if capacity_blocks <= 0:
            raise ValueError(f"{name}: capacity_blocks must be positive, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.device = torch.device(device)
        # Pinned host memory only pays off (and only exists) with a CUDA device to copy to.
        self._pin = self.device.type == "cpu" and torch.cuda.is_available()
        self._blocks: LRUIndex[torch.Tensor] = LRUIndex()
        self.num_bytes = 0
        """Payload bytes held (the master's placement and status read it)."""

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def is_full(self) -> bool:
        return len(self._blocks) >= self.capacity_blocks

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def keys_oldest_first(self) -> Iterator[bytes]:
        """A live iterator: stop iterating before changing the tier."""
        return self._blocks.oldest_first()

    def insert(self, key: bytes, data: BytesLike, adopt: bool = False) -> None:
        """Store `data` as the most recently used block (the caller made room): a copy, or
        with `adopt` (the caller gives the buffer up) the tensor itself where it already
        lives in the right memory, saving a copy per block."""
        src = as_uint8_tensor(data)
        old = self._blocks.get(key)
        self.num_bytes += src.numel() - (0 if old is None else old.numel())
        if adopt and src.device == self.device and (not self._pin or src.is_pinned()):
            self._blocks.insert(key, src)
        else:
            buf = torch.empty(src.numel(), dtype=torch.uint8, device=self.device,
                              pin_memory=self._pin)
            buf.copy_(src)
            self._blocks.insert(key, buf)

    def read(self, key: bytes) -> torch.Tensor | None:
        """The stored tensor (do not modify it), or None; does not change LRU order."""
        return self._blocks.get(key)

    def touch(self, key: bytes) -> None:
        self._blocks.touch(key)

    def remove(self, key: bytes) -> None:
        self.num_bytes -= self._blocks.pop(key).numel()

    def check_integrity(self) -> None:
        if len(self._blocks) > self.capacity_blocks:
            raise AssertionError(f"{self.name}: {len(self._blocks)} > {self.capacity_blocks}")

    def close(self) -> None:
        self._blocks.clear()
        self.num_bytes = 0
