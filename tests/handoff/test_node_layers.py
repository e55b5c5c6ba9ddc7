"""get_layers against a real hand-off node (pdserve/handoff/node_server.py), over UCX and over
ZeroMQ frames (a side without ucxx): a client gets exactly the layers the node's worker has
staged so far, from the asked block on, waits for the next one, reads the rest from the
stored blocks once the save ended, and hears that a staging with neither is gone. A reply
that does not match what was asked is refused by the client."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pdserve.handoff.node_server import HandoffNode
from pdserve.kvstore.client import StoreClient

NUM_LAYERS, LAYER_BYTES = 4, 256
KEYS = [bytes([i]) * 16 for i in range(5)]


@pytest.fixture(params=["ucx", "zmq"])
def node_and_client(request):
    node = HandoffNode("prefill-p", "127.0.0.1", 16, 30.0, 5.0, transport=request.param)
    client = StoreClient(node.address, transport=request.param, timeout_s=5.0, shm=False)
    try:
        yield node, client
    finally:
        client.close()
        node.close()


def test_a_pull_gets_each_layer_as_it_is_staged_then_the_stored_rest(node_and_client,
                                                                    monkeypatch):
    node, client = node_and_client
    staging = torch.randint(0, 256, (len(KEYS), NUM_LAYERS * LAYER_BYTES), dtype=torch.uint8)
    expected = staging.view(len(KEYS), NUM_LAYERS, LAYER_BYTES).numpy()
    node.stagings.begin(1, KEYS, staging, NUM_LAYERS)

    def pull(first_layer: int, wait_s: float = 0.0, keys=KEYS[2:], first_block: int = 2):
        return client.get_layers(1, keys, first_block, first_layer, NUM_LAYERS, LAYER_BYTES,
                                 wait_s)

    assert pull(0) == (0, None, False)  # nothing staged yet
    # a pull asked before layer 0 is staged waits in the node, and the layer wakes it (its
    # wait ends notified, not timed out)
    cond, woken, waiting = node.stagings._cond, [], threading.Event()
    wait = cond.wait

    def noted_wait(timeout_s=None):
        waiting.set()
        woken.append(wait(timeout_s))
        return woken[-1]

    monkeypatch.setattr(cond, "wait", noted_wait)
    pulled = []
    puller = threading.Thread(target=lambda: pulled.append(pull(0, wait_s=1.0)))
    puller.start()
    assert waiting.wait(10.0)
    node.stagings.progress(1, 1)
    puller.join(10.0)
    [(count, payload, gone)] = pulled
    assert woken == [True] and count == 1 and not gone
    assert np.array_equal(payload.reshape(3, 1, LAYER_BYTES), expected[2:, :1])
    node.stagings.progress(1, 3)
    count, payload, _ = pull(1)
    assert count == 2 and np.array_equal(payload.reshape(3, 2, LAYER_BYTES), expected[2:, 1:3])
    # the save ends: its blocks go into the node (adopted), and the pull reads them there
    node.put_many(KEYS, [staging[i] for i in range(len(KEYS))])
    node.stagings.end(1)
    count, payload, _ = pull(3)
    assert count == 1 and np.array_equal(payload.reshape(3, 1, LAYER_BYTES), expected[2:, 3:])
    assert len(node.stagings) == 0


def test_a_staging_that_is_nowhere_is_gone_and_other_blocks_are_not_served(node_and_client):
    node, client = node_and_client
    staging = torch.zeros(len(KEYS), NUM_LAYERS * LAYER_BYTES, dtype=torch.uint8)
    node.stagings.begin(1, KEYS, staging, NUM_LAYERS)
    node.stagings.progress(1, NUM_LAYERS)
    # other keys than the staging's at that place: not this staging, and not stored
    assert client.get_layers(1, KEYS[:2], 1, 0, NUM_LAYERS, LAYER_BYTES, 0.0) == (0, None, True)
    assert client.get_layers(2, KEYS, 0, 0, NUM_LAYERS, LAYER_BYTES, 0.0) == (0, None, True)
    node.stagings.end(1)
    assert client.get_layers(1, KEYS, 0, 0, NUM_LAYERS, LAYER_BYTES, 0.0) == (0, None, True)


def test_an_ended_staging_serves_only_its_own_stored_blocks(node_and_client):
    """Once a staging ended, a pull reads its blocks from the node's store: only the keys the
    staging had, at their place; other blocks the node holds (another prompt's) and a staging
    the node never had are gone, never served."""
    node, client = node_and_client
    staging = torch.randint(0, 256, (3, NUM_LAYERS * LAYER_BYTES), dtype=torch.uint8)
    node.stagings.begin(1, KEYS[:3], staging, NUM_LAYERS)
    node.put_many(KEYS[:3], [staging[i] for i in range(3)])
    node.stagings.end(1)
    other = torch.zeros(2, NUM_LAYERS * LAYER_BYTES, dtype=torch.uint8)
    node.put_many(KEYS[3:], [other[i] for i in range(2)])  # stored, no staging's

    def pull(staging_id: int, keys: list[bytes], first_block: int):
        return client.get_layers(staging_id, keys, first_block, 0, NUM_LAYERS, LAYER_BYTES,
                                 0.0)

    count, payload, gone = pull(1, KEYS[1:3], 1)
    expected = staging.view(3, NUM_LAYERS, LAYER_BYTES).numpy()
    assert count == NUM_LAYERS and not gone
    assert np.array_equal(payload.reshape(2, NUM_LAYERS, LAYER_BYTES), expected[1:])
    assert pull(1, KEYS[3:], 3) == (0, None, True)  # past the staging's blocks
    assert pull(1, KEYS[3:], 0) == (0, None, True)  # not the staging's keys at that place
    assert pull(1, KEYS[:3], 1) == (0, None, True)  # the staging's keys, elsewhere
    assert pull(2, KEYS[3:], 0) == (0, None, True)  # a staging never here


def test_a_reply_of_another_size_than_asked_is_refused(node_and_client):
    node, client = node_and_client
    staging = torch.zeros(len(KEYS), NUM_LAYERS * LAYER_BYTES, dtype=torch.uint8)
    node.stagings.begin(1, KEYS, staging, NUM_LAYERS)
    node.stagings.progress(1, 2)
    with pytest.raises(ValueError, match="other layers"):  # the client thinks layers are larger
        client.get_layers(1, KEYS, 0, 0, NUM_LAYERS, 2 * LAYER_BYTES, 0.0)
    node.stagings.end(1)


def test_the_nodes_data_threads_yield_to_the_forward():
    """A hand-off node's data threads (the sends of pulled layers) run at nice 19: on a busy
    core the prefill's forward goes first."""
    import os

    before = set(threading.enumerate())
    node = HandoffNode("prefill-p", "127.0.0.1", 16, 30.0, 5.0)
    try:
        threads = [t for t in set(threading.enumerate()) - before
                   if t.name.startswith("store-data-")]
        assert len(threads) == 4
        deadline = time.monotonic() + 5.0  # (each sets its own as it starts)
        while not all(os.getpriority(os.PRIO_PROCESS, t.native_id) == 19 for t in threads):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        node.close()
