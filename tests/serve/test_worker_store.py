"""Workers over a shared KV store, in one process: a prefill worker reuses a prefix another
prefill worker computed (loaded from the store, not recomputed), hands off to a decode worker,
and the tokens equal a colocated engine's. Real ZeroMQ sockets, real Worker loops."""

from __future__ import annotations

import threading

import pytest
import zmq
from helpers.cluster_util import free_port_block
from helpers.engine_util import run_to_completion, token_ids
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
from pdserve.protocol.worker import GenerateRequest, Output
from pdserve.serve.worker.kv_transfer import KVTransfer
from pdserve.serve.worker.server import Worker


@pytest.fixture(scope="module")
def fleet(llama_dir):
    store = TieredStore.build(dram_capacity_blocks=256)
    base = free_port_block(3)
    workers, threads = {}, []
    for i, (name, role) in enumerate([("prefill-a", "prefill"), ("prefill-b", "prefill"),
                                      ("decode", "decode")]):
        engine = make_engine(llama_dir)
        connector = HandoffConnector(store, engine.spec.kv_layout(BLOCK))
        transfer = KVTransfer(engine.runner, engine.block_manager, connector)
        worker = Worker(engine, role, f"tcp://127.0.0.1:{base + i}", name,
                        lambda announcer, transfer=transfer: transfer)
        thread = threading.Thread(target=worker.serve_forever, daemon=True)
        thread.start()
        workers[name], threads = worker, threads + [thread]
    context = zmq.Context()
    sockets = dealer_sockets(context, base, workers)
    yield workers, sockets, store
    stop_workers(workers, threads, sockets, context)


def _disagg(sockets, prefill: str, request_id: str, prompt: list[int]) -> tuple[Output, list]:
    sampling = SamplingParams(max_tokens=8, temperature=0.0)
    [first] = collect(sockets[prefill], GenerateRequest(request_id, prompt, sampling))
    assert first.finish_reason == "handoff" and first.handoff is not None
    assert first.handoff.block_keys  # the prompt is in the store
    rest = collect(sockets["decode"], GenerateRequest(request_id, prompt, sampling,
                                                       handoff=first.handoff))
    return first, first.token_ids + [t for o in rest for t in o.token_ids]


def test_prefix_from_the_store_is_reused_by_another_prefill_worker(fleet, llama_dir):
    workers, sockets, store = fleet
    shared = list(range(10, 10 + 4 * BLOCK))  # four full blocks
    prompts = {"r1": shared + [7, 8, 9], "r2": shared + [11, 12]}
    reference = make_engine(llama_dir)
    try:
        for rid, prompt in prompts.items():
            reference.add_request(prompt, SamplingParams(temperature=0, max_tokens=8), rid)
        expected = {rid: token_ids(outs)
                    for rid, outs in run_to_completion(reference).items()}
    finally:
        reference.shutdown()
    first, tokens = _disagg(sockets, "prefill-a", "r1", prompts["r1"])
    assert first.num_cached_tokens == 0 and tokens == expected["r1"]
    # prefill-b never saw this prefix: it loads the four blocks from the store
    first, tokens = _disagg(sockets, "prefill-b", "r2", prompts["r2"])
    assert first.num_cached_tokens == 4 * BLOCK
    assert tokens == expected["r2"]
    assert workers["prefill-b"].gateway.kv_transfer.totals()["load_count"] == 1
    # TP=1: each prefill saved its prompt layer by layer during the forward
    for name in ("prefill-a", "prefill-b"):
        totals = workers[name].gateway.kv_transfer.totals()
        assert totals["layerwise_save_count"] == totals["save_count"] == 1
    for worker in workers.values():
        assert_worker_idle(worker)
    store.check_integrity()
    assert store.num_pinned_blocks == 0



def test_without_prefix_caching_a_prefill_worker_never_reuses_the_store(fleet, llama_dir):
    """--no-prefix-caching means no reuse at all, as in vLLM: the store's copy of a prompt's
    prefix is not looked up (a caching worker's transfer finds it there)."""
    _, sockets, store = fleet
    prompt = list(range(300, 300 + 4 * BLOCK)) + [5]
    _disagg(sockets, "prefill-a", "stored", prompt)  # the store now holds its four blocks
    lookups = {}
    for caching in (True, False):
        engine = make_engine(llama_dir, enable_prefix_caching=caching)
        try:
            transfer = KVTransfer(engine.runner, engine.block_manager,
                                  HandoffConnector(store, engine.spec.kv_layout(BLOCK)))
            request = engine.make_request(prompt, SamplingParams(max_tokens=1))
            lookups[caching] = len(transfer.store_prefix_keys(request))
        finally:
            engine.shutdown()
    assert lookups == {True: 4, False: 0}
    store.check_integrity()
