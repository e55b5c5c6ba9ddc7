"""A hand-off between workers on one host, in place: the prefill worker stages the prompt's KV
in its hand-off node's shared memory segment and the hand-off says where; the decode worker
maps the segment and copies the blocks straight into its pool as the hand-off arrives, so the
request joins the batch at once (no load job, no request to the prefill worker). The tokens
are a colocated engine's; leases, pins and segment memory all end free. Blocks freed before
or while they are read are recomputed. The worker's own components (RequestGateway, KVTransfer, a
real HandoffNode served over ZeroMQ), driven step by step in one process."""

from __future__ import annotations

import gc

import pytest
from helpers.handoff_util import (
    BLOCK,
    GREEDY,
    PROMPT,
    assert_all_free,
    decode_handoff,
    drive,
    finished,
    handoff_pair,
    prefill_prompt,
)

from pdserve.protocol.worker import GenerateRequest


def test_handoff_on_one_host_joins_the_batch_at_once_from_the_segment(
        shm_handoffs, handoff_expected):
    prefill, decode, node = shm_handoffs
    first = prefill_prompt(prefill)
    spans = first.handoff.shm_spans
    assert first.handoff.shm_segment == node.shm_segment and len(spans) == 4
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    # no load job
    assert not decode.admissions.loaded.num_in_flight and "r" in decode.engine.scheduler.requests
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    tokens = first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]
    assert tokens == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["in_place_count"] == totals["load_count"] == 1
    assert_all_free(prefill, decode, node)


def test_handoff_freed_before_it_is_read_loads_or_recomputes(shm_handoffs, handoff_expected):
    prefill, decode, node = shm_handoffs
    first = prefill_prompt(prefill)
    node.release(first.handoff.lease_id)  # as an expired lease would: the node drops them
    gc.collect()
    assert decode.kv_transfer.map_handoff(first.handoff) is None
    assert decode_handoff(prefill, decode, first) == handoff_expected  # nothing to load: recomputed
    assert decode.kv_transfer.totals()["in_place_count"] == 0
    assert_all_free(prefill, decode, node)


def test_handoff_freed_while_it_is_copied_is_recomputed(
        shm_handoffs, handoff_expected, monkeypatch):
    prefill, decode, node = shm_handoffs
    first = prefill_prompt(prefill)
    mapped = decode.kv_transfer.map_handoff

    def freed_meanwhile(handoff):
        layers, _ = mapped(handoff)
        return layers, lambda: False  # the serial changed under the copy

    monkeypatch.setattr(decode.kv_transfer, "map_handoff", freed_meanwhile)
    assert decode_handoff(prefill, decode, first) == handoff_expected
    # the aborted copy published no block key: nothing in the decode cache holds its bytes
    assert decode.engine.block_manager.num_cached_blocks == len(PROMPT) // BLOCK
    assert_all_free(prefill, decode, node)


def test_handoff_without_a_segment_loads_over_the_network(llama_dir, handoff_expected):
    # --no-handoff-shm: nor would the decode side map one
    with handoff_pair(llama_dir, 0, shm=False) as (prefill, decode, node):
        first = prefill_prompt(prefill)
        assert first.handoff.shm_segment is None and first.handoff.shm_spans == []
        assert decode_handoff(prefill, decode, first) == handoff_expected
        totals = decode.kv_transfer.totals()
        assert totals["load_count"] == 1 and totals["in_place_count"] == 0
        assert totals["loaded_bytes"] > 0
        assert_all_free(prefill, decode, node)


def test_handoff_that_cannot_be_admitted_still_gives_its_lease_back(shm_handoffs, monkeypatch):
    prefill, decode, node = shm_handoffs
    first = prefill_prompt(prefill)

    def refuse(*args, **kwargs):
        raise ValueError("no room for this prompt")

    monkeypatch.setattr(decode.engine, "add_prefilled_request", refuse)
    with pytest.raises(ValueError, match="no room"):
        decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    drive([prefill, decode], lambda outs: not decode.is_busy and not prefill.is_busy)
    assert_all_free(prefill, decode, node)
