"""The host tier below the pool (pdserve/serve/engine/kv_tiers.py): a prefix block evicted from the
pool is copied back from host DRAM instead of recomputed, with the tokens of a run that
recomputed it; the cost rule recomputes where loading is slower; nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.serve import LLM, SamplingParams
from pdserve.serve.engine.kv_tiers import HostTier, TierCosts

GREEDY = SamplingParams(temperature=0, max_tokens=8)
BLOCK = 8


def conversation(vocab: int, seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def run_turns(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        outputs.append(llm.generate(prompt, GREEDY)[0].outputs[0].token_ids)
        if llm.engine.kv_offload is not None:
            assert llm.engine.kv_offload.drain()
    return outputs


def turns(vocab: int) -> list[list[int]]:
    """Conversation A, then B and C that push A's blocks out of a 10-block pool, then A
    again with a new turn: its first 48 tokens are in no pool any more."""
    a, b, c = (conversation(vocab, seed, 48) for seed in (1, 2, 3))
    return [a + [5], b + [6], c + [7], a + [9, 10, 11]]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_an_evicted_prefix_comes_back_from_host_dram(llama_dir: Path, kv_cache_dtype) -> None:
    with LLM(llama_dir, block_size=BLOCK, num_kv_blocks=10, enable_prefix_caching=False,
             kv_cache_dtype=kv_cache_dtype) as llm:
        vocab = llm.engine.spec.vocab_size
        expected = run_turns(llm, turns(vocab))
    with LLM(llama_dir, block_size=BLOCK, num_kv_blocks=10, kv_offload_bytes=64 << 20,
             kv_cache_dtype=kv_cache_dtype) as llm:
        prompts = turns(vocab)
        got = run_turns(llm, prompts[:3])
        offload = llm.engine.kv_offload
        assert offload is not None and offload.tier.num_blocks >= 18  # 3 x 6 full blocks
        bm = llm.engine.block_manager
        assert bm.num_cached_tokens(llm.engine.make_request(prompts[3])) == 0  # evicted
        last = llm.generate(prompts[3], GREEDY)[0]
        assert got + [last.outputs[0].token_ids] == expected
        assert last.num_cached_tokens == 48
        assert offload.counters["host"].hit_tokens == 48
        assert offload.counters["host"].read_bytes == 6 * offload.tier.block_nbytes
        assert offload.costs.loads >= 1
        stats = llm.engine.stats()
        assert stats.num_prefix_hit_tokens == 48
        bm.check_integrity()
        offload.tier.check_integrity()
        assert bm.num_used_blocks == 0


def test_the_cost_rule_recomputes_where_the_tier_is_slower(llama_dir: Path) -> None:
    with LLM(llama_dir, block_size=BLOCK, num_kv_blocks=10, kv_offload_bytes=64 << 20) as llm:
        prompts = turns(llm.engine.spec.vocab_size)
        run_turns(llm, prompts[:3])
        costs = llm.engine.kv_offload.costs
        costs.prefill_s_per_token = 1e-6  # a stubbed prefill of a million tokens a second
        costs.read_s_per_byte["host"] = 1e-3  # and a host tier of a kilobyte a second
        last = llm.generate(prompts[3], GREEDY)[0]
        assert last.num_cached_tokens == 0
        assert costs.recomputes >= 1 and llm.engine.kv_offload.counters["host"].hit_tokens == 0


def test_no_prefix_caching_means_no_host_tier(llama_dir: Path) -> None:
    with LLM(llama_dir, block_size=BLOCK, num_kv_blocks=10, kv_offload_bytes=64 << 20,
             enable_prefix_caching=False) as llm:
        assert llm.engine.kv_offload is None
        prompts = turns(llm.engine.spec.vocab_size)
        run_turns(llm, prompts[:3])
        assert llm.generate(prompts[3], GREEDY)[0].num_cached_tokens == 0


def test_a_batch_of_write_downs_copies_each_block_into_its_slot() -> None:
    """Blocks queued together are copied with one gather per layer: each slot holds its own
    block's every layer, whatever the order of the block ids."""
    from pdserve.kvstore.block_key import KVLayout
    from pdserve.serve.engine.block_manager import BlockManager
    from pdserve.serve.engine.kv_tiers import KVOffload
    from pdserve.serve.engine.request import Request

    layout = KVLayout(kind="mha", num_layers=2, num_kv_heads=1, head_dim=4, block_size=4,
                      dtype="float32")
    bm = BlockManager(8, 4, "m", layout)
    torch.manual_seed(0)
    caches = [torch.randn(2, 8, 4, 1, 4) for _ in range(2)]
    offload = KVOffload(caches, bm, num_slots=8)
    bm.on_cached = None  # the test queues the batch itself
    try:
        request = Request("r", list(range(17)), GREEDY, max_tokens=8)
        bm.allocate(request, 17)
        request.num_computed_tokens = 17
        bm.commit_computed(request)
        table = bm.block_table("r")[:4]
        items = [(b, request.block_keys[i], bm.block_epoch(b), None)
                 for i, b in reversed(list(enumerate(table)))]
        offload._write(items)
        for block_id, key, _, _ in items:
            slot = offload.tier.pin([key])[0]
            for layer, cache in enumerate(caches):
                assert torch.equal(offload.tier.data[slot, layer], cache[:, block_id])
        assert offload.counters["host"].written_bytes == 4 * offload.tier.block_nbytes
    finally:
        offload.close()


def test_a_block_evicted_during_its_write_down_is_dropped() -> None:
    """The write-down's epoch check: a copy of a block the engine evicted meanwhile is
    never published."""
    from pdserve.kvstore.block_key import KVLayout
    from pdserve.serve.engine.block_manager import BlockManager
    from pdserve.serve.engine.kv_tiers import KVOffload
    from pdserve.serve.engine.request import Request

    layout = KVLayout(kind="mha", num_layers=2, num_kv_heads=1, head_dim=4, block_size=4,
                      dtype="float32")
    bm = BlockManager(4, 4, "m", layout)
    caches = [torch.zeros(2, 4, 4, 1, 4) for _ in range(2)]
    offload = KVOffload(caches, bm, num_slots=8)
    bm.on_cached = None  # this test calls the write-down itself, at the worst moment
    try:
        request = Request("r", list(range(9)), GREEDY, max_tokens=8)
        bm.allocate(request, 9)
        request.num_computed_tokens = 9
        bm.commit_computed(request)
        epoch = bm.block_epoch(bm.block_table("r")[0])
        key = request.block_keys[0]
        block_id = bm.block_table("r")[0]
        bm.free(request)
        bm.reset_prefix_cache()  # evicts both blocks (their keys go)
        assert bm.block_epoch(block_id) == epoch + 1
        offload._write([(block_id, key, epoch, None)])
        assert key not in offload.tier
        assert offload.counters["host"].writes_dropped >= 1
    finally:
        offload.close()


def test_a_block_evicted_while_it_is_copied_down_is_dropped_after_the_copy() -> None:
    """The post-copy check: the block was still cached when its copy began, and the engine
    evicted (and could reuse) it while the copy ran; the copy may be torn, so it is never
    published and its slot goes back."""
    from pdserve.kvstore.block_key import KVLayout
    from pdserve.serve.engine.block_manager import BlockManager
    from pdserve.serve.engine.kv_tiers import KVOffload
    from pdserve.serve.engine.request import Request

    layout = KVLayout(kind="mha", num_layers=2, num_kv_heads=1, head_dim=4, block_size=4,
                      dtype="float32")
    bm = BlockManager(4, 4, "m", layout)
    caches = [torch.zeros(2, 4, 4, 1, 4) for _ in range(2)]
    offload = KVOffload(caches, bm, num_slots=8)
    bm.on_cached = None
    request = Request("r", list(range(9)), GREEDY, max_tokens=8)

    class EvictsOnRead:
        """A layer's pool bytes that let the engine evict every block at the copy's first
        read: past the pre-copy check, before the publish."""

        def __init__(self, array) -> None:
            self.array = array

        def __getitem__(self, index):
            if bm.block_table("r"):
                bm.free(request)
                bm.reset_prefix_cache()
            return self.array[index]

    try:
        bm.allocate(request, 9)
        request.num_computed_tokens = 9
        bm.commit_computed(request)
        block_id, key = bm.block_table("r")[0], request.block_keys[0]
        epoch = bm.block_epoch(block_id)
        offload._cache_bytes = [EvictsOnRead(a) for a in offload._cache_bytes]
        free_slots = len(offload.tier._free)
        offload._write([(block_id, key, epoch, None)])
        assert bm.block_epoch(block_id) == epoch + 1  # evicted during the copy
        assert key not in offload.tier
        assert offload.counters["host"].writes_dropped == 1
        assert offload.counters["host"].written_bytes == 0
        assert len(offload.tier._free) == free_slots  # its slot came back
        offload.tier.check_integrity()
    finally:
        offload.close()


def test_host_tier_lru_pins_and_integrity() -> None:
    tier = HostTier(2, (1, 2, 4), torch.float32)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    for key in (a, b):
        slot, evicted = tier.take_slot()
        assert evicted is None
        tier.publish(key, slot)
    assert tier.pin([a]) == [tier._slots[a]]  # a is now the most recent and pinned
    slot, evicted = tier.take_slot()
    assert evicted == b  # the least recently used unpinned one goes
    tier.publish(c, slot)
    assert tier.take_slot()[1] == c  # a is pinned: c goes next
    tier.give_back(tier._free[-1] if tier._free else slot)
    tier.unpin([tier._slots[a]])
    assert tier.count_prefix([a, b]) == 1
    with pytest.raises(ValueError):
        HostTier(0, (1,), torch.float32)


def test_cost_rule_prefers_loading_until_measured_then_weighs() -> None:
    costs = TierCosts()
    assert costs.worth_loading("store", 16, 1 << 30)  # nothing measured: load
    costs.note_prefill(1000, 1.0)  # 1 ms a token
    costs.note_read("store", 1 << 20, 1.0)  # 1 MiB/s
    assert not costs.worth_loading("store", 16, 1 << 20)  # 1 s to read, 16 ms to compute
    assert costs.worth_loading("host", 16, 1 << 10)
    assert costs.as_status()["recomputes_chosen"] == 1.0
