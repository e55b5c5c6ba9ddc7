"""A decode worker whose KV pool is short when a handed-off request's KV arrives queues it
(it waits for the running requests to free blocks) instead of refusing it; it then runs to
the same tokens as a colocated engine, and everything ends free. The components are the
worker's own (RequestGateway, KVTransfer over a real in-process store), driven step by step."""

from __future__ import annotations

import time

from helpers.engine_util import run_to_completion, token_ids
from transformers import AutoTokenizer

from pdserve.handoff.connector import HandoffConnector
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import GenerateRequest, Output
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.worker.gateway import RequestGateway
from pdserve.serve.worker.kv_transfer import KVTransfer

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model_dir, num_blocks: int) -> Engine:
    return Engine(ModelConfig(str(model_dir)), CacheConfig(block_size=BLOCK,
                                                           num_blocks=num_blocks),
                  tokenizer=AutoTokenizer.from_pretrained(model_dir))


def _drive(handoff: RequestGateway, until, timeout_s: float = 60.0) -> list[Output]:
    """The worker loop without sockets: poll transfers, step, collect wire outputs."""
    outputs: list[Output] = []
    deadline = time.monotonic() + timeout_s
    while not until(outputs):
        assert time.monotonic() < deadline, outputs
        outputs += handoff.poll()
        if handoff.engine.has_unfinished_requests():
            for delta in handoff.engine.step():
                wire = handoff.to_wire(delta)
                if wire is not None:
                    outputs.append(wire)
        else:
            time.sleep(0.005)
    return outputs


def _finished(request_id: str):
    return lambda outs: any(o.request_id == request_id and o.finish_reason for o in outs)


def test_decode_worker_queues_a_handoff_until_blocks_free(llama_dir) -> None:
    prompt = list(range(3, 20))  # 17 tokens: 3 blocks to admit on decode
    reference = _engine(llama_dir, 64)
    try:
        reference.add_request(prompt, GREEDY, "r")
        expected = token_ids(run_to_completion(reference)["r"])
    finally:
        reference.shutdown()

    store = TieredStore.build(dram_capacity_blocks=64)
    engines, transfers = [], []
    for num_blocks in (64, 6):  # prefill, then a decode worker with 48 tokens of KV
        engine = _engine(llama_dir, num_blocks)
        engines.append(engine)
        transfers.append(KVTransfer(engine.runner, engine.block_manager,
                                    HandoffConnector(store, engine.spec.kv_layout(BLOCK))))
    prefill = RequestGateway(engines[0], "prefill", "p", transfers[0])
    decode = RequestGateway(engines[1], "decode", "d", transfers[1])
    try:
        prefill.add(GenerateRequest("r", prompt, GREEDY))
        [first] = [o for o in _drive(prefill, _finished("r")) if o.request_id == "r"]
        assert first.finish_reason == "handoff" and first.handoff.block_keys

        # The decode worker is busy: a 38-token request holds 5 of its 6 blocks.
        busy = engines[1].add_request(list(range(30, 68)), SamplingParams(
            temperature=0, max_tokens=2, ignore_eos=True), "busy")
        engines[1].step()
        assert engines[1].block_manager.num_free_blocks == 1
        decode.add(GenerateRequest("r", prompt, GREEDY, handoff=first.handoff))

        deadline = time.monotonic() + 30
        # the KV arrives; with no blocks free, it waits for them
        while decode.admissions.loaded.num_in_flight:
            assert time.monotonic() < deadline
            assert decode.poll() == []
            time.sleep(0.005)
        assert decode.num_loading == 1
        assert decode.is_busy and "1 waiting for KV blocks" in decode.describe_in_flight()
        assert engines[1].scheduler.requests.keys() == {"busy"}

        outputs = _drive(decode, lambda outs: _finished("r")(outs)
                         and not engines[1].has_unfinished_requests())
        assert busy.is_finished
        mine = [o for o in outputs if o.request_id == "r"]
        assert all(o.error is None for o in mine)
        assert first.token_ids + [t for o in mine for t in o.token_ids] == expected
        assert not decode.is_busy and not prefill.is_busy
        for engine in engines:
            engine.block_manager.check_integrity()
            assert engine.block_manager.num_used_blocks == 0
    finally:
        for transfer in transfers:
            transfer.close()
        for engine in engines:
            engine.shutdown()
