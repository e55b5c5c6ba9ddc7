"""The hand-off connector drives its transport through the interface alone
(pdserve/handoff/base.py): a transport registered under a new name gets each call of the
contract in order, prefill side and decode side, and what it says is what the worker sees."""

from __future__ import annotations

import torch

from pdserve.handoff import registry
from pdserve.handoff.connector import HandoffConnector
from pdserve.handoff.store import StoreHandoff
from pdserve.kvstore.block_key import KVLayout, block_keys, root_key
from pdserve.kvstore.tiered_store import TieredStore

LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


class RecordingHandoff(StoreHandoff):
    """The store transport, recording every call of the interface it gets."""

    name = "recording"
    calls: list[tuple] = []

    def begin_save(self, save) -> None:
        self.calls.append(("begin_save", len(save.keys)))

    def save_layer(self, save, num_staged: int, event=None) -> None:
        self.calls.append(("save_layer", num_staged))

    def finish(self, keys, blocks, lease_ttl_s):
        self.calls.append(("finish", len(keys), lease_ttl_s))
        return super().finish(keys, blocks, lease_ttl_s)

    def end_save(self, save) -> None:
        self.calls.append(("end_save",))

    def receive(self, keys, source, block_bytes):
        self.calls.append(("receive", len(keys), source))
        return super().receive(keys, source, block_bytes)

    def install(self, write, block_ids, layers) -> None:
        self.calls.append(("install", list(block_ids)))
        super().install(write, block_ids, layers)

    def release(self, lease_id: int, source: str) -> None:
        self.calls.append(("release", source))
        super().release(lease_id, source)


def test_a_registered_transport_gets_the_contracts_calls_in_order(monkeypatch) -> None:
    monkeypatch.setitem(registry.TRANSPORTS, "recording",
                        f"{__name__}:RecordingHandoff")
    monkeypatch.setattr(RecordingHandoff, "calls", [])
    store = TieredStore.build(16, 0, None)
    connector = HandoffConnector(store, LAYOUT,
                                 transport=registry.make_transport("recording", store))
    try:
        pool = [torch.randn(2, 4, LAYOUT.block_size, 2, LAYOUT.head_dim)
                for _ in range(LAYOUT.num_layers)]
        keys = block_keys(list(range(8)), LAYOUT.block_size, root_key("tiny", LAYOUT))
        for layer in range(LAYOUT.num_layers):
            connector.save_layer("r", layer, keys, [1, 2], pool[layer])
        assert connector.drain(10)
        (saved,) = connector.poll()
        assert (saved.num_blocks, saved.error, saved.source) == (2, None, "")
        connector.release(7, "tcp://127.0.0.1:9")  # a node never reached: left to expire
        connector.start_load("d", keys, [0, 0], None, saved.source)
        assert connector.drain(10)
        (loaded,) = connector.poll()
        written: list[list[int]] = []
        connector.transport.install(lambda ids, layers: written.append(ids), [3, 0],
                                    loaded.layers)
        assert written == [[3, 0]]
        torch.testing.assert_close(loaded.layers[1], pool[1][:, [1, 2]])
    finally:
        connector.close()
    assert RecordingHandoff.calls == [
        ("begin_save", 2), ("save_layer", 1), ("save_layer", 2), ("save_layer", 3),
        ("finish", 2, None), ("end_save",), ("release", "tcp://127.0.0.1:9"),
        ("receive", 2, ""),
        ("install", [3, 0])]
