"""Scheduler: token budget, decodes first, chunked prefill, preemption and resume, abort.

No model runs here: a step is simulated by marking the scheduled tokens computed and
appending a fixed token to every request that reached its last token.
"""

from __future__ import annotations

import pytest

from pdserve.kvstore.block_key import KVLayout
from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import SchedulerConfig
from pdserve.serve.engine.block_manager import BlockManager
from pdserve.serve.engine.request import Request, RequestStatus
from pdserve.serve.engine.scheduler import RequestRejectedError, Scheduler

BLOCK = 4
SAMPLED = 7


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, prefix_caching: bool = False,
                   max_model_len: int = 256, chunked: bool = True,
                   max_prefills_per_step: int = 0) -> Scheduler:
    layout = KVLayout("float32", BLOCK, num_layers=1, num_kv_heads=1, head_dim=8)
    bm = BlockManager(num_blocks, BLOCK, "m", layout, prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=chunked,
                             max_prefills_per_step=max_prefills_per_step)
    return Scheduler(config, bm, max_model_len)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8,
                 first_token: int = 100) -> Request:
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(scheduler: Scheduler) -> list[tuple[str, int, int, bool]]:
    """One simulated step: [(request id, num tokens, start_pos, need_logits)] in chunk order;
    requests that reached max_tokens are finished."""
    out = scheduler.schedule()
    assert out.step.num_tokens <= scheduler.config.max_num_batched_tokens
    for chunk in out.step.chunks:
        positions = chunk.start_pos + len(chunk.token_ids)
        assert len(chunk.block_table) * BLOCK >= positions
    scheduler.update_after_step(out)
    for chunk, (request, _) in zip(out.step.chunks, out.scheduled, strict=True):
        if chunk.need_logits:
            request.append_output_token(SAMPLED)
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    scheduler.block_manager.check_integrity()
    return [(c.request_id, len(c.token_ids), c.start_pos, c.need_logits)
            for c in out.step.chunks]


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", 30))
    s.add_request(make_request("b", 10))
    assert run_step(s) == [("a", 16, 0, False)]
    assert run_step(s) == [("a", 14, 16, True), ("b", 2, 0, False)]
    # a decodes first, then b's prefill continues in what is left
    assert run_step(s) == [("a", 1, 30, True), ("b", 8, 2, True)]
    assert run_step(s) == [("a", 1, 31, True), ("b", 1, 10, True)]


def test_decodes_first_then_partial_prefills_then_waiting() -> None:
    s = make_scheduler(max_num_batched_tokens=12)
    s.add_request(make_request("long", 20))
    assert run_step(s) == [("long", 12, 0, False)]
    s.add_request(make_request("short", 3))
    assert run_step(s) == [("long", 8, 12, True), ("short", 3, 0, True)]
    s.add_request(make_request("big", 40))
    s.add_request(make_request("next", 5))
    # decodes of both, then the head of the queue gets the rest; "next" must wait its turn
    assert run_step(s) == [("long", 1, 20, True), ("short", 1, 3, True), ("big", 10, 0, False)]
    assert run_step(s) == [("long", 1, 21, True), ("short", 1, 4, True), ("big", 10, 10, False)]


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2)
    for name in "abc":
        s.add_request(make_request(name, 4, max_tokens=2))
    assert [c[0] for c in run_step(s)] == ["a", "b"]
    assert [c[0] for c in run_step(s)] == ["a", "b"]  # both finish (max_tokens 2)
    assert run_step(s) == [("c", 4, 0, True)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=10, chunked=False)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 5))
    assert run_step(s) == [("a", 8, 0, True)]
    assert run_step(s) == [("a", 1, 8, True), ("b", 5, 0, True)]
    with pytest.raises(RequestRejectedError):
        s.add_request(make_request("too-long", 11))


def test_preemption_frees_most_recent_and_resumes_in_arrival_order() -> None:
    s = make_scheduler(num_blocks=4, max_num_seqs=4)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 4, max_tokens=4, first_token=10 * i))
    assert [c[0] for c in run_step(s)] == ["r0", "r1", "r2", "r3"]  # one block each
    out = s.schedule()
    # r0 and r1 each need a second block and none is free: r3 goes, then r2
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    r2 = s.requests["r2"]
    assert (r2.status, r2.num_computed_tokens, r2.num_preemptions) == \
        (RequestStatus.PREEMPTED, 0, 1)
    assert not s.block_manager.has_blocks("r2")
    # the prompts took 0 and 2 (each with a block free behind it), then 1 and 3; each
    # second block is the one the preemption freed
    assert s.block_manager.block_table("r0") == [0, 3]
    assert s.block_manager.block_table("r1") == [2, 1]
    s.update_after_step(out)
    for request, _ in out.scheduled:
        request.append_output_token(SAMPLED)
    s.block_manager.check_integrity()
    steps = [run_step(s) for _ in range(2)]  # r0 and r1 finish (4 tokens each)
    assert [c[0] for c in steps[-1]] == ["r0", "r1"]
    # r2 resumes first, recomputing its prompt and its one sampled token
    assert run_step(s) == [("r2", 5, 0, True), ("r3", 5, 0, True)]
    while s.has_unfinished_requests():
        run_step(s)
    assert s.block_manager.num_free_blocks == 4


def test_cached_prefix_counts_as_computed() -> None:
    s = make_scheduler(prefix_caching=True)
    s.add_request(make_request("a", 9, max_tokens=1))
    assert run_step(s) == [("a", 9, 0, True)]
    s.add_request(make_request("b", 9, max_tokens=1))
    assert run_step(s) == [("b", 1, 8, True)]  # two full blocks cached, one token left
    assert s.requests == {}
    s.add_request(make_request("c", 8, max_tokens=2))
    assert run_step(s) == [("c", 4, 4, True)]  # a full hit still computes the last block
    s.block_manager.check_integrity()


def test_abort_in_every_state_frees_everything() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=8)
    s.add_request(make_request("running", 6))
    s.add_request(make_request("partial", 6))
    s.add_request(make_request("waiting", 6))
    run_step(s)
    assert s.requests["partial"].num_computed_tokens == 2  # admitted with 2 tokens
    assert s.block_manager.num_used_blocks == 3
    for request_id in ("waiting", "partial", "running"):
        request = s.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        assert request is not None and request.status is RequestStatus.FINISHED_ABORTED
        s.block_manager.check_integrity()
    assert s.finish_request("running", RequestStatus.FINISHED_ABORTED) is None
    assert not s.has_unfinished_requests() and not s.running and not s.waiting
    assert s.block_manager.num_free_blocks == 4
    assert s.schedule().is_empty


def test_rejects_requests_that_can_never_run() -> None:
    s = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        s.add_request(make_request("long", 32))
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        s.add_request(make_request("big", 10, max_tokens=8))  # 17 positions > 16 slots
    s.add_request(make_request("ok", 9, max_tokens=8))  # 16 positions fit exactly
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", 3))


def test_add_running_request_decodes_from_given_blocks() -> None:
    s = make_scheduler(num_blocks=8)
    request = make_request("d", 6)
    request.append_output_token(42)
    request.num_computed_tokens = 6
    assert s.add_running_request(request, [5, 6]) == [5, 6]
    assert run_step(s) == [("d", 1, 6, True)]
    out = s.schedule()
    assert out.step.chunks[0].block_table == [5, 6]
    assert out.step.chunks[0].token_ids == [SAMPLED]
    s.finish_request("d", RequestStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 8
    s.block_manager.check_integrity()


def test_prefilled_requests_past_max_num_seqs_wait_for_a_seat_with_their_kv() -> None:
    """A hand-off arriving at a full batch keeps its blocks (its KV is written there) but
    does not decode until a seat frees; it seats ahead of the waiting queue, and an abort
    while it waits frees its blocks."""
    s = make_scheduler(num_blocks=16, max_num_seqs=2)
    for name in "abcde":
        request = make_request(name, 6, max_tokens=2)
        request.append_output_token(42)
        request.num_computed_tokens = 6
        s.add_running_request(request, None)
    s.add_request(make_request("w", 3, max_tokens=2))
    assert [r.request_id for r in s.parked] == ["c", "d", "e"]
    assert s.requests["c"].status is RequestStatus.WAITING
    assert s.block_manager.num_free_blocks == 16 - 5 * 2  # every hand-off holds its KV
    s.finish_request("e", RequestStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 16 - 4 * 2
    assert run_step(s) == [("a", 1, 6, True), ("b", 1, 6, True)]  # both reach max_tokens
    assert run_step(s) == [("c", 1, 6, True), ("d", 1, 6, True)]  # before "w", queued
    assert run_step(s) == [("w", 3, 0, True)]
    assert not s.parked
    s.block_manager.check_integrity()


def test_one_prefill_per_step_serves_prompts_in_arrival_order() -> None:
    """max_prefills_per_step=1: each step prefills one prompt (the oldest first, a chunked
    one until it is done), while every decode keeps its token each step."""
    s = make_scheduler(max_num_batched_tokens=16, max_prefills_per_step=1)
    s.add_request(make_request("a", 6, max_tokens=3))
    s.add_request(make_request("b", 20, max_tokens=2))
    s.add_request(make_request("c", 5, max_tokens=2))
    assert run_step(s) == [("a", 6, 0, True)]
    assert run_step(s) == [("a", 1, 6, True), ("b", 15, 0, False)]
    assert run_step(s) == [("a", 1, 7, True), ("b", 5, 15, True)]
    assert run_step(s) == [("b", 1, 20, True), ("c", 5, 0, True)]
    # without the cap, the first step takes all three prompts the budget holds
    s = make_scheduler(max_num_batched_tokens=16)
    for r in (make_request("a", 6), make_request("b", 20), make_request("c", 5)):
        s.add_request(r)
    assert run_step(s) == [("a", 6, 0, True), ("b", 10, 0, False)]
    with pytest.raises(ValueError, match="max_prefills_per_step"):
        SchedulerConfig(max_prefills_per_step=-1)
