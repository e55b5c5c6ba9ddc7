"""A hand-off between workers on one host, in place: the prefill worker stages the prompt's KV
in its hand-off node's shared memory segment and the hand-off says where; the decode worker
maps the segment and copies the blocks straight into its pool as the hand-off arrives, so the
request joins the batch at once (no load job, no request to the prefill worker). The tokens
are a colocated engine's; leases, pins and segment memory all end free. Blocks freed before
or while they are read are recomputed. The worker's own components (HandOff, KVTransfer, a
real HandoffNode served over ZeroMQ), driven step by step in one process."""

from __future__ import annotations

import contextlib
import gc
import time

import pytest
from engine_util import run_to_completion, token_ids
from transformers import AutoTokenizer

from pdserve.kvstore.handoff_node import HandoffNode
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import GenerateRequest, Output
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.engine import Engine
from pdserve.serve.handoff import HandOff
from pdserve.serve.kv_transfer import KVTransfer

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(3, 28))  # 25 tokens: three full blocks and a partial one


def _engine(model_dir) -> Engine:
    return Engine(ModelConfig(str(model_dir)), CacheConfig(block_size=BLOCK, num_blocks=64),
                  tokenizer=AutoTokenizer.from_pretrained(model_dir))


def _drive(handoffs: list[HandOff], done, timeout_s: float = 60.0) -> list[Output]:
    """The worker loops without sockets: poll transfers, step, collect wire outputs."""
    outputs: list[Output] = []
    deadline = time.monotonic() + timeout_s
    while not done(outputs):
        assert time.monotonic() < deadline, outputs
        for handoff in handoffs:
            outputs += handoff.poll()
            if handoff.engine.has_unfinished_requests():
                outputs += [w for d in handoff.engine.step()
                            if (w := handoff.to_wire(d)) is not None]
        time.sleep(0.002)
    return outputs


def _finished(outs: list[Output]) -> bool:
    return any(o.request_id == "r" and o.finish_reason not in (None, "handoff") for o in outs)


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[int]:
    reference = _engine(llama_dir)
    try:
        reference.add_request(PROMPT, GREEDY, "r")
        return token_ids(run_to_completion(reference)["r"])
    finally:
        reference.shutdown()


@contextlib.contextmanager
def _pair(llama_dir, shm_bytes: int):
    """(prefill HandOff, decode HandOff, the prefill worker's node with a segment of
    `shm_bytes`, 0: none)."""
    engines = [_engine(llama_dir), _engine(llama_dir)]
    node = HandoffNode("prefill-p", "127.0.0.1", 32, 30.0, 5.0, shm_bytes=shm_bytes)
    transfers = [KVTransfer.connect(engines[0].runner, engines[0].block_manager, None,
                                    handoff_node=node),
                 KVTransfer.connect(engines[1].runner, engines[1].block_manager, None)]
    try:
        yield (HandOff(engines[0], "prefill", "p", transfers[0]),
               HandOff(engines[1], "decode", "d", transfers[1]), node)
    finally:
        for transfer in transfers:
            transfer.close()
        for engine in engines:
            engine.shutdown()


@pytest.fixture
def pair(llama_dir):
    with _pair(llama_dir, 8 << 20) as handoffs:
        assert handoffs[2].shm_segment is not None
        yield handoffs


def _prefill(prefill: HandOff) -> Output:
    prefill.add(GenerateRequest("r", PROMPT, GREEDY))
    [first] = [o for o in _drive([prefill], lambda outs: any(o.finish_reason == "handoff"
                                                             for o in outs))]
    assert first.handoff is not None and len(first.handoff.block_keys) == 4
    return first


def _decode(prefill: HandOff, decode: HandOff, first: Output) -> list[int]:
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    outputs = _drive([prefill, decode], lambda outs: _finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    mine = [o for o in outputs if o.request_id == "r"]
    assert all(o.error is None for o in mine)
    return first.token_ids + [t for o in mine for t in o.token_ids]


def _assert_all_free(prefill: HandOff, decode: HandOff, node: HandoffNode) -> None:
    for handoff in (prefill, decode):  # the releases go out on the connectors' job threads
        assert handoff.kv_transfer.connector.drain(20.0)
    gc.collect()
    assert node.num_leases == 0 and node.num_pinned_blocks == 0
    assert node.num_shm_allocations == 0  # dropped at release: the memory is reused warm
    node.check_integrity()
    for handoff in (prefill, decode):
        handoff.engine.block_manager.check_integrity()
        assert handoff.engine.block_manager.num_used_blocks == 0


def test_handoff_on_one_host_joins_the_batch_at_once_from_the_segment(pair, expected):
    prefill, decode, node = pair
    first = _prefill(prefill)
    spans = first.handoff.shm_spans
    assert first.handoff.shm_segment == node.shm_segment and len(spans) == 4
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert not decode._loading and "r" in decode.engine.scheduler.requests  # no load job
    outputs = _drive([prefill, decode], lambda outs: _finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    tokens = first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]
    assert tokens == expected
    totals = decode.kv_transfer.totals()
    assert totals["in_place_count"] == totals["load_count"] == 1
    _assert_all_free(prefill, decode, node)


def test_handoff_freed_before_it_is_read_loads_or_recomputes(pair, expected):
    prefill, decode, node = pair
    first = _prefill(prefill)
    node.release(first.handoff.lease_id)  # as an expired lease would: the node drops them
    gc.collect()
    assert decode.kv_transfer.map_handoff(first.handoff) is None
    assert _decode(prefill, decode, first) == expected  # nothing to load: recomputed
    assert decode.kv_transfer.totals()["in_place_count"] == 0
    _assert_all_free(prefill, decode, node)


def test_handoff_freed_while_it_is_copied_is_recomputed(pair, expected, monkeypatch):
    prefill, decode, node = pair
    first = _prefill(prefill)
    mapped = decode.kv_transfer.map_handoff

    def freed_meanwhile(handoff):
        layers, _ = mapped(handoff)
        return layers, lambda: False  # the serial changed under the copy

    monkeypatch.setattr(decode.kv_transfer, "map_handoff", freed_meanwhile)
    assert _decode(prefill, decode, first) == expected
    # the aborted copy published no block key: nothing in the decode cache holds its bytes
    assert decode.engine.block_manager.num_cached_blocks == len(PROMPT) // BLOCK
    _assert_all_free(prefill, decode, node)


def test_handoff_without_a_segment_loads_over_the_network(llama_dir, expected, monkeypatch):
    monkeypatch.setenv("PDSERVE_HANDOFF_SHM", "0")  # nor would the decode side map one
    with _pair(llama_dir, 0) as (prefill, decode, node):
        first = _prefill(prefill)
        assert first.handoff.shm_segment is None and first.handoff.shm_spans == []
        assert _decode(prefill, decode, first) == expected
        totals = decode.kv_transfer.totals()
        assert totals["load_count"] == 1 and totals["in_place_count"] == 0
        assert totals["loaded_bytes"] > 0
        _assert_all_free(prefill, decode, node)


def test_handoff_that_cannot_be_admitted_still_gives_its_lease_back(pair, monkeypatch):
    prefill, decode, node = pair
    first = _prefill(prefill)

    def refuse(*args, **kwargs):
        raise ValueError("no room for this prompt")

    monkeypatch.setattr(decode.engine, "add_prefilled_request", refuse)
    with pytest.raises(ValueError, match="no room"):
        decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    _drive([prefill, decode], lambda outs: not decode.is_busy and not prefill.is_busy)
    _assert_all_free(prefill, decode, node)
