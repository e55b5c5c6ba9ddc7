"""Block manager: exact block ids, ref counts, prefix reuse, LRU eviction, integrity checks."""

from __future__ import annotations

import pytest

from pdserve.kvstore.block_key import KVLayout, block_keys, root_key
from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.engine.block_manager import (
    BlockManager,
    BlockManagerIntegrityError,
    NoFreeBlocksError,
)
from pdserve.serve.engine.request import Request

BLOCK = 4
LAYOUT = KVLayout(dtype="float32", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_dim=16)


def make_manager(num_blocks: int = 8, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BLOCK, "test-model", LAYOUT, prefix_caching)


def make_request(request_id: str, token_ids: list[int], salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(cache_salt=salt), max_tokens=16)


def run_prefill(bm: BlockManager, request: Request) -> int:
    """Allocate the whole prompt, mark it computed and publish its blocks; returns the hit."""
    cached = bm.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.commit_computed(request)
    return cached


def test_allocate_exact_ids_and_free_order() -> None:
    bm = make_manager(prefix_caching=False)
    a, b = make_request("a", range(10)), make_request("b", range(100, 105))
    assert bm.allocate(a, 10) == 0
    assert bm.block_table("a") == [0, 1, 2]
    bm.allocate(b, 5)
    assert bm.block_table("b") == [3, 4]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (3, 5)
    bm.free(a)
    # no run of 5 is free: from where b's run ended, each block after the one before while
    # that one is free, then the next free one (wrapping round)
    b2 = make_request("c", range(200, 220))
    assert not bm.can_allocate(b2, 20 + 20)
    bm.allocate(b2, 20)
    assert bm.block_table("c") == [5, 6, 7, 0, 1]
    bm.check_integrity()
    bm.free(b)
    bm.free(b2)
    bm.free(b2)  # idempotent
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_tables_are_runs_of_neighbours_with_room_to_grow() -> None:
    """Each prompt takes a run of free blocks with room behind it for its max_tokens, so
    sequences that decode side by side keep one run each (the CPU decode attention reads a
    run as one stream); a table that cannot continue in place starts a new run."""
    bm = make_manager(num_blocks=30, prefix_caching=False)
    requests = [make_request(f"r{i}", range(10)) for i in range(4)]  # 3 blocks, then 4 more
    for r in requests:
        bm.allocate(r, 10)
        r.num_computed_tokens = 10
    for _ in range(16):  # decode steps, the four interleaved
        for r in requests:
            bm.append_slots(r, 1)
            r.num_computed_tokens += 1
    tables = [bm.block_table(r.request_id) for r in requests]
    assert all(t == list(range(t[0], t[0] + 7)) for t in tables)
    assert sorted(t[0] for t in tables) == [0, 7, 14, 21]
    late = make_request("late", range(10))
    assert not bm.can_allocate(late, 10)  # 2 blocks are left
    bm.free(requests[1])
    bm.allocate(late, 10)
    assert bm.block_table("late") == [7, 8, 9]  # the freed run, room behind it included
    bm.check_integrity()


def test_evicted_blocks_come_back_in_the_pools_order() -> None:
    """A table freed tail first is cached in reverse (its tail is evicted first); a table
    that evicts those blocks still gets them as a run, ascending, and exactly the least
    recently freed ones."""
    bm = make_manager(num_blocks=6)
    old = make_request("old", range(16))  # 4 full blocks
    run_prefill(bm, old)
    bm.free(old)
    assert list(bm._cached) == [3, 2, 1, 0] and len(bm._free) == 2
    new = make_request("new", range(100, 120))  # 5 blocks: 4 and 5 free, then 3 evicted
    bm.allocate(new, 20)
    assert bm.block_table("new") == [4, 5, 1, 2, 3]  # evicted 3, 2, 1
    assert list(bm._cached) == [0]
    bm.check_integrity()


def test_append_slots_grows_only_at_block_boundaries() -> None:
    bm = make_manager()
    r = make_request("r", range(4))
    bm.allocate(r, 4)
    r.num_computed_tokens = 4
    assert bm.can_append(r, 0) and bm.append_slots(r, 0) == []
    assert bm.append_slots(r, 1) == [1]
    r.num_computed_tokens = 5
    assert bm.append_slots(r, 3) == []  # positions 5..7 fit block 1
    assert bm.append_slots(r, 4) == [2]
    assert bm.block_table("r") == [0, 1, 2]
    assert not bm.can_append(r, 4 * 8)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(r, 4 * 8)
    bm.free(r)
    bm.check_integrity()


def test_prefix_reuse_allocates_only_new_blocks_and_counts_refs() -> None:
    bm = make_manager()
    shared = list(range(8))
    a = make_request("a", shared + [50, 51])
    assert run_prefill(bm, a) == 0
    assert bm.block_table("a") == [0, 1, 2]
    b = make_request("b", shared + [60, 61, 62, 63, 64])
    assert bm.num_cached_tokens(b) == 8
    assert run_prefill(bm, b) == 8
    assert bm.block_table("b") == [0, 1, 3, 4]  # blocks 0, 1 shared; 3, 4 new
    assert [bm._blocks[i].ref_count for i in range(5)] == [2, 2, 1, 1, 1]
    assert bm.num_used_blocks == 5
    bm.check_integrity()
    bm.free(a)
    assert [bm._blocks[i].ref_count for i in range(3)] == [1, 1, 0]
    assert 2 in bm._free  # a's partial tail has no key: plain free
    bm.free(b)
    # b's full blocks are cached, tail first (the tail is evicted first); 4 is partial
    assert list(bm._cached) == [3, 1, 0]
    assert 4 in bm._free and 3 not in bm._free
    bm.check_integrity()


def test_full_prompt_hit_keeps_one_token_to_compute() -> None:
    bm = make_manager()
    a = make_request("a", range(8))
    run_prefill(bm, a)
    bm.free(a)
    again = make_request("a2", range(8))
    # both blocks are cached, but the last token must be computed for logits: one block hit
    assert bm.num_cached_tokens(again) == 4
    assert run_prefill(bm, again) == 4
    assert bm.block_table("a2") == [0, 2]
    bm.free(again)
    bm.check_integrity()


def test_salt_and_model_separate_prefixes() -> None:
    bm = make_manager()
    run_prefill(bm, make_request("a", range(9)))
    assert bm.num_cached_tokens(make_request("b", range(9))) == 8
    assert bm.num_cached_tokens(make_request("c", range(9), salt="tenant")) == 0
    expected = block_keys(list(range(9)), BLOCK, root_key("test-model", LAYOUT))
    assert bm.update_block_keys(make_request("e", range(9))) == expected
    other = BlockManager(8, BLOCK, "other-model", LAYOUT)
    assert other.update_block_keys(make_request("d", range(9)))[0] != expected[0]


def test_eviction_is_exact_lru() -> None:
    bm = make_manager(num_blocks=6)
    # three one-block-plus-one-token prompts: each leaves one full (cached) block after free
    requests = [make_request(f"r{i}", [i * 10 + j for j in range(5)]) for i in range(3)]
    for r in requests:
        run_prefill(bm, r)
    assert [bm.block_table(r.request_id) for r in requests] == [[0, 1], [2, 3], [4, 5]]
    for r in (requests[1], requests[0], requests[2]):  # free order: r1, r0, r2
        bm.free(r)
    assert list(bm._cached) == [2, 0, 4]
    # a hit refreshes r0's block: it leaves the LRU and comes back most recent
    r0_again = make_request("r0b", [0, 1, 2, 3, 99])
    assert run_prefill(bm, r0_again) == 4
    bm.free(r0_again)
    assert list(bm._cached) == [2, 4, 0]
    # the free blocks (1, 3, 5: none follows another, so the next free one each time) go
    # first, then the LRU cached blocks: 2, then 4
    big = make_request("big", range(1000, 1020))  # 5 blocks
    bm.allocate(big, 20)
    assert bm.block_table("big") == [1, 3, 5, 2, 4]
    assert list(bm._cached) == [0]
    assert bm.num_cached_tokens(make_request("x", [10, 11, 12, 13, 14])) == 0  # evicted
    assert bm.num_cached_tokens(make_request("y", [0, 1, 2, 3, 14])) == 4  # still cached
    bm.free(big)
    bm.check_integrity()


def test_can_allocate_accounts_for_hits_on_cached_blocks() -> None:
    bm = make_manager(num_blocks=3)
    a = make_request("a", range(9))
    run_prefill(bm, a)  # blocks 0, 1 full, 2 partial
    bm.free(a)
    assert (len(bm._free), bm.num_cached_blocks) == (1, 2)
    r = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])  # hits 2, needs 2 more
    assert not bm.can_allocate(r, 13)  # only 1 block left once the hits are taken
    r2 = make_request("c", list(range(8)) + [7])  # hits 2, needs 1
    assert bm.can_allocate(r2, 9)
    bm.allocate(r2, 9)
    assert bm.block_table("c") == [0, 1, 2]
    bm.free(r2)
    bm.check_integrity()


def test_claim_specific_blocks_for_prefilled_requests() -> None:
    bm = make_manager()
    r = make_request("d", range(8))
    bm.claim(r, [5, 2])
    assert bm.block_table("d") == [5, 2]
    with pytest.raises(ValueError):
        bm.claim(make_request("e", range(4)), [2])
    r.num_computed_tokens = 8
    bm.commit_computed(r)
    assert bm.num_cached_tokens(make_request("f", range(9))) == 8
    bm.free(r)
    bm.check_integrity()
    assert bm.num_free_blocks == 8


def test_request_blocks_exposes_ids_and_keys_of_computed_full_blocks() -> None:
    bm = make_manager()
    r = make_request("r", range(10))
    bm.allocate(r, 10)
    r.num_computed_tokens = 6
    ids, keys = bm.request_blocks(r)
    assert ids == [0, 1, 2]
    assert keys == block_keys(list(range(10)), BLOCK, root_key("test-model", LAYOUT))[:1]
    bm.free(r)


@pytest.mark.parametrize("corrupt", ["ref", "double_free", "key_map", "lost_block"])
def test_check_integrity_detects_corruption(corrupt: str) -> None:
    bm = make_manager()
    r = make_request("r", range(9))
    run_prefill(bm, r)
    bm.check_integrity()
    if corrupt == "ref":
        bm._blocks[0].ref_count = 2
    elif corrupt == "double_free":  # a used block marked free as well
        bm._free._map[0] = 1
        bm._free._count += 1
    elif corrupt == "key_map":
        bm._key_to_block[b"x" * 16] = 1
    else:  # a free block gone from the map
        bm._free.take_any()
    with pytest.raises(BlockManagerIntegrityError):
        bm.check_integrity()


def test_reserved_blocks_are_held_then_claimed_whole_or_given_back() -> None:
    """Decode follows a prefill (pdserve/serve/worker/follow.py): blocks reserved before the request
    exists count as used, go to the request that claims them as they are, or back on unreserve."""
    bm = make_manager(num_blocks=8)
    ids = bm.reserve("r", 3)
    assert len(set(ids)) == 3 and bm.num_free_blocks == 5 and bm.num_reserved_blocks == 3
    bm.check_integrity()
    with pytest.raises(ValueError, match="already has blocks"):
        bm.reserve("r", 1)
    with pytest.raises(NoFreeBlocksError):
        bm.reserve("s", 6)
    request = make_request("r", list(range(10)))
    with pytest.raises(ValueError, match="reservation as it is"):
        bm.claim(request, ids[:2])
    bm.claim(request, ids)
    assert bm.block_table("r") == ids and bm.num_reserved_blocks == 0
    bm.check_integrity()
    bm.free(request)
    bm.reserve("s", 2)
    bm.unreserve("s")
    bm.unreserve("s")  # idempotent
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check_integrity()
