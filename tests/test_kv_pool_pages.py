"""The CPU KV pool asks for huge pages before it first touches its memory, and is zeroed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdserve.serve.kv_cache import HUGE_PAGE_BYTES, KVCachePool, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold the tensor (/proc/self/smaps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_pool_is_zeroed_and_small_tensors_are_left_alone() -> None:
    pool = KVCachePool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, device=torch.device("cpu"))
    assert all(int(t.count_nonzero()) == 0 for t in pool.kv_caches)
    assert advise_huge_pages(torch.empty(16)) is False  # under one huge page


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="needs Linux with transparent huge pages not switched off")
def test_large_pool_gets_huge_pages() -> None:
    # 4 huge pages per layer; the pool's layers are each a tensor of their own
    pool = KVCachePool(num_layers=1, num_blocks=256, block_size=16, num_kv_heads=4,
                       head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    (cache,) = pool.kv_caches
    assert cache.numel() * 4 >= 4 * HUGE_PAGE_BYTES
    assert int(cache.count_nonzero()) == 0
    if _huge_kib(cache) == 0:
        # Under memory pressure (a busy CI host) the kernel may have no free 2 MiB page to
        # give at that moment: then a tensor advised by hand gets none either, and the pool
        # is not at fault. Where the host gives the control one, the pool must have had one.
        control = torch.empty_like(cache)
        assert advise_huge_pages(control)
        control.zero_()
        if _huge_kib(control) == 0:
            pytest.skip("the host granted no huge page just now (memory pressure)")
    assert _huge_kib(cache) >= HUGE_PAGE_BYTES // 1024
