"""benchmarks/kv_transfer.py's ceilings: the in-process copy and the kernel's
cross-process copy (process_vm_readv, what UCX's shared-memory transport uses for large
messages) both move the pattern's bytes intact into the landing pool."""

import sys

import numpy as np
import pytest

from benchmarks import kv_transfer


def test_landing_pool_blocks_are_distinct_and_pattern_repeats():
    pool = kv_transfer.landing_pool(4096, 3)
    assert len({b.ctypes.data for b in pool}) == 3
    data = kv_transfer.pattern(600)
    assert data[251] == 0 and data[250] == 250 and np.array_equal(data[:251], data[251:502])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")
def test_cma_copy_reads_another_process_s_bytes():
    gbps = kv_transfer.cma_gbps(64 * 1024, warmup=1)  # checks the bytes itself (AssertionError)
    if gbps is None:
        pytest.skip("this host forbids process_vm_readv between processes (ptrace scope)")
    assert gbps > 0
    assert kv_transfer.memcpy_gbps(64 * 1024, warmup=1) > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux's")
def test_shm_copy_reads_another_process_s_segment():
    assert kv_transfer.shm_gbps(64 * 1024, warmup=1) > 0  # checks the bytes itself
