"""pdserve's vLLM KV connector: its pure parts (config, keys, plans, views, the worker's
loads and saves) against a real in-process store; and, when vLLM's CPU build is present, the
views against vLLM's own CPU kernel and a vLLM producer -> pdserve store -> vLLM consumer run
(with pdserve's own engine computing the very blocks vLLM stored)."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.vllm_peer_util import pdserve_overlay, run_vllm, run_vllm_code, vllm_python

from pdserve import security
from pdserve.integrations.vllm_connector import (
    PdserveConnectorConfig,
    model_identity,
    scheduled_requests,
)
from pdserve.integrations.vllm_scheduler import (
    BlockTransfer,
    PdserveScheduler,
    ScheduledRequest,
    StepPlan,
    leading_blocks_on,
)
from pdserve.integrations.vllm_worker import (
    PdserveWorker,
    PlanesAsPool,
    cpu_attn_planes,
    layer_index,
)
from pdserve.kvstore.block_key import KVLayout, block_keys, root_key
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.connector import block_nbytes
from pdserve.kvstore.master import PrefixLookup
from pdserve.kvstore.server import StoreServer

# vLLM's CPU attention: blocks of a multiple of 32 tokens, head_dim 64 or 128
LAYOUT = KVLayout(dtype="float32", block_size=32, num_layers=2, num_kv_heads=2, head_dim=64)
MODEL_ID = "tiny-llama"
NUM_POOL_BLOCKS = 12
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]

VLLM_PYTHON = vllm_python()
needs_vllm = pytest.mark.skipif(VLLM_PYTHON is None, reason=(
    "vLLM's CPU build is not installed (/tmp/vllm-peer/bin/python, or set "
    "PDSERVE_VLLM_PYTHON): checks against vLLM itself need it"))


@pytest.fixture
def store():
    server = StoreServer(StoreConfig(master_port=0, data_port=0, transport="zmq",
                                     request_timeout_s=5.0)).start()
    yield server
    server.stop()


def client_of(server: StoreServer, timeout_s: float = 5.0) -> StoreClient:
    return StoreClient(server.data_address, server.master_address, transport="zmq",
                       timeout_s=timeout_s)


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_tokens)]


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """The keys pdserve's own workers give these tokens (pdserve/serve/engine/block_manager.py's
    chain)."""
    return block_keys(tokens, LAYOUT.block_size, root_key(MODEL_ID, LAYOUT, salt))


def cpu_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM CPU_ATTN caches, one per layer: [num_blocks, H, B, 2*D] (zeros without a seed),
    named in reverse so the worker must order them by layer number."""
    shape = (NUM_POOL_BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_size, 2 * LAYOUT.head_dim)
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return {name: (torch.zeros(shape) if g is None else torch.randn(shape, generator=g))
            for name in reversed(LAYER_NAMES)}


def key_value(caches: dict[str, torch.Tensor], layer: int, block_id: int) -> torch.Tensor:
    """[2, B, H, D]: block `block_id`'s K and V of one layer, read as vLLM's kernels do."""
    planes = cpu_attn_planes(caches[LAYER_NAMES[layer]], LAYOUT, LAYOUT.num_kv_heads)
    return torch.stack([plane[block_id] for plane in planes])


def block_of(caches: dict[str, torch.Tensor], layer: int, block_id: int) -> torch.Tensor:
    return caches[LAYER_NAMES[layer]][block_id]


def make_scheduler(server: StoreServer, can_load: bool = True, can_save: bool = True,
                   lease_ttl_s: float = 30.0) -> PdserveScheduler:
    return PdserveScheduler(LAYOUT, MODEL_ID, client_of(server), can_load, can_save,
                            lease_ttl_s, data_address=server.data_address)


def make_worker(server: StoreServer, caches: dict[str, torch.Tensor]) -> PdserveWorker:
    worker = PdserveWorker(LAYOUT, client_of(server), timeout_s=5.0)
    worker.register(caches, cpu_attn_planes)
    return worker


def run_step(worker: PdserveWorker, plan: StepPlan) -> set[int]:
    """One vLLM step on the worker side: loads, the forward's per-layer waits and saves."""
    worker.start_loads(plan)
    for name in LAYER_NAMES:
        worker.wait_for_layer(name)
        worker.save_layer(name, plan)
    worker.finish_step()
    return worker.take_invalid_block_ids()


def put_blocks(server: StoreServer, keys: list[bytes]) -> None:
    client = client_of(server)
    blocks = [torch.full((block_nbytes(LAYOUT),), i, dtype=torch.uint8)
              for i in range(len(keys))]
    assert client.put_many(keys, blocks) == [True] * len(keys)
    client.close()


def assert_store_clean(server: StoreServer) -> None:
    server.check_integrity()
    assert server.store.num_pinned_blocks == 0
    assert server.leases.num_leases == 0


# ---- pure parts -----------------------------------------------------------------------------


def test_module_imports_without_vllm():
    code = ("import sys, pdserve.integrations.vllm_connector as m; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(m.StepPlan())\n"
            "try:\n    m.PdserveConnector\nexcept ImportError:\n    print('no vllm')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "StepPlan(loads=[], saves=[])" in done.stdout
    # without vLLM, only asking for the connector class fails (with vLLM's ImportError)
    assert ("no vllm" in done.stdout) == (importlib.util.find_spec("vllm") is None)


def test_config_from_extra_config_validates():
    config = PdserveConnectorConfig.from_extra_config(
        {"store": "tcp://127.0.0.1:7601", "store_master": "tcp://127.0.0.1:7600",
         "timeout_s": "2", "insecure_plaintext": "true"})
    assert (config.timeout_s, config.insecure_plaintext, config.transport) == (2.0, True, "zmq")
    with pytest.raises(ValueError, match="needs 'store'"):
        PdserveConnectorConfig.from_extra_config({"store_master": "tcp://127.0.0.1:7600"})
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        PdserveConnectorConfig.from_extra_config({"store": "tcp://h:1", "stor_master": "x"})
    with pytest.raises(ValueError, match="tcp://host:port"):
        PdserveConnectorConfig.from_extra_config({"store": "127.0.0.1:7601"})
    with pytest.raises(ValueError, match="boolean"):
        PdserveConnectorConfig.from_extra_config({"store": "tcp://h:1",
                                                  "insecure_plaintext": "maybe"})


def test_cluster_key_comes_from_config_or_env_and_plaintext_only_when_asked(
        tmp_path, monkeypatch):
    monkeypatch.delenv(security.KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(security.PLAINTEXT_ENV, raising=False)
    key = security.ClusterKey.generate()
    path = key.save(tmp_path / "cluster.key")
    assert PdserveConnectorConfig("tcp://h:1", cluster_key_file=str(path)).cluster_key() == key
    with pytest.raises(security.ClusterKeyError, match="no cluster key"):
        PdserveConnectorConfig("tcp://h:1").cluster_key()
    assert PdserveConnectorConfig("tcp://h:1", insecure_plaintext=True).cluster_key() is None
    monkeypatch.setenv(security.KEY_FILE_ENV, str(path))
    assert PdserveConnectorConfig("tcp://h:1").cluster_key() == key
    monkeypatch.delenv(security.KEY_FILE_ENV)
    monkeypatch.setenv(security.PLAINTEXT_ENV, "1")
    assert PdserveConnectorConfig("tcp://h:1").cluster_key() is None


def test_model_identity_and_key_root_match_pdserve_workers():
    assert model_identity("/models/tiny-llama", "/models/tiny-llama") == "tiny-llama"
    assert model_identity("/models/tiny-llama", ["chat"]) == "chat"
    scheduler = PdserveScheduler(LAYOUT, MODEL_ID, None, can_load=True, can_save=True)
    assert scheduler.root(None) == root_key(MODEL_ID, LAYOUT)
    assert scheduler.root("tenant") == root_key(MODEL_ID, LAYOUT, "tenant")
    # a different model, dtype or block size never matches
    other_roots = {root_key("other", LAYOUT),
                   root_key(MODEL_ID, KVLayout("bfloat16", 32, 2, 2, 64)),
                   root_key(MODEL_ID, KVLayout("float32", 64, 2, 2, 64))}
    assert scheduler.root(None) not in other_roots and len(other_roots) == 3


def test_layer_index_and_leading_blocks_on_a_node():
    assert layer_index("model.layers.11.self_attn.attn") == 11
    with pytest.raises(ValueError):
        layer_index("lm_head")
    found = PrefixLookup(3, [[("a", "dram")], [("a", "disk"), ("b", "dram")], [("b", "dram")]])
    assert leading_blocks_on(found, "a") == 2
    assert leading_blocks_on(found, "b") == 0
    assert leading_blocks_on(found, None) == 3
    assert leading_blocks_on(PrefixLookup(2, []), "a") == 2


def vllm_cpu_cache(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A CPU_ATTN cache [num_blocks, H, B, 2*D] as vLLM's "vec" kernels write it, from K and V
    [num_blocks, B, H, D]: per (block, head), K^T [D, B] then V [B, D] (checked against
    vLLM's own kernel in test_cpu_attn_planes_match_vllm_kernels)."""
    num_blocks, block_size, heads, head_dim = keys.shape
    k_part = keys.permute(0, 2, 3, 1).reshape(num_blocks, heads, head_dim * block_size)
    v_part = values.permute(0, 2, 1, 3).reshape(num_blocks, heads, block_size * head_dim)
    both = torch.stack([k_part, v_part], dim=2)  # [num_blocks, H, 2, B*D]
    return both.reshape(num_blocks, heads, block_size, 2 * head_dim)


def test_cpu_attn_planes_are_pdserve_pool_layout_without_copy():
    g = torch.Generator().manual_seed(0)
    shape = (NUM_POOL_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    cache = vllm_cpu_cache(keys, values)
    planes = cpu_attn_planes(cache, LAYOUT, LAYOUT.num_kv_heads)
    assert torch.equal(planes[0], keys) and torch.equal(planes[1], values)
    assert all(p.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
               for p in planes)
    pool = PlanesAsPool(planes)
    blocks = torch.full((2, 1, *shape[1:]), 7.0)
    pool.index_copy_(1, torch.tensor([3]), blocks)  # writes land in vLLM's tensor
    assert torch.equal(cache[3], torch.full(cache.shape[1:], 7.0))
    assert torch.equal(pool.index_select(1, torch.tensor([3, 0]))[:, 1], torch.stack(
        [keys[0], values[0]]))
    with pytest.raises(ValueError, match="not"):
        cpu_attn_planes(cache, LAYOUT, num_kv_heads=1)


VLLM_KERNEL_CHECK = """
import torch
import vllm._custom_ops as ops
from pdserve.integrations.vllm_worker import POOL_VIEWS
from pdserve.kvstore.block_key import KVLayout
B, H, D, NUM_BLOCKS = 32, 2, 64, 4
layout = KVLayout("float32", B, 1, H, D)
for isa in ("vec", "vec16"):
    key, value = torch.randn(2 * B, H, D), torch.randn(2 * B, H, D)  # [tokens, H, D]
    cache = torch.zeros(NUM_BLOCKS, H, B, 2 * D)
    key_cache, value_cache = cache.view(NUM_BLOCKS, H, 2 * B, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                   torch.arange(2 * B) + B, isa)  # tokens into blocks 1, 2
    keys, values = POOL_VIEWS[("CPU_ATTN", isa)](cache, layout, H)
    assert torch.equal(keys[1:3].reshape(2 * B, H, D), key), isa
    assert torch.equal(values[1:3].reshape(2 * B, H, D), value), isa
    assert keys[0].abs().sum() == 0 and values[3].abs().sum() == 0, isa
print("planes match")
"""


@needs_vllm
def test_cpu_attn_planes_match_vllm_kernels(tmp_path):
    """What vLLM's own CPU kernel writes for token t of block b is what the planes read."""
    done = run_vllm_code(VLLM_PYTHON, pdserve_overlay(tmp_path / "overlay"), VLLM_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planes match" in done.stdout


# ---- scheduler side over a real store ----------------------------------------------------------


def test_matched_tokens_are_the_stored_prefix_past_the_local_hit(store):
    tokens = prompt(3 * 32 + 5)
    keys = chain(tokens)
    put_blocks(store, keys[:2])
    scheduler = make_scheduler(store)
    assert scheduler.num_new_matched_tokens("r", tokens, len(tokens), 0) == 64
    assert scheduler.num_new_matched_tokens("r", tokens, len(tokens), 32) == 32
    assert scheduler.num_new_matched_tokens("r", tokens, len(tokens), 64) == 0
    # another tenant's salt, or a consumer-less role, gets nothing
    assert scheduler.num_new_matched_tokens("s", tokens, len(tokens), 0, "tenant") == 0
    producer = make_scheduler(store, can_load=False)
    assert producer.num_new_matched_tokens("r", tokens, len(tokens), 0) == 0
    # the last token is always computed: a fully stored 3-block prompt loads 2 blocks
    exact = prompt(3 * 32, seed=1)
    put_blocks(store, chain(exact))
    assert scheduler.num_new_matched_tokens("e", exact, len(exact), 0) == 64
    for s in (scheduler, producer):
        s.close()
    assert_store_clean(store)


def test_load_plan_pins_the_hit_and_save_plan_follows_chunked_prefill(store):
    tokens = prompt(4 * 32 + 7)
    keys = chain(tokens)
    put_blocks(store, keys[:3])
    scheduler = make_scheduler(store)
    # vLLM's own cache has block 0; the store supplies blocks 1 and 2
    assert scheduler.num_new_matched_tokens("r", tokens, len(tokens), 32) == 64
    block_ids = [7, 3, 9, 4, 11]
    scheduler.update_after_alloc("r", block_ids, 64)
    assert store.store.num_pinned_blocks == 2
    # step 1: prefill tokens 96..127 (chunked), step 2: the rest
    plan = scheduler.build_plan([ScheduledRequest("r", 96, 32, block_ids, True)])
    (load,) = plan.loads
    assert (load.keys, load.block_ids) == (keys[1:3], [3, 9])
    assert load.lease_id is not None
    (save,) = plan.saves  # blocks 0-2 are in the store already: block 3 is new
    assert (save.keys, save.block_ids) == (keys[3:4], [4])
    plan = scheduler.build_plan([ScheduledRequest("r", 128, 7, [], False)])
    assert plan == StepPlan()  # the partial last block is never saved
    plan = scheduler.build_plan([ScheduledRequest("r", 135, 1, [], False)])
    assert plan == StepPlan()  # generated tokens are not saved
    scheduler.request_finished("r")
    assert scheduler.num_requests == 0
    client = client_of(store)
    assert client.release(load.lease_id)  # what the worker does once it read the blocks
    client.close()
    scheduler.close()
    assert_store_clean(store)


def test_consumer_only_saves_nothing_and_finish_drops_a_pending_load(store):
    tokens = prompt(2 * 32 + 1)
    put_blocks(store, chain(tokens))
    consumer = make_scheduler(store, can_save=False)
    assert consumer.num_new_matched_tokens("r", tokens, len(tokens), 0) == 64
    consumer.update_after_alloc("r", [0, 1, 2], 64)
    consumer.request_finished("r")  # aborted before it ran: its load and lease go
    assert consumer.build_plan([ScheduledRequest("r", 64, 1, [0, 1, 2], True)]) == StepPlan()
    consumer.close()
    assert_store_clean(store)


# ---- worker side: vLLM's CPU caches <-> the store ------------------------------------------------


def test_producer_saves_and_consumer_loads_into_other_blocks(store):
    tokens = prompt(3 * 32 + 3)
    keys = chain(tokens)
    producer_caches = cpu_caches(seed=1)
    producer = make_worker(store, producer_caches)
    save = StepPlan(saves=[BlockTransfer("p", keys, [5, 0, 8])])
    assert run_step(producer, save) == set()
    assert producer.drain(10)
    assert producer.num_saved_blocks == 3
    # stored as pdserve's block: [num_layers, 2 (K, V), B, H, D], K untransposed
    reader = client_of(store)
    (stored,) = reader.get_many(keys[:1])
    reader.close()
    block = torch.from_numpy(stored).view(torch.float32).view(LAYOUT.block_shape())
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(block[layer], key_value(producer_caches, layer, 5))

    # the consumer's scheduler finds them at the master and plans the load
    scheduler = make_scheduler(store, can_save=False)
    assert scheduler.num_new_matched_tokens("c", tokens, len(tokens), 0) == 96
    scheduler.update_after_alloc("c", [2, 10, 6, 1], 96)
    plan = scheduler.build_plan([ScheduledRequest("c", 96, 3, [2, 10, 6, 1], True)])
    consumer_caches = cpu_caches(seed=None)
    consumer = make_worker(store, consumer_caches)
    assert run_step(consumer, plan) == set()
    assert consumer.num_loaded_blocks == 3
    for layer in range(LAYOUT.num_layers):
        for src, dst in ((5, 2), (0, 10), (8, 6)):
            assert torch.equal(block_of(consumer_caches, layer, dst),
                               block_of(producer_caches, layer, src))
        for untouched in (0, 1, 3, 4, 5, 7, 8, 9, 11):
            assert block_of(consumer_caches, layer, untouched).abs().sum() == 0
    assert consumer.drain(10)  # the lease release
    for closing in (producer, consumer, scheduler):
        closing.close()
    assert_store_clean(store)


def test_a_block_that_does_not_load_is_reported_for_recompute(store):
    tokens = prompt(3 * 32)
    keys = chain(tokens)
    producer_caches = cpu_caches(seed=2)
    producer = make_worker(store, producer_caches)
    run_step(producer, StepPlan(saves=[BlockTransfer("p", keys[:1], [4])]))
    assert producer.drain(10)
    consumer_caches = cpu_caches(seed=None)
    consumer = make_worker(store, consumer_caches)
    # block 1 was evicted after the lookup: block 0 loads, blocks 1 and 2 are invalid
    invalid = run_step(consumer, StepPlan(loads=[BlockTransfer("c", keys, [3, 7, 9])]))
    assert invalid == {7, 9}
    assert (consumer.num_loaded_blocks, consumer.num_failed_blocks) == (1, 2)
    assert torch.equal(block_of(consumer_caches, 1, 3), block_of(producer_caches, 1, 4))
    assert consumer.take_invalid_block_ids() == set()  # reported once
    for closing in (producer, consumer):
        closing.close()
    assert_store_clean(store)


def test_store_down_means_a_miss_and_failed_loads_not_a_crash(store):
    tokens = prompt(2 * 32 + 1)
    scheduler = PdserveScheduler(LAYOUT, MODEL_ID, client_of(store, timeout_s=0.3),
                                 can_load=True, can_save=True)
    worker = PdserveWorker(LAYOUT, client_of(store, timeout_s=0.3), timeout_s=0.3)
    worker.register(cpu_caches(seed=None), cpu_attn_planes)
    store.stop()
    assert scheduler.num_new_matched_tokens("r", tokens, len(tokens), 0) == 0
    invalid = run_step(worker, StepPlan(loads=[BlockTransfer("r", chain(tokens), [1, 2])]))
    assert invalid == {1, 2}
    worker.close()
    scheduler.close()


def test_a_save_missing_a_layer_is_dropped_and_the_next_one_stores(store):
    keys = chain(prompt(32))
    worker = make_worker(store, cpu_caches(seed=3))
    plan = StepPlan(saves=[BlockTransfer("r", keys, [2])])
    worker.save_layer(LAYER_NAMES[0], plan)  # the step ends before layer 1 was saved
    worker.finish_step()
    assert worker.drain(10) and worker.num_saved_blocks == 0
    assert run_step(worker, plan) == set()  # a later step saves it whole
    assert worker.drain(10) and worker.num_saved_blocks == 1
    reader = client_of(store)
    assert reader.lookup_prefix(keys).num_blocks == 1
    reader.close()
    worker.close()
    assert_store_clean(store)


def test_a_load_that_cannot_start_is_reported_whole(store):
    worker = PdserveWorker(LAYOUT, client_of(store))  # no caches registered: nowhere to load
    plan = StepPlan(loads=[BlockTransfer("r", chain(prompt(2 * 32)), [4, 5])])
    assert run_step(worker, plan) == {4, 5}
    assert worker.num_failed_blocks == 2
    worker.close()


def test_scheduler_output_becomes_scheduled_requests():
    """vLLM's SchedulerOutput fields the plan reads (group 0 of each block list)."""
    new = SimpleNamespace(req_id="a", num_computed_tokens=64, block_ids=([3, 1, 2],))
    cached = SimpleNamespace(req_ids=["b", "c"], resumed_req_ids={"c"},
                             new_block_ids=[None, ([5, 6],)], num_computed_tokens=[90, 0])
    output = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                             num_scheduled_tokens={"a": 30, "b": 1, "c": 70})
    assert scheduled_requests(output) == [
        ScheduledRequest("a", 64, 30, [3, 1, 2], True),
        ScheduledRequest("b", 90, 1, [], False),
        ScheduledRequest("c", 0, 70, [5, 6], True)]


def test_secured_store_needs_the_cluster_key(tmp_path):
    key = security.ClusterKey.generate()
    key_path = key.save(tmp_path / "cluster.key")
    with security.using(key):
        server = StoreServer(StoreConfig(master_port=0, data_port=0, transport="zmq")).start()
    try:
        tokens = prompt(2 * 32 + 1)
        put_config = PdserveConnectorConfig(server.data_address, server.master_address,
                                            cluster_key_file=str(key_path), timeout_s=2.0)
        client = put_config.open_client(put_config.cluster_key())
        keys = chain(tokens)
        assert client.put_many(keys, [torch.zeros(block_nbytes(LAYOUT), dtype=torch.uint8)
                                      for _ in keys]) == [True, True]
        with_key = PdserveScheduler(LAYOUT, MODEL_ID, client, True, True)
        assert with_key.num_new_matched_tokens("r", tokens, len(tokens), 0) == 64
        plain = PdserveConnectorConfig(server.data_address, server.master_address,
                                       insecure_plaintext=True, timeout_s=0.3)
        without_key = PdserveScheduler(LAYOUT, MODEL_ID, plain.open_client(None), True, True)
        # the handshake never completes: no answer, a miss (not an error)
        assert without_key.num_new_matched_tokens("r", tokens, len(tokens), 0) == 0
        without_key.close()
        with_key.close()
    finally:
        server.stop()


# ---- the real check: vLLM producer -> pdserve store -> vLLM consumer -----------------------------


def assert_pdserve_holds_the_same_blocks(model_dir, prompts: list[list[int]], block_size: int,
                                         store: StoreClient) -> None:
    """pdserve's own engine, on the same checkpoint and block size, names the prompts' blocks
    with the keys vLLM stored them under and computes the same KV into them (K and V, every
    layer, head and token in place): what vLLM saved, a pdserve worker loads, and back."""
    from pdserve.serve import LLM, SamplingParams

    llm = LLM(model_dir, block_size=block_size, num_kv_blocks=32, dtype="float32")
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=1))
        manager, pool = llm.engine.block_manager, llm.engine.runner.kv_caches
        for tokens in prompts:
            keys = block_keys(tokens, block_size, manager.root(None))
            for key, stored in zip(keys, store.get_many(keys), strict=True):
                assert stored is not None, "vLLM and pdserve name a block differently"
                block_id = manager._key_to_block[key]
                # [num_layers, 2, block_size, num_kv_heads, head_dim]
                ours = torch.stack([cache[:, block_id] for cache in pool])
                theirs = torch.from_numpy(stored).view(torch.float32).view(ours.shape)
                # two fp32 implementations of one model: summation order differs
                torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@needs_vllm
def test_vllm_consumer_loads_what_a_vllm_producer_saved(tmp_path, make_model_dir):
    """vLLM processes on one random Llama (head_dim 64, as vLLM's CPU attention needs): a
    plain run, a kv_producer that prefills the prompts into a CurveZMQ-secured pdserve store,
    and a fresh kv_consumer whose greedy text must equal the plain run's while it really
    loaded the prompts' blocks from the store and computed fewer prompt tokens; then a
    consumer whose every load fails, which must still produce the plain run's text."""
    model_dir = make_model_dir("llama", hidden_size=128, intermediate_size=256,
                               num_attention_heads=2, num_key_value_heads=1)
    key = security.ClusterKey.generate()
    key_path = key.save(tmp_path / "cluster.key")
    with security.using(key):
        server = StoreServer(StoreConfig(master_port=0, data_port=0, transport="zmq")).start()
    try:
        prompts = [prompt(n, seed=10 + i) for i, n in enumerate((300, 200, 140))]
        overlay = pdserve_overlay(tmp_path / "overlay")
        extra = {"store": server.data_address, "store_master": server.master_address,
                 "cluster_key_file": str(key_path), "lease_ttl_s": 600}

        def run(name: str, max_tokens: int, role: str | None, **overrides: object) -> dict:
            return run_vllm(VLLM_PYTHON, overlay, model_dir, prompts, tmp_path / f"{name}.json",
                            max_tokens, role, {**extra, **overrides})

        plain = run("plain", 16, None)
        run("producer", 1, "kv_producer")  # a P/D prefill: the prompt, one token
        block_size = plain["block_size"]
        # every full prompt block was saved, as pdserve itself would have saved it
        num_blocks = server.store.stats()["num_blocks_dram"]
        assert num_blocks == sum(len(p) // block_size for p in prompts), num_blocks
        with security.using(key):
            reader = client_of(server)
        assert_pdserve_holds_the_same_blocks(model_dir, prompts, block_size, reader)
        reader.close()
        stored = server.store.stats()
        consumer = run("consumer", 16, "kv_consumer")
        loaded = server.store.stats()

        assert [c["token_ids"] for c in consumer["outputs"]] == \
            [p["token_ids"] for p in plain["outputs"]]
        assert [c["text"] for c in consumer["outputs"]] == [p["text"] for p in plain["outputs"]]
        # it loaded every full block before each prompt's last token from the store, and
        # computed only the rest: vLLM counts the loaded tokens as cached
        num_loadable = [(len(p) - 1) // block_size for p in prompts]
        assert loaded["num_hits_dram"] - stored["num_hits_dram"] == sum(num_loadable), loaded
        assert [c["num_cached_tokens"] for c in consumer["outputs"]] == \
            [n * block_size for n in num_loadable]
        assert all(p["num_cached_tokens"] == 0 for p in plain["outputs"])
        assert sum(num_loadable) > 0
        # every hit was pinned until read, then released (the TTL is far off)
        assert server.leases.num_leases == 0 and server.store.num_pinned_blocks == 0
        server.check_integrity()

        # Every load fails: the master still finds the blocks, but this consumer reads from
        # an empty data node the master does not know. vLLM recomputes; the text is the same.
        with security.using(key):
            empty = StoreServer(StoreConfig(role="data", data_port=0, transport="zmq")).start()
        try:
            failed = run("consumer-failed", 16, "kv_consumer", store=empty.data_address)
            # it did try: every loadable block was asked of the empty node
            assert empty.store.stats()["num_misses"] >= sum(num_loadable)
        finally:
            empty.stop()
        assert [c["token_ids"] for c in failed["outputs"]] == \
            [p["token_ids"] for p in plain["outputs"]]
    finally:
        server.stop()
