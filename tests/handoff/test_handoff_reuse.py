"""Decode-side prefix reuse (KVTransfer.hold_prefix): on a multi-turn conversation, where
each turn's prompt extends the last, a decode worker that still holds the earlier turn's
blocks (its pool, or its host tier) takes only the blocks it lacks from the prefill. Over
each hand-off path (the network load, the in-place copy out of the prefill's segment, the
layer-by-layer follow out of the segment, and pulled from the prefill's node across hosts):
the tokens are a colocated engine's, `handoff_bytes` counts exactly the blocks decode lacked
and `handoff_reused_bytes` the rest, and everything ends free."""

from __future__ import annotations

import pytest
from helpers.engine_util import run_to_completion, token_ids
from helpers.handoff_util import (
    BLOCK,
    GREEDY,
    assert_all_free,
    drive,
    handoff_pair,
    make_engine,
)

from pdserve.kvstore.connector import block_nbytes
from pdserve.protocol.worker import FollowPrefill, GenerateRequest, Output

TURN_1 = list(range(3, 28))  # 25 tokens: 3 full blocks and a partial one
TURN_2 = TURN_1 + list(range(40, 55))  # 40 tokens: 5 full blocks


def expected(llama_dir) -> list[list[int]]:
    engine = make_engine(llama_dir)
    try:
        for i, prompt in enumerate((TURN_1, TURN_2)):
            engine.add_request(prompt, GREEDY, f"t{i}")
        outputs = run_to_completion(engine)
        return [token_ids(outputs[f"t{i}"]) for i in range(2)]
    finally:
        engine.shutdown()


def turn(prefill, decode, request_id: str, prompt: list[int], follow: bool) -> list[int]:
    announced: list[Output] = []
    if follow:
        def send(output: Output) -> None:
            announced.append(output)
            decode.follow(FollowPrefill(output.request_id, len(prompt), output.staging))

        prefill.announcer.send = send
    prefill.add(GenerateRequest(request_id, prompt, GREEDY))
    [first] = [o for o in drive([prefill, decode], lambda outs: any(
        o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
    if follow:
        assert announced and announced[0].staging.block_keys  # the keys went with it
    decode.add(GenerateRequest(request_id, prompt, GREEDY, handoff=first.handoff))
    outputs = drive([prefill, decode], lambda outs: any(
        o.request_id == request_id and o.finish_reason not in (None, "handoff") for o in outs)
        and not decode.is_busy and not prefill.is_busy)
    assert all(o.error is None for o in outputs)
    return first.token_ids + [t for o in outputs if o.request_id == request_id
                              for t in o.token_ids]


@pytest.mark.parametrize("path", ["network", "in-place", "follow", "pull"])
def test_decode_moves_only_the_blocks_it_lacks(llama_dir, path):
    shm = path in ("in-place", "follow")
    follow = path in ("follow", "pull")
    want = expected(llama_dir)
    with handoff_pair(llama_dir, 8 << 20 if shm else 0, shm=shm, follow=follow) as (
            prefill, decode, node):
        block_bytes = block_nbytes(decode.engine.spec.kv_layout(BLOCK))
        totals = decode.kv_transfer.totals
        assert turn(prefill, decode, "t0", TURN_1, follow) == want[0]
        assert totals()["handoff_bytes"] == 4 * block_bytes  # nothing held: all of it
        assert totals()["handoff_reused_bytes"] == 0
        # turn 2: decode holds turn 1's three full blocks (cached in its pool)
        assert turn(prefill, decode, "t1", TURN_2, follow) == want[1]
        assert totals()["handoff_reused_bytes"] == 3 * block_bytes
        assert totals()["handoff_bytes"] == (4 + 2) * block_bytes  # blocks 3 and 4 of turn 2
        if follow:
            assert totals()["followed_count"] == 2
            assert totals()["pulled_count"] == (2 if path == "pull" else 0)
        assert_all_free(prefill, decode, node)
