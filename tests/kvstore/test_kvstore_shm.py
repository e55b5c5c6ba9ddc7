"""The same-host hand-off path (pdserve/kvstore/shm_segment.py): a data node's blocks in a memfd
segment that a client on the host maps read-only and copies out of, checking after the copy
that the block was not freed meanwhile."""

import dataclasses
import gc
import json
import select
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers.cluster_util import wait_until

from pdserve.handoff.node_server import HandoffNode
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.shm_segment import ALIGN, HEADER_BYTES, ShmArena, ShmReader
from pdserve.protocol.codec import WireError
from pdserve.protocol.store.base import STORE_PROTOCOL
from pdserve.protocol.store.data import GetReply, ShmSegment, ShmSpan

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="memfd and /proc/<pid>/fd are Linux's")


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# ---- the arena ------------------------------------------------------------------------------
def test_arena_frees_an_allocation_when_its_last_view_goes_and_coalesces():
    arena = ShmArena(8 * ALIGN)
    a = arena.allocate(ALIGN)  # with its header: two pages
    b = arena.allocate(100)
    assert a is not None and b is not None and arena.num_allocations == 2
    view = torch.from_numpy(a)[10:20]
    del a
    gc.collect()
    assert arena.num_allocations == 2  # a view still holds it
    del view, b
    gc.collect()
    assert arena.num_allocations == 0 and arena.num_free_bytes == 8 * ALIGN
    arena.check_integrity()
    whole = arena.allocate(8 * ALIGN - HEADER_BYTES)  # the free runs merged back into one
    assert whole is not None and arena.allocate(1) is None


def test_arena_locates_blocks_inside_live_allocations_only():
    arena = ShmArena(16 * ALIGN)
    data = arena.allocate(3 * 1000)
    assert data is not None
    span = arena.locate(data.ctypes.data + 1000, 1000)
    assert span is not None and span.offset - span.header == HEADER_BYTES + 1000
    assert arena.locate(data.ctypes.data + 2500, 1000) is None  # past the allocation's end
    assert arena.locate(np.zeros(10).ctypes.data, 8) is None  # not in the segment
    serial = span.serial
    del data
    gc.collect()
    again = arena.allocate(3 * 1000)
    assert again is not None
    assert arena.locate(again.ctypes.data, 10).serial != serial  # a new serial each time


def test_an_allocation_s_progress_is_read_through_the_mapping_and_starts_at_zero():
    arena = ShmArena(16 * ALIGN)
    reader = ShmReader(arena.segment)  # this process's own segment, mapped as another would
    data = arena.allocate(5000)
    span = arena.locate(data.ctypes.data, 5000)
    assert reader.progress(span) == 0
    arena.set_progress(span.header, 3)
    assert reader.progress(span) == 3 and reader.intact([span]) == [True]
    del data
    gc.collect()
    again = arena.allocate(5000)  # the same memory, a new allocation
    assert arena.locate(again.ctypes.data, 5000).header == span.header
    assert reader.progress(span) == 0 and reader.intact([span]) == [False]
    with pytest.raises(ValueError, match="outside"):
        reader.progress(dataclasses.replace(span, header=arena.size))
    del again
    reader.close()


# ---- a reader in another process --------------------------------------------------------------
_HOLDER = textwrap.dedent("""
    import dataclasses, gc, json, sys
    import numpy as np
    from pdserve.kvstore.shm_segment import ShmArena
    arena = ShmArena(1 << 20)
    block = arena.allocate(100_000)
    block[:] = np.random.default_rng(7).integers(0, 256, 100_000, dtype=np.uint8)
    span = arena.locate(block.ctypes.data, block.nbytes)
    print(json.dumps([dataclasses.asdict(arena.segment), dataclasses.asdict(span)]), flush=True)
    sys.stdin.readline()  # free it, and reuse the memory for other bytes
    del block
    gc.collect()
    other = arena.allocate(200_000)
    other[:] = 1
    print("reused", flush=True)
    sys.stdin.readline()
""")


def _line(process: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """The child's next line, or a failure after timeout_s (never a hang)."""
    assert select.select([process.stdout], [], [], timeout_s)[0], "the child said nothing"
    return process.stdout.readline()


@pytest.fixture
def holder():
    """A process holding one block in its segment: (process, segment, span)."""
    process = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        segment, span = json.loads(_line(process))
        yield process, ShmSegment(**segment), ShmSpan(**span)
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def test_reader_copies_another_process_s_block_and_sees_it_freed(holder):
    process, segment, span = holder
    reader = ShmReader(segment)
    out = np.zeros(100_000, np.uint8)
    assert reader.copy([span], [100_000], out) == [True]
    np.testing.assert_array_equal(out, _pattern(100_000, 7))
    process.stdin.write("free\n")
    process.stdin.flush()
    assert _line(process).strip() == "reused"
    assert reader.copy([span], [100_000], out) == [False]  # freed: the bytes are not the block's
    with pytest.raises(ValueError, match="outside the segment"):
        reader.copy([dataclasses.replace(span, offset=segment.size - 10)], [100], out)
    reader.close()


def test_reader_refuses_another_host_or_a_replaced_descriptor(holder):
    _, segment, _ = holder
    with pytest.raises(OSError, match="another host"):
        ShmReader(dataclasses.replace(segment, host="elsewhere/1"))
    with pytest.raises(OSError, match="not the segment"):
        ShmReader(dataclasses.replace(segment, inode=segment.inode + 1))


def test_get_reply_spans_must_match_the_found_blocks():
    span = ShmSpan(4096 + HEADER_BYTES, 4096, 3)
    ok = GetReply(1, [True, False], [10, 0], shm_spans=[span])
    assert STORE_PROTOCOL.decode(STORE_PROTOCOL.encode(ok)) == ok
    with pytest.raises((ValueError, WireError)):
        GetReply(1, [True, True], [10, 10], shm_spans=[span])


# ---- a hand-off node and its clients --------------------------------------------------------
@pytest.fixture
def node():
    node = HandoffNode("shm-test", "127.0.0.1", 16, 30.0, 5.0, shm_bytes=4 << 20)
    yield node
    node.close()


def test_client_on_the_node_s_host_reads_staged_blocks_out_of_its_segment(node):
    staging = node.allocate_staging(4 * 65536)
    assert staging is not None
    staging.copy_(torch.from_numpy(_pattern(4 * 65536, 1)))
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    assert node.put_many(keys, [staging[i * 65536:(i + 1) * 65536] for i in range(4)]) == [True] * 4
    del staging
    other = StoreClient(node.address, timeout_s=5, shm=False)
    other.put_many([b"p" * 16], [_pattern(65536, 2)])  # a block the node copied, not staged
    mapped = StoreClient(node.address, timeout_s=5)
    try:
        assert mapped.transport.startswith("shm+") and not other.transport.startswith("shm")
        got = mapped.get_many([*keys, b"x" * 16])
        assert got[-1] is None
        np.testing.assert_array_equal(np.concatenate(got[:4]), _pattern(4 * 65536, 1))
        for a, b in zip(got[:4], other.get_many(keys), strict=True):
            np.testing.assert_array_equal(a, b)
        # a block outside the segment comes over the ordinary path
        np.testing.assert_array_equal(mapped.get_many([b"p" * 16])[0], _pattern(65536, 2))
        assert node.num_shm_allocations == 1
        node.check_integrity()
        assert node._service.store.evict(keys) == 4
        # evicted: the staging's memory comes back once nothing holds a block. `other`'s
        # reads were sent zero-copy: ZeroMQ holds each frame until it is on the wire and
        # lets go of it on its own thread, which may come after `other` has the reply (a
        # loaded host once failed an immediate check here)
        assert wait_until(lambda: gc.collect() >= 0 and node.num_shm_allocations == 0, 10.0)
    finally:
        mapped.close()
        other.close()


def test_a_full_segment_stages_nothing(node):
    held = [node.allocate_staging(1 << 20) for _ in range(3)]
    assert all(h is not None for h in held)
    assert node.allocate_staging(2 << 20) is None  # the connector then stages in plain memory
