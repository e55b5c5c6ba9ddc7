"""A worker killed while its host tier writes blocks down to the store (StoreConnector.write_down,
pdserve/serve/engine/kv_tiers.py) leaves the store consistent: every block it holds reads back
exactly as written, nothing is pinned, its invariants hold, and it keeps serving."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
from helpers.paths import REPO_ROOT

from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.server import StoreServer

BLOCK_BYTES = 128 << 10

WRITER = """
import sys, torch
from pdserve.kvstore.block_key import KVLayout
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.connector import StoreConnector

layout = KVLayout("float32", 16, 4, 4, 64)  # 4 x 2 x 16 x 4 x 64 x 4 bytes = 128 KiB a block
connector = StoreConnector(StoreClient(sys.argv[1], transport="zmq", timeout_s=10), layout)
i = 0
while True:  # until killed: write-downs of blocks whose bytes say which block they are
    key = i.to_bytes(16, "little")
    block = torch.full(layout.block_shape(), float(i % 997))
    if connector.write_down([key], [block]):
        i += 1
        if i % 50 == 0:
            print(i, flush=True)
"""


def expected(i: int) -> np.ndarray:
    return np.full(BLOCK_BYTES // 4, float(i % 997), dtype=np.float32).view(np.uint8)


def test_a_writer_killed_mid_write_down_leaves_the_store_consistent():
    server = StoreServer(StoreConfig(master_port=0, data_port=0, transport="zmq",
                                     dram_capacity_blocks=4096,
                                     request_timeout_s=5.0)).start()
    try:
        address = server.data_address
        writer = subprocess.Popen([sys.executable, "-c", WRITER, address], cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            written = 0
            while written < 300 and time.monotonic() < deadline:
                line = writer.stdout.readline()
                assert line, "the writer died on its own"
                if line.strip().isdigit():
                    written = int(line)
            assert written >= 300
            writer.kill()  # SIGKILL while write-downs are on the wire
            writer.wait(timeout=30)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        client = StoreClient(address, transport="zmq", timeout_s=10)
        keys = [i.to_bytes(16, "little") for i in range(written + 200)]
        got = client.get_many(keys)
        held = [i for i, block in enumerate(got) if block is not None]
        assert len(held) >= written - 64  # what was acknowledged (less the queue) arrived
        for i in held:  # whole or absent, never torn
            assert np.array_equal(got[i].view(np.uint8), expected(i)), i
        client.check_integrity()
        stats = client.stats()
        assert stats["num_pinned"] == 0 and stats["num_leases"] == 0
        # and it keeps serving
        assert client.put_many([b"x" * 16], [expected(1)]) == [True]
        client.close()
        server.check_integrity()
    finally:
        server.stop()
