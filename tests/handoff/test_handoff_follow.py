"""A decode worker follows a prefill on its host layer by layer (pdserve/serve/worker/follow.py):
the prefill worker announces its staging as the forward stages layer 0 (Output.staging), the decode
worker reserves blocks and copies each layer the staging's header counts, and the hand-off
then only claims the blocks. The tokens are a colocated engine's; reservations, leases, pins
and segment memory all end free; a staging freed under the copy is recomputed. The worker's
own components driven in one process (tests/handoff/test_handoff_in_place.py's pair), each prefill
layer followed by a turn of the decode loop, as two processes on two cores would run."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from helpers.handoff_util import (
    BLOCK,
    GREEDY,
    PROMPT,
    assert_all_free,
    drive,
    finished,
    handoff_pair,
)

from pdserve.kvstore.shm_segment import TOTAL_STORE_ORDER
from pdserve.protocol.codec import WireError
from pdserve.protocol.store.data import ShmSegment, ShmSpan
from pdserve.protocol.worker import (
    WORKER_PROTOCOL,
    FollowPrefill,
    GenerateRequest,
    KVStaging,
    Output,
)
from pdserve.serve.worker.gateway import RequestGateway

NUM_BLOCKS = 4  # 25 tokens in blocks of 8


def _follow_while_prefilling(prefill: RequestGateway, decode: RequestGateway, monkeypatch
                             ) -> tuple[Output, list[int]]:
    """Prefill the prompt with the decode worker following: the announcement goes straight
    to decode.follow (the router's part), and after each layer the prefill saves, the decode
    loop turns once. Returns the hand-off Output and the layers copied after each turn."""
    announced: list[Output] = []

    def send(output: Output) -> None:
        announced.append(output)
        assert output.staging is not None and output.token_ids == []
        decode.follow(FollowPrefill(output.request_id, len(PROMPT), output.staging))

    prefill.announcer.send = send
    connector = prefill.kv_transfer.connector
    save_layer = connector.save_layer
    copied: list[int] = []

    def save_then_decode_turns(*args, **kwargs):
        save_layer(*args, **kwargs)
        decode.poll()
        follow = decode.admissions.followers._follows.get("r")
        copied.append(-1 if follow is None else follow.num_copied)

    monkeypatch.setattr(connector, "save_layer", save_then_decode_turns)
    prefill.add(GenerateRequest("r", PROMPT, GREEDY))
    outputs = drive([prefill], lambda outs: any(o.finish_reason == "handoff" for o in outs))
    [first] = [o for o in outputs if o.finish_reason == "handoff"]
    assert len(announced) == 1 and announced[0].staging.num_blocks == NUM_BLOCKS
    assert first.handoff is not None and first.handoff.shm_spans
    return first, copied


@pytest.mark.parametrize("copy_early", [True, False], ids=["own-cores", "lending-cores"])
def test_decode_copies_each_layer_as_the_prefill_stages_it(
        shm_handoffs, handoff_expected, monkeypatch, copy_early):
    """A decode worker that lends its idle cores to the prefill (pdserve/serve/cpu/core_share.py)
    copies nothing while the layers come (the copies would stall the prefill's thread there), and
    all of them once every one is staged."""
    prefill, decode, node = shm_handoffs
    decode.copy_early = copy_early
    first, copied = _follow_while_prefilling(prefill, decode, monkeypatch)
    num_layers = decode.admissions.followers.num_layers
    if TOTAL_STORE_ORDER and copy_early:  # each turn found the layer just staged
        assert copied == list(range(1, num_layers + 1)) and not decode.is_following
    else:
        assert copied == [0] * (num_layers - 1) + [num_layers] and not decode.is_following
    assert decode.engine.block_manager.num_reserved_blocks == NUM_BLOCKS
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert decode.engine.block_manager.num_reserved_blocks == 0  # claimed by the request
    assert "r" in decode.engine.scheduler.requests and not decode.admissions.loaded.num_in_flight
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    tokens = first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]
    assert tokens == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["followed_count"] == totals["in_place_count"] == totals["load_count"] == 1
    assert totals["loaded_bytes"] == prefill.kv_transfer.totals()["saved_bytes"] > 0
    assert_all_free(prefill, decode, node)


def test_an_aborted_follow_gives_its_blocks_back(shm_handoffs, monkeypatch):
    prefill, decode, node = shm_handoffs
    first, _ = _follow_while_prefilling(prefill, decode, monkeypatch)
    assert decode.engine.block_manager.num_reserved_blocks == NUM_BLOCKS and decode.is_busy
    decode.abort("r")  # the router's: the client left, or the hand-off went elsewhere
    assert decode.engine.block_manager.num_reserved_blocks == 0
    prefill.kv_transfer.release(first.handoff.lease_id, first.handoff.source_address)
    drive([prefill, decode], lambda outs: not decode.is_busy and not prefill.is_busy)
    assert_all_free(prefill, decode, node)


def test_a_staging_freed_under_the_follow_is_recomputed(
        shm_handoffs, handoff_expected, monkeypatch):
    prefill, decode, node = shm_handoffs
    first, _ = _follow_while_prefilling(prefill, decode, monkeypatch)
    node.release(first.handoff.lease_id)  # as an expired lease would: the node drops them
    drive([prefill], lambda outs: node.num_shm_allocations == 0)
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    tokens = first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]
    assert tokens == handoff_expected
    # the copy published no block key: the decode cache holds only the recomputed prompt
    assert decode.engine.block_manager.num_cached_blocks == len(PROMPT) // BLOCK
    assert_all_free(prefill, decode, node)


def test_a_follow_that_cannot_be_is_ignored_and_the_hand_off_takes_the_usual_path(
        shm_handoffs, handoff_expected, monkeypatch):
    prefill, decode, node = shm_handoffs
    first, _ = _follow_while_prefilling(prefill, decode, monkeypatch)
    staging = decode.admissions.followers._follows["r"].staging
    decode.abort("r")
    for wrong in (FollowPrefill("r", len(PROMPT) + 8, staging),  # one block more
                  FollowPrefill("r", len(PROMPT), KVStaging(staging.segment, staging.span,
                                                            NUM_BLOCKS, "float16"))):
        decode.follow(wrong)
        assert not decode.admissions.followers
        assert decode.engine.block_manager.num_reserved_blocks == 0
    gone = ShmSegment(staging.segment.host, staging.segment.pid, 999, 1, 4096)
    decode.follow(FollowPrefill("r", len(PROMPT), KVStaging(gone, staging.span, NUM_BLOCKS)))
    assert not decode.admissions.followers
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    tokens = first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]
    assert tokens == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["in_place_count"] == 1 and totals["followed_count"] == 0
    assert_all_free(prefill, decode, node)


def test_follow_messages_round_trip_and_bad_ones_are_refused():
    segment = ShmSegment("boot/ns", 12, 5, 77, 1 << 20)
    staging = KVStaging(segment, ShmSpan(4160, 4096, 3), 4, "float32")
    for message in (FollowPrefill("r", 25, staging), Output("r", [], "", staging=staging)):
        assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(message)) == message
    fields = msgpack.unpackb(WORKER_PROTOCOL.encode(FollowPrefill("r", 25, staging)))
    for name, value in (("num_prompt_tokens", 0), ("num_prompt_tokens", True),
                        ("staging", {**fields["staging"], "num_blocks": 0}),
                        ("staging", {**fields["staging"], "span": None})):
        with pytest.raises(WireError):
            WORKER_PROTOCOL.decode(msgpack.packb({**fields, name: value}))
    with pytest.raises(ValueError, match="num_blocks"):
        KVStaging(segment, ShmSpan(4160, 4096, 3), 0)


def test_no_staging_is_announced_with_follow_off(llama_dir):
    with handoff_pair(llama_dir, 8 << 20, follow=False) as (prefill, decode, node):
        sent: list[Output] = []
        prefill.announcer.send = sent.append
        prefill.add(GenerateRequest("r", PROMPT, GREEDY))
        outputs = drive([prefill], lambda outs: any(o.finish_reason == "handoff" for o in outs))
        assert sent == [] and outputs[-1].handoff.shm_spans  # still staged in the segment
        prefill.kv_transfer.release(outputs[-1].handoff.lease_id,
                                    outputs[-1].handoff.source_address)
        drive([prefill, decode], lambda outs: not prefill.is_busy)
        assert_all_free(prefill, decode, node)


def test_a_prefill_on_borrowed_cores_announces_once_every_layer_is_staged(
        shm_handoffs, handoff_expected):
    """On an idle decode worker's cores the prefill announces its staging only at the last
    layer (during the forward that worker copies nothing, and the messages would take time
    from the forward's thread there); the decode worker then copies it all before the
    hand-off comes."""
    prefill, decode, node = shm_handoffs
    prefill.borrowing_cores, decode.copy_early = True, False
    num_layers = decode.admissions.followers.num_layers
    progress_when_sent: list[int] = []

    def send(output: Output) -> None:
        follow = FollowPrefill(output.request_id, len(PROMPT), output.staging)
        _, progress, _ = decode.kv_transfer.map_staging(output.staging)
        progress_when_sent.append(progress())
        decode.follow(follow)
        decode.poll()  # the decode loop's turn: everything is staged, so all is copied

    prefill.announcer.send = send
    prefill.add(GenerateRequest("r", PROMPT, GREEDY))
    outputs = drive([prefill], lambda outs: any(o.finish_reason == "handoff" for o in outs))
    assert progress_when_sent == [num_layers]
    if TOTAL_STORE_ORDER:  # (elsewhere the copy waits for the hand-off)
        assert decode.admissions.followers._follows["r"].num_copied == num_layers
    first = outputs[-1]
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                    and not prefill.is_busy)
    tokens = first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]
    assert tokens == handoff_expected
    assert decode.kv_transfer.totals()["followed_count"] == 1
    assert_all_free(prefill, decode, node)


def test_a_hand_off_that_does_not_take_the_follow_frees_its_reservation(shm_handoffs, monkeypatch):
    """A refused hand-off (here: a dtype this cache does not hold) or one without blocks
    still lets its follow's reservation go, at once."""
    prefill, decode, node = shm_handoffs
    first, _ = _follow_while_prefilling(prefill, decode, monkeypatch)
    assert decode.engine.block_manager.num_reserved_blocks == NUM_BLOCKS
    wrong = dataclasses.replace(first.handoff, kv_cache_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=wrong))
    assert decode.engine.block_manager.num_reserved_blocks == 0 and not decode.admissions.followers
    prefill.kv_transfer.release(first.handoff.lease_id, first.handoff.source_address)
    drive([prefill, decode], lambda outs: not decode.is_busy and not prefill.is_busy)
    assert_all_free(prefill, decode, node)
