"""The router's length rules (vLLM's), through the real app with stand-in workers: no
max_tokens gets the room left in the context (a completion: 16 when that fits), an explicit
one that does not fit is a 400, and the context is the smallest a worker reports (its KV pool
caps it). And the decode pick reserves what a request needs now, not its worst case."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pdserve.protocol.worker import Output, WorkerStatus
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.policies import (
    PREFILL_ROUTING,
    CacheAwarePrefill,
    MostFreeKVDecode,
    NoWorkerAvailable,
    RouteContext,
    num_blocks_needed_now,
)


def _status(max_model_len: int, num_free_blocks: int = 64) -> WorkerStatus:
    return WorkerStatus("w", "colocated", "m", max_model_len, True, 0, 0, num_free_blocks,
                        64, 16)


class RecordingDispatcher(Dispatcher):
    """The real dispatcher and policies; its workers are stand-ins that report a status and
    answer every request with one token, and the sampling params sent are kept."""

    def __init__(self, config: RouterConfig, worker_max_model_len: int) -> None:
        super().__init__(config)
        for worker in self.workers:
            worker.status = _status(worker_max_model_len)
            worker.last_seen_s = time.monotonic() + 3600  # alive for the test's length
        self.sent = []

    def start(self) -> None:  # no sockets to poll
        pass

    async def run(self, request_id, prompt_token_ids, sampling, first_worker, phases=None):
        self.sent.append(sampling)
        first_worker.finish(request_id)
        yield Output(request_id, [7], "x", "length", num_prompt_tokens=len(prompt_token_ids))


@pytest.fixture()
def router(llama_dir: Path):
    config = RouterConfig(model=str(llama_dir), colocated_addrs=("tcp://127.0.0.1:1",))
    dispatcher = RecordingDispatcher(config, worker_max_model_len=100)
    with TestClient(build_app(config, dispatcher)) as client:
        yield client, dispatcher


def _prompt_ids(n: int) -> list[int]:
    return [5 + i % 50 for i in range(n)]


def test_unset_max_tokens_gets_the_room_left(router) -> None:
    client, dispatcher = router
    # the checkpoint says 2048; the worker's KV pool holds 100: 100 is the context
    models = client.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == 100

    r = client.post("/v1/completions", json={"prompt": _prompt_ids(30)})
    assert r.status_code == 200, r.text
    assert dispatcher.sent[-1].max_tokens == 16  # OpenAI's default: it fits
    r = client.post("/v1/completions", json={"prompt": _prompt_ids(90)})
    assert r.status_code == 200, r.text
    assert dispatcher.sent[-1].max_tokens == 10  # only 10 left: not a 400

    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    num_prompt = r.json()["usage"]["prompt_tokens"]
    assert dispatcher.sent[-1].max_tokens == 100 - num_prompt

    r = client.post("/v1/completions", json={"prompt": _prompt_ids(30), "max_tokens": 70})
    assert r.status_code == 200 and dispatcher.sent[-1].max_tokens == 70  # exactly fits


@pytest.mark.parametrize("body", [
    {"prompt": _prompt_ids(30), "max_tokens": 71},  # explicit, one too many
    {"prompt": _prompt_ids(30), "max_tokens": 10**9},
    {"prompt": _prompt_ids(100)},  # no room left to generate
])
def test_what_does_not_fit_is_a_400(router, body) -> None:
    client, dispatcher = router
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "maximum context length is 100 tokens" in r.json()["error"]["message"]
    assert dispatcher.sent == []


def test_chat_too_long_for_the_context_is_a_400(router) -> None:
    client, _ = router
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hello " * 200}]})
    assert r.status_code == 400, r.text


class _Decoder:
    def __init__(self, address: str, num_free_blocks: int) -> None:
        self.address = address
        self.status = _status(4096, num_free_blocks)
        self.accepting = True
        self.num_inflight = 0


def test_decode_pick_reserves_what_is_needed_now() -> None:
    """What a decode worker must have free is the prompt and the next token, whatever
    max_tokens is; a worker with that much is preferred, and with none the pick still goes
    to one (it queues the request) rather than failing."""
    assert num_blocks_needed_now(num_prompt_tokens=40, block_size=16) == 3  # 41 tokens
    assert num_blocks_needed_now(num_prompt_tokens=47, block_size=16) == 3  # 48 tokens
    assert num_blocks_needed_now(num_prompt_tokens=48, block_size=16) == 4
    policy = MostFreeKVDecode()
    roomy, tight = _Decoder("a", num_free_blocks=9), _Decoder("b", num_free_blocks=2)
    assert policy.choose([tight, roomy], num_blocks_needed=3) is roomy
    full = _Decoder("c", num_free_blocks=0)
    assert policy.choose([full, tight], num_blocks_needed=3) is tight  # none fits: queues
    with pytest.raises(NoWorkerAvailable):
        policy.choose([], num_blocks_needed=1)


def test_prefill_pick_takes_cache_then_load_and_ties_take_turns() -> None:
    """Equal prefill workers take turns (one request at a time used to land on the lowest
    address every time, so a worker that had just flipped to prefill got none); a cached
    prefix or a lighter load still decides first."""
    policy = CacheAwarePrefill()
    b, a, busy = _Decoder("b", 0), _Decoder("a", 0), _Decoder("c", 0)
    for worker in (a, b, busy):
        worker.status = None
    busy.num_inflight = 1
    picks = [policy.choose([b, a, busy], RouteContext(100)).address for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    cached = RouteContext(600, num_worker_cached_tokens={"c": 600})  # 0 + 512 < 600
    assert policy.choose([b, a, busy], cached) is busy
    with pytest.raises(NoWorkerAvailable):
        policy.choose([], RouteContext(1))


def test_least_load_and_round_robin_ignore_the_cache() -> None:
    """--prefill-routing least-load picks the emptiest worker (ties in turn), round-robin
    each in turn; neither looks at a cached prefix."""
    a, b, c = _Decoder("a", 0), _Decoder("b", 0), _Decoder("c", 0)
    for worker in (a, b, c):
        worker.status = None
    a.num_inflight = 2
    cached = RouteContext(600, num_worker_cached_tokens={"a": 600})
    least = PREFILL_ROUTING["least-load"]()
    assert [least.choose([c, a, b], cached).address for _ in range(3)] == ["b", "c", "b"]
    turns = PREFILL_ROUTING["round-robin"]()
    assert [turns.choose([c, a, b], cached).address for _ in range(4)] == ["a", "b", "c", "a"]
    assert isinstance(PREFILL_ROUTING["cache-aware"](), CacheAwarePrefill)
    with pytest.raises(NoWorkerAvailable):
        turns.choose([], cached)
    with pytest.raises(ValueError, match="prefill routing"):
        RouterConfig(model="m", colocated_addrs=("tcp://127.0.0.1:1",),
                     prefill_routing="random")


def test_prefill_pick_credits_own_prefix_over_the_store() -> None:
    """A worker's own prefix (pool or host tier) counts in full; the store's beyond it at
    the share of a prefill a store load saves there, as the worker measured it."""
    policy = CacheAwarePrefill(load_penalty_tokens=0)
    own, other = _Decoder("a", 0), _Decoder("b", 0)
    # the store holds 400 of the prompt's tokens; worker a computed 300 of them itself
    ctx = RouteContext(500, num_store_cached_tokens=400, num_worker_cached_tokens={"a": 300})
    assert ctx.num_cached_tokens(own) == ctx.num_cached_tokens(other) == 400  # no report: 1
    for worker in (own, other):
        worker.status = dataclasses.replace(worker.status,
                                            kv_tiers={"store_token_credit": 0.5})
    assert ctx.num_cached_tokens(own) == 300 + 0.5 * 100
    assert ctx.num_cached_tokens(other) == 0.5 * 400
    assert policy.choose([other, own], ctx) is own


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_request_waits_for_a_pool_that_is_restarting(llama_dir: Path, comes_back) -> None:
    """Its only worker not ready (restarting): the request is held, not refused, and served
    once the worker is back; if none comes back within pool_wait_s, HTTP 503."""
    config = RouterConfig(model=str(llama_dir), colocated_addrs=("tcp://127.0.0.1:1",),
                          pool_wait_s=30.0 if comes_back else 0.2)
    dispatcher = RecordingDispatcher(config, worker_max_model_len=100)
    [worker] = dispatcher.workers
    ready = worker.status
    worker.status = dataclasses.replace(ready, is_ready=False)
    back = threading.Timer(0.3, lambda: setattr(worker, "status", ready))
    with TestClient(build_app(config, dispatcher)) as client:
        if comes_back:
            back.start()
        r = client.post("/v1/completions", json={"prompt": _prompt_ids(5), "max_tokens": 2})
    back.cancel()
    if comes_back:
        assert r.status_code == 200, r.text
        assert len(dispatcher.sent) == 1
    else:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] and dispatcher.sent == []


async def test_requests_waiting_for_an_empty_pool_are_bounded(llama_dir: Path) -> None:
    """Past max_pool_waiters, a request for an empty pool is refused at once (HTTP 503 in
    routes) instead of held: the router holds no unbounded number of requests."""
    import asyncio

    config = RouterConfig(model=str(llama_dir), colocated_addrs=("tcp://127.0.0.1:1",),
                          pool_wait_s=30.0, max_pool_waiters=2)
    dispatcher = RecordingDispatcher(config, worker_max_model_len=100)
    [worker] = dispatcher.workers
    ready = worker.status
    worker.status = dataclasses.replace(ready, is_ready=False)
    waiting = [asyncio.create_task(dispatcher.wait_for_ready([dispatcher.colocated]))
               for _ in range(2)]
    await asyncio.sleep(0.05)
    assert dispatcher.num_pool_waiters == 2
    with pytest.raises(NoWorkerAvailable, match="max-pool-waiters"):
        await dispatcher.wait_for_ready([dispatcher.colocated])
    worker.status = ready
    assert await asyncio.gather(*waiting) == [True, True]
    assert dispatcher.num_pool_waiters == 0  # every waiter counted out
