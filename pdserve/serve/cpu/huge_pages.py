"""2 MiB pages for the big CPU tensors a decode step streams: the KV pool and the weights.

A decode step reads every weight and each running sequence's KV once. On 4 KiB pages that is
a TLB miss, and a page walk, every 4 KiB, and the walk's own reads compete with the stream.
Linux backs memory with transparent huge pages where asked (the usual mode is "madvise"), and
only memory not yet touched: so the KV pool's layers are fresh mappings advised before they are
zeroed (pdserve/serve/executor/kv_cache.py), and the loader moves the weights, once loaded and
packed, into one
advised buffer (`rehome_weights`).

Measured on the llama-mid-like model (fp32, 97 MB of weights, 2 AVX-512 cores), the same
engine's decode step with its weights in either copy (benchmarks/weight_pages.py),
over five runs: 5-18% faster at 8 x 256 tokens, 6-9% at 8 x 1024, 0-21% at 1 sequence; no
change at 32 sequences, where the products are bound by compute.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable

import torch
from torch import nn

MADV_HUGEPAGE = 14  # <linux/mman.h>
HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # a cache line: every moved tensor starts on one
MIN_REHOME_BYTES = 1 << 20


@functools.cache
def _madvise() -> Callable[..., int] | None:
    return ctypes.CDLL(None, use_errno=True).madvise if sys.platform.startswith("linux") else None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with 2 MiB pages. Call it before the memory is
    first written; pages already touched stay small. Decode attention reads each sequence's
    blocks from anywhere in the pool, so fewer TLB misses shorten it.
    Returns whether the advice was taken (False off Linux, for tensors under a huge page, or
    when the kernel refuses)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) == 0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def huge_page_buffer(num_bytes: int) -> torch.Tensor | None:
    """An untouched byte buffer of num_bytes that starts on a 2 MiB boundary and is advised
    huge to its last page (it owns the padding), or None where the advice is not taken.

    Its memory is a fresh anonymous mapping of its own, never the allocator's: malloc may hand
    back memory a freed tensor already touched (glibc raises its mmap threshold as large
    blocks are freed), whose small pages the advice no longer changes. The tensor keeps the
    mapping alive; it is unmapped with the last view of it."""
    if _madvise() is None:
        return None
    span = _round_up(num_bytes, HUGE_PAGE_BYTES)
    region = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    buffer = raw[(-raw.data_ptr()) % HUGE_PAGE_BYTES:][:span]
    return buffer[:num_bytes] if advise_huge_pages(buffer) else None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _streamed(tensor: object) -> bool:
    return (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and not tensor.is_mkldnn
            and tensor.is_contiguous() and _nbytes(tensor) >= MIN_REHOME_BYTES)


def rehome_weights(model: nn.Module) -> int:
    """Move the model's large CPU weights (parameters of 1 MiB or more, and the panels layers
    keep in `packed`, pdserve/serve/layers/parallel.py) into one buffer on huge pages, each tensor
    copied and its old memory freed before the next is copied, so the peak grows by one tensor.
    Call it once loading and every `process_weights_after_loading` hook are done, before
    anything else holds the tensors. Returns the bytes moved (0 where the host gives no
    huge pages: the weights stay where they are)."""
    slots: list[tuple[object, str]] = []  # (owner, attribute): no tensor held here
    for param in model.parameters():  # each shared (tied) parameter once
        if _streamed(param.data):
            slots.append((param, "data"))
    for module in model.modules():
        if _streamed(module.__dict__.get("packed")):
            slots.append((module, "packed"))
    sizes = [_nbytes(getattr(owner, name)) for owner, name in slots]
    buffer = huge_page_buffer(sum(_round_up(n, ALIGN_BYTES) for n in sizes)) if slots else None
    if buffer is None:
        return 0
    offset = 0
    for (owner, name), size in zip(slots, sizes, strict=True):
        tensor = getattr(owner, name)
        home = buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        home.copy_(tensor)
        setattr(owner, name, home)
        del tensor  # the last reference: freed before the next copy
        offset += _round_up(size, ALIGN_BYTES)
    return offset
