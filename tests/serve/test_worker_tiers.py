"""A colocated worker over the whole hierarchy (pdserve/serve/engine/kv_tiers.py): pool -> its host
DRAM -> the fleet store's DRAM -> the store's disk. A conversation pushed out of the pool and
out of a two-block host tier comes back from the store, from DRAM or from disk, with the
tokens of a run that recomputed it; nothing is left pinned or held. Real Worker loop and
ZeroMQ sockets; the store in process."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq
from helpers.cluster_util import free_port_block
from helpers.worker_util import (
    BLOCK,
    assert_worker_idle,
    collect,
    dealer_sockets,
    make_engine,
    stop_workers,
)

from pdserve.handoff.connector import HandoffConnector
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import GenerateRequest
from pdserve.serve.worker.kv_transfer import KVTransfer
from pdserve.serve.worker.server import Worker

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def conversations(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (6 * BLOCK,), generator=gen).tolist() for _ in range(3)]


def serve(llama_dir, store, caching: bool = True):
    """One colocated worker: a 10-block pool, a host tier of two blocks, the store below."""
    engine = make_engine(llama_dir, num_blocks=10, enable_prefix_caching=caching)
    block_bytes = sum(c[:, 0].nbytes for c in engine.runner.kv_caches)
    engine.cache_config = type(engine.cache_config)(
        block_size=BLOCK, num_blocks=10, enable_prefix_caching=caching,
        kv_offload_bytes=2 * block_bytes)
    offload = engine.enable_kv_offload() if caching else None
    if offload is not None:
        # a stubbed prefill far slower than any tier, so the cost rule loads (it has its own
        # test in test_kv_tiers.py): measured, a tiny model's 48 tokens may recompute faster
        # than a store read
        offload.costs.note_prefill = lambda num_tokens, seconds: None
        offload.costs.prefill_s_per_token = 1.0
    transfer = KVTransfer(engine.runner, engine.block_manager,
                          HandoffConnector(store, engine.spec.kv_layout(BLOCK)))
    transfer.attach_host_tier(engine.kv_offload)
    port = free_port_block(1)
    worker = Worker(engine, "colocated", f"tcp://127.0.0.1:{port}", "colocated",
                    lambda announcer: transfer)
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    context = zmq.Context()
    return worker, thread, context, dealer_sockets(context, port, ["colocated"])


def ask(sockets, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    outputs = collect(sockets["colocated"], GenerateRequest(request_id, prompt, GREEDY))
    return [t for o in outputs for t in o.token_ids], outputs[0].num_cached_tokens


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_a_prefix_pushed_below_host_dram_comes_back_from_the_store(llama_dir, tmp_path, tier):
    store = TieredStore.build(dram_capacity_blocks=64 if tier == "dram" else 1,
                              disk_capacity_blocks=64, disk_dir=str(tmp_path))
    results = {}
    for caching in (False, True):
        worker, thread, context, sockets = serve(llama_dir, store if caching else
                                                 TieredStore.build(64), caching)
        try:
            a, b, c = conversations(worker.engine.spec.vocab_size)
            turns = [("a1", a + [1]), ("b1", b + [2]), ("c1", c + [3]), ("a2", a + [4, 5])]
            results[caching] = []
            for request_id, prompt in turns:
                results[caching].append(ask(sockets, request_id, prompt))
                if worker.engine.kv_offload is not None:
                    assert worker.engine.kv_offload.drain()
                    assert worker.gateway.kv_transfer.connector.drain(10)
            if caching:
                assert store.tier_of(worker.engine.block_manager.update_block_keys(
                    worker.engine.make_request(a))[0]) == tier
                tiers = worker.status().kv_tiers
        finally:
            stop_workers({"colocated": worker}, [thread], sockets, context)
        assert_worker_idle(worker)
    assert [tokens for tokens, _ in results[True]] == [tokens for tokens, _ in results[False]]
    assert [cached for _, cached in results[False]] == [0, 0, 0, 0]
    assert results[True][-1][1] == 6 * BLOCK  # every full block of conversation a
    assert tiers["store_hit_tokens"] == 6 * BLOCK
    assert tiers["host_evictions"] > 0 and tiers["store_written_bytes"] > 0
    store.check_integrity()
    assert store.num_pinned_blocks == 0
