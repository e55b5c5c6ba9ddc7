"""A decode worker follows a prefill on another host layer by layer (pdserve/serve/worker/follow.py,
pdserve/handoff/layer_pull.py): with no shared memory anywhere (PDSERVE_HANDOFF_SHM=0, as between
two hosts), the prefill announces its staging with its hand-off node's address, the decode worker
reserves the prompt's blocks and pulls each layer from the node as it is staged, so each
layer is in decode's blocks before the next one is computed; the hand-off then claims them.
Tokens are a colocated engine's; reservations, leases, pins and live stagings all end free;
an abort on either side frees everything. The two workers' components driven in one process
(tests/helpers/handoff_util.py), the node served on its own port as in a worker."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers.handoff_util import (
    GREEDY,
    PROMPT,
    assert_all_free,
    drive,
    finished,
    handoff_pair,
    prefill_prompt,
)

from pdserve.kvstore.live_staging import LiveStagings, read_layers
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.store.data import GetLayersRequest
from pdserve.protocol.worker import FollowPrefill, GenerateRequest, Output
from pdserve.serve.worker.kv_source import KVSources

NUM_BLOCKS = 4  # 25 tokens in blocks of 8


@pytest.fixture
def network_handoffs(llama_dir):
    with handoff_pair(llama_dir, 0, shm=False) as handoffs:
        assert handoffs[2].shm_segment is None
        yield handoffs


def _finish(prefill, decode, first: Output) -> list[int]:
    """Run both loops until the handed-off request finished: all of its tokens."""
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    assert all(o.error is None for o in outputs)
    return first.token_ids + [t for o in outputs if o.request_id == "r" for t in o.token_ids]


def _follow(decode, request_id: str = "r"):
    return decode.admissions.followers._follows.get(request_id)


def _wait_for(condition, decode, timeout_s: float = 10.0) -> bool:
    """Turn the decode loop until `condition()` (its pull lands in the background)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        decode.poll()
        time.sleep(0.001)
    return True


def _prefill_followed(prefill, decode, monkeypatch, after_layer=None) -> Output:
    """Prefill PROMPT while decode follows (the announcement goes to decode.follow, the
    router's part); after each layer the prefill stages, `after_layer(layer)` runs."""
    announced: list[Output] = []

    def send(output: Output) -> None:
        announced.append(output)
        decode.follow(FollowPrefill(output.request_id, len(PROMPT), output.staging))

    prefill.announcer.send = send
    connector = prefill.kv_transfer.connector
    save_layer = connector.save_layer

    def save_then(request_id, layer, *args, **kwargs):
        save_layer(request_id, layer, *args, **kwargs)
        if after_layer is not None:
            after_layer(layer)

    monkeypatch.setattr(connector, "save_layer", save_then)
    prefill.add(GenerateRequest("r", PROMPT, GREEDY))
    outputs = drive([prefill], lambda outs: any(o.finish_reason == "handoff" for o in outs))
    [first] = [o for o in outputs if o.finish_reason == "handoff"]
    [staging] = [o.staging for o in announced]
    assert staging.segment is None and staging.source_address == prefill.kv_transfer.connector \
        .handoff_node.address and staging.staging_id > 0
    assert staging.block_keys == first.handoff.block_keys and not first.handoff.shm_spans
    return first


def test_each_layer_reaches_decode_before_the_next_is_computed(
        network_handoffs, handoff_expected, monkeypatch):
    prefill, decode, node = network_handoffs
    copied: list[int] = []

    def layer_in_decode(layer: int) -> None:
        # the forward waits here until decode holds this layer: it crossed while the
        # prefill could go on
        assert _wait_for(lambda: _follow(decode) is not None
                         and _follow(decode).num_copied > layer, decode), layer
        copied.append(_follow(decode).num_copied)

    first = _prefill_followed(prefill, decode, monkeypatch, layer_in_decode)
    num_layers = decode.admissions.followers.num_layers
    assert copied == list(range(1, num_layers + 1))
    assert decode.engine.block_manager.num_reserved_blocks == NUM_BLOCKS
    assert len(node.stagings) == 0  # the save ended: its blocks are the node's now
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert decode.engine.block_manager.num_reserved_blocks == 0  # claimed by the request
    assert _finish(prefill, decode, first) == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["pulled_count"] == totals["followed_count"] == totals["load_count"] == 1
    assert totals["in_place_count"] == 0
    saved = prefill.kv_transfer.totals()["saved_bytes"]
    assert totals["handoff_bytes"] == totals["loaded_bytes"] == saved > 0
    assert_all_free(prefill, decode, node)


def test_a_hand_off_ahead_of_its_last_layers_waits_for_them(
        network_handoffs, handoff_expected, monkeypatch):
    """The hand-off comes before the pull brought every layer: the request waits (no load
    starts, nothing is copied twice) and joins once they came, from the node's store."""
    prefill, decode, node = network_handoffs
    connector = decode.kv_transfer.connector
    decode.kv_transfer.sources = KVSources(connector.transport.policy, connector.block_bytes,
                                           lambda: None)
    pull_layers = connector._pull
    held: list = []
    monkeypatch.setattr(connector, "_pull", held.append)  # the pull waits to start...
    first = _prefill_followed(prefill, decode, monkeypatch)
    [pull] = held
    assert _follow(decode).num_copied == 0
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert decode.admissions.followed.is_waiting("r") and "r" not in decode.admissions.loaded
    monkeypatch.setattr(connector, "_pull", pull_layers)  # ...until the hand-off is here
    connector.run_job(lambda: connector._pull(pull))
    assert _finish(prefill, decode, first) == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["pulled_count"] == 1 and totals["loaded_bytes"] == prefill.kv_transfer \
        .totals()["saved_bytes"]
    # admitted twice (waiting, then once its layers came), its pull counted once
    assert totals["handoff_source_transfer"] == 1
    assert_all_free(prefill, decode, node)


def test_a_decode_abort_mid_pull_frees_everything(network_handoffs, monkeypatch):
    prefill, decode, node = network_handoffs

    def abort_at_the_last_layer(layer: int) -> None:
        if layer == decode.admissions.followers.num_layers - 1:
            assert _wait_for(lambda: _follow(decode).num_copied >= 1, decode)
            decode.abort("r")  # the client left, or the router moved the request
            assert decode.engine.block_manager.num_reserved_blocks == 0
            aborted.append(layer)

    aborted: list[int] = []
    first = _prefill_followed(prefill, decode, monkeypatch, abort_at_the_last_layer)
    assert aborted and not decode.is_busy
    prefill.kv_transfer.release(first.handoff.lease_id, first.handoff.source_address)
    drive([prefill, decode], lambda outs: not decode.is_busy and not prefill.is_busy)
    assert_all_free(prefill, decode, node)
    assert len(node.stagings) == 0


def test_a_staging_gone_mid_pull_frees_the_reservation_and_the_hand_off_loads(
        network_handoffs, handoff_expected, monkeypatch):
    """The staging ends under the pull with its blocks nowhere (as when the prefill's save
    fails): the pull hears it is gone, the reservation goes back, and the hand-off that comes
    loads the usual way."""
    prefill, decode, node = network_handoffs

    def drop_the_staging(layer: int) -> None:
        if layer == 0:
            node.stagings.end(_follow(decode).staging.staging_id)
            assert _wait_for(lambda: _follow(decode) is None, decode)
            assert decode.engine.block_manager.num_reserved_blocks == 0
            dropped.append(layer)

    dropped: list[int] = []
    first = _prefill_followed(prefill, decode, monkeypatch, drop_the_staging)
    assert dropped
    drive([prefill, decode], lambda outs: not prefill.is_busy)  # (its save's result)
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert "r" in decode.admissions.loaded
    assert _finish(prefill, decode, first) == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["pulled_count"] == 0 and totals["load_count"] == 1
    assert_all_free(prefill, decode, node)


def _fail_the_pull_after_layer_0(decode, node):
    """An after_layer hook: once decode copied layer 0, the staging ends with its blocks
    nowhere (as when the prefill's save fails), so the pull's next round trip hears it is
    gone, before the prefill computes layer 1."""
    def fail(layer: int) -> None:
        if layer == 0:
            assert _wait_for(lambda: _follow(decode).num_copied >= 1, decode)
            node.stagings.end(_follow(decode).staging.staging_id)
            assert _wait_for(lambda: _follow(decode) is None, decode)
            failed.append(layer)

    failed: list[int] = []
    return fail, failed


def test_a_failed_pull_s_layers_are_not_counted_with_its_load(
        network_handoffs, handoff_expected, monkeypatch):
    """Layer 0 is pulled, then the pull fails and the hand-off loads every block: the
    hand-off moved the prompt's blocks once (kv_handoff_bytes), not layer 0 twice."""
    prefill, decode, node = network_handoffs
    fail, failed = _fail_the_pull_after_layer_0(decode, node)
    first = _prefill_followed(prefill, decode, monkeypatch, fail)
    assert failed
    drive([prefill, decode], lambda outs: not prefill.is_busy)  # (its save's result)
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert "r" in decode.admissions.loaded
    assert _finish(prefill, decode, first) == handoff_expected
    totals = decode.kv_transfer.totals()
    block_bytes = decode.kv_transfer.connector.block_bytes
    assert totals["pulled_count"] == 0 and totals["load_count"] == 1
    assert totals["handoff_bytes"] == NUM_BLOCKS * block_bytes
    assert totals["handoff_reused_bytes"] == 0
    assert_all_free(prefill, decode, node)


def test_a_failed_pull_s_held_blocks_are_counted_once_by_its_fallback_load(
        network_handoffs, handoff_expected, monkeypatch):
    """Decode holds the prompt's first two blocks (an earlier prompt's): the follow reserves
    them, its pull fails after layer 0, and the hand-off's load holds them again and moves
    the other two. Each block counts once: two reused, two moved."""
    prefill, decode, node = network_handoffs
    prefill.add(GenerateRequest("a", PROMPT[:16], GREEDY))  # not followed (no announcer)
    [first_a] = [o for o in drive([prefill, decode], lambda outs: any(
        o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
    decode.add(GenerateRequest("a", PROMPT[:16], GREEDY, handoff=first_a.handoff))
    drive([prefill, decode], lambda outs: any(
        o.request_id == "a" and o.finish_reason not in (None, "handoff") for o in outs)
        and not decode.is_busy and not prefill.is_busy)
    block_bytes = decode.kv_transfer.connector.block_bytes
    before = decode.kv_transfer.totals()
    assert before["handoff_bytes"] == 2 * block_bytes and before["handoff_reused_bytes"] == 0

    fail, failed = _fail_the_pull_after_layer_0(decode, node)
    first = _prefill_followed(prefill, decode, monkeypatch, fail)
    assert failed
    drive([prefill, decode], lambda outs: not prefill.is_busy)
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert "r" in decode.admissions.loaded
    assert _finish(prefill, decode, first) == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["handoff_reused_bytes"] == 2 * block_bytes
    assert totals["handoff_bytes"] - before["handoff_bytes"] == 2 * block_bytes
    assert_all_free(prefill, decode, node)


def test_live_stagings_serve_what_is_staged_then_the_stored_blocks():
    """The node's side alone: a pull gets the layers staged so far (waiting for the first),
    then, once the save ended, the rest from the stored blocks: the same bytes; an unknown
    staging is gone."""
    num_layers, layer_bytes, keys = 4, 16, [bytes([i]) * 16 for i in range(3)]
    blocks = torch.arange(3 * num_layers * layer_bytes, dtype=torch.int32).to(torch.uint8)
    staging = blocks.view(3, num_layers * layer_bytes)
    stagings, stored = LiveStagings(), {}

    def ask(first_layer: int, first_block: int = 1, wait_s: float = 0.0):
        request = GetLayersRequest(1, staging_id=7, keys=keys[first_block:],
                                   first_block=first_block, first_layer=first_layer,
                                   num_layers=num_layers, wait_s=wait_s, ucx_tag=None)
        return read_layers(stagings, lambda ks: [stored.get(k) for k in ks], request)

    stagings.begin(7, keys, staging, num_layers)
    assert ask(0) == (0, None, False)  # nothing staged within wait_s
    stagings.progress(7, 2)
    count, payload, gone = ask(0, wait_s=0.5)
    expected = blocks.view(3, num_layers, layer_bytes).numpy()
    assert count == 2 and not gone and np.array_equal(payload, expected[1:, :2])
    stored.update({k: staging[i].numpy() for i, k in enumerate(keys)})
    stagings.end(7)
    count, payload, gone = ask(2)
    assert count == 2 and np.array_equal(payload, expected[1:, 2:])
    stored.clear()
    assert ask(2) == (0, None, True)


def test_a_prompt_decode_holds_whole_is_followed_with_nothing_to_pull(
        network_handoffs, monkeypatch):
    """The second time a prompt of whole blocks comes, decode holds every block: the follow
    reserves them from its pool and pulls nothing, and the hand-off claims them."""
    prefill, decode, node = network_handoffs
    prompt = PROMPT[:24]  # three whole blocks
    prefill.announcer.send = lambda output: decode.follow(
        FollowPrefill(output.request_id, len(prompt), output.staging))
    texts = []
    for request_id in ("a", "b"):
        prefill.add(GenerateRequest(request_id, prompt, GREEDY))
        [first] = [o for o in drive([prefill, decode], lambda outs: any(
            o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
        if request_id == "b":
            follow = _follow(decode, "b")
            assert follow.pull is None and follow.num_held == 3
        decode.add(GenerateRequest(request_id, prompt, GREEDY, handoff=first.handoff))
        outputs = drive([prefill, decode], lambda outs, rid=request_id: any(
            o.request_id == rid and o.finish_reason not in (None, "handoff")
            for o in outs) and not decode.is_busy and not prefill.is_busy)
        assert all(o.error is None for o in outputs)
        texts.append(first.token_ids + [t for o in outputs for t in o.token_ids])
    assert texts[0] == texts[1]
    totals = decode.kv_transfer.totals()
    assert totals["followed_count"] == 2 and totals["pulled_count"] == 1
    assert totals["handoff_reused_bytes"] == totals["handoff_bytes"] > 0
    assert_all_free(prefill, decode, node)


def test_a_prefill_on_borrowed_cores_announces_no_pull(network_handoffs, handoff_expected):
    """A prefill on an idle decode worker's cores (pdserve/serve/cpu/core_share.py) says nothing of
    a staging decode would have to pull: the pull would take cores from its sampling and send;
    the hand-off loads the usual way."""
    prefill, decode, node = network_handoffs
    announced: list[Output] = []
    prefill.announcer.send = announced.append
    prefill.announcer.borrowing_cores = True
    prefill.add(GenerateRequest("r", PROMPT, GREEDY))
    [first] = [o for o in drive([prefill], lambda outs: any(
        o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
    assert announced == []
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert "r" in decode.admissions.loaded
    assert _finish(prefill, decode, first) == handoff_expected
    assert_all_free(prefill, decode, node)


def test_a_decode_worker_lending_its_cores_pulls_only_once_the_hand_off_comes(
        network_handoffs, handoff_expected, monkeypatch):
    """A decode worker that lends its idle cores to a prefill on its host (pdserve/serve/cpu/
    core_share.py) reserves the blocks but asks for no layer while it lends (receiving and
    copying would stall the prefill's threads there); the hand-off resumes the pull."""
    prefill, decode, node = network_handoffs
    decode.copy_early = False  # lending

    def nothing_asked(layer: int) -> None:
        decode.poll()
        assert _follow(decode).pull.next_layer == 0 and _follow(decode).num_copied == 0
        checked.append(layer)

    checked: list[int] = []
    first = _prefill_followed(prefill, decode, monkeypatch, nothing_asked)
    assert checked == list(range(decode.admissions.followers.num_layers))
    assert decode.engine.block_manager.num_reserved_blocks == NUM_BLOCKS
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert _finish(prefill, decode, first) == handoff_expected
    totals = decode.kv_transfer.totals()
    assert totals["pulled_count"] == 1 and totals["loaded_bytes"] == prefill.kv_transfer \
        .totals()["saved_bytes"]
    decode.copy_early = True  # (takes its cores back: nothing left to resume)
    assert_all_free(prefill, decode, node)


def test_a_pull_whose_link_drops_mid_transfer_completes_from_the_store(
        network_handoffs, handoff_expected, monkeypatch):
    """Both workers share a fleet store (the prefill's offer is written back to it). Decode
    pulls layer 0, then the link to the prefill's node drops (stubbed: every request to it
    times out, as UCX or ZeroMQ would): the pull fails, its reservation goes back, and the
    hand-off loads from the store — the node passed over — with a colocated engine's
    tokens. The node's lease, which decode can no longer give back, is left to expire."""
    prefill, decode, node = network_handoffs
    fleet = TieredStore.build(32)
    for worker in (prefill, decode):  # (what --store gives a worker)
        connector = worker.kv_transfer.connector
        connector.backend = connector.transport.backend = fleet
        connector.transport.policy.has_store = True
    transfer = decode.kv_transfer  # (make_kv_transfer's choice of source; no prefill measured)
    transfer.sources = KVSources(transfer.connector.transport.policy,
                                 transfer.connector.block_bytes, lambda: None)
    store_reads: list[int] = []
    fleet_get = fleet.get_many
    monkeypatch.setattr(fleet, "get_many", lambda keys: store_reads.append(len(keys))
                        or fleet_get(keys))
    peers = decode.kv_transfer.connector.transport.peers
    backend_for = peers.backend_for
    node_reads: list[str] = []

    def link(source: str):
        node_reads.append(source)
        if dropped:
            raise TimeoutError(f"no answer from {source} (the link is down)")
        return backend_for(source)

    monkeypatch.setattr(peers, "backend_for", link)

    def drop_the_link(layer: int) -> None:
        if layer == 0:
            assert _wait_for(lambda: _follow(decode).num_copied >= 1, decode)
            dropped.append(layer)
            assert _wait_for(lambda: _follow(decode) is None, decode)  # the pull failed
            assert decode.engine.block_manager.num_reserved_blocks == 0

    dropped: list[int] = []
    first = _prefill_followed(prefill, decode, monkeypatch, drop_the_link)
    assert dropped and peers.recently_failed(first.handoff.source_address)
    drive([prefill, decode], lambda outs: not prefill.is_busy)
    prefill.poll()  # the write-back starts the turn after the hand-off went out
    assert prefill.kv_transfer.connector.drain(20.0)
    assert fleet.get_many(list(first.handoff.block_keys)).count(None) == 0
    store_reads.clear()
    node_reads_before = len(node_reads)
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert "r" in decode.admissions.loaded
    assert _finish(prefill, decode, first) == handoff_expected
    assert store_reads == [NUM_BLOCKS]  # every block from the store...
    assert len(node_reads) == node_reads_before  # ...and nothing asked of the dropped link
    totals = decode.kv_transfer.totals()
    assert totals["pulled_count"] == 0 and totals["load_count"] == 1
    assert totals["handoff_source_transfer"] == 1  # chosen as offered: its load fell back
    assert totals["handoff_bytes"] == NUM_BLOCKS * decode.kv_transfer.connector.block_bytes
    assert decode.engine.block_manager.num_reserved_blocks == 0
    assert node.num_leases == 1  # decode cannot reach the node: the lease expires there
    node.release(first.handoff.lease_id)
    assert_all_free(prefill, decode, node)


def test_a_hand_off_over_a_link_measured_slow_is_recomputed(
        network_handoffs, handoff_expected):
    """Decode measured the prefill's node at 100 KB/s and computes a prompt token in a
    nanosecond (stubbed): the hand-off is not read but recomputed, with a colocated engine's
    tokens, and its lease goes back at once."""
    prefill, decode, node = network_handoffs
    first = prefill_prompt(prefill)
    transfer = decode.kv_transfer
    transport = transfer.connector.transport
    transport.links.note(first.handoff.source_address, 1 << 20, 10.0)
    transfer.sources = KVSources(transport.policy, transfer.connector.block_bytes,
                                 lambda: 1e-9)
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert "r" not in decode.admissions.loaded and "r" in decode.engine.scheduler.requests
    assert _finish(prefill, decode, first) == handoff_expected
    totals = transfer.totals()
    assert totals["handoff_source_recompute"] == 1 and totals["load_count"] == 0
    assert totals["handoff_bytes"] == 0
    assert totals[f"link_bytes_per_s:{first.handoff.source_address}"] == \
        pytest.approx((1 << 20) / 10.0)
    assert_all_free(prefill, decode, node)  # (the lease released, not left to expire)


def test_a_follow_over_a_link_measured_slow_is_not_pulled(
        network_handoffs, handoff_expected, monkeypatch):
    """The same link policy before the hand-off: the FollowPrefill is declined (no blocks
    reserved, nothing pulled), and the hand-off that follows is recomputed, counted once."""
    prefill, decode, node = network_handoffs
    transfer = decode.kv_transfer
    transport = transfer.connector.transport
    transport.links.note(node.address, 1 << 20, 10.0)  # 100 KB/s
    transfer.sources = KVSources(transport.policy, transfer.connector.block_bytes,
                                 lambda: 1e-9)
    first = _prefill_followed(prefill, decode, monkeypatch)
    assert _follow(decode) is None and decode.engine.block_manager.num_reserved_blocks == 0
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    assert _finish(prefill, decode, first) == handoff_expected
    totals = transfer.totals()
    assert totals["handoff_source_recompute"] == 1 and totals["handoff_source_transfer"] == 0
    assert totals["pulled_count"] == 0 and totals["load_count"] == 0
    assert_all_free(prefill, decode, node)
