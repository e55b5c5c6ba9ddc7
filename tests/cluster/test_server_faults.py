"""Failures, bounded: disconnecting clients, a decode worker killed mid-stream, a store that
goes away. Each role runs as its own `pdserve <role>` process, as in a real cluster."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest
from helpers.cluster_util import Roles, free_port_block, wait_until

from pdserve import security


@pytest.fixture(scope="module")
def roles(llama_dir, tmp_path_factory):
    # a pool left empty refuses after 1 s here (the default holds requests 15 s, a restart)
    roles = Roles(llama_dir, tmp_path_factory.mktemp("fault-logs"),
                  router_args=("--pool-wait-s", "1"))
    roles.start_all()
    try:
        roles.wait_ready()
        # this process talks to the roles as one of the cluster: store clients take the key
        with security.using(security.ClusterKey.load(roles.key_path)):
            yield roles
    finally:
        roles.stop()


@pytest.fixture(autouse=True)
def leaves_nothing_behind(roles):
    """After every test on the shared cluster: every worker it did not kill idle, with all its
    blocks free, and no store lease or pin left. Once a test killed the store (see
    test_store_down_requests_still_complete_by_recompute), only the workers are checked."""
    yield
    roles.assert_nothing_leaked()


async def _one_stream(client: httpx.AsyncClient, url: str, i: int, disconnect: bool) -> int:
    body = {"prompt": f"request {i}: " + "word " * (5 + i % 40), "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "stream": True}
    num_chunks = 0
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                num_chunks += 1
                if disconnect and num_chunks == 3:
                    return -1  # leaving the block closes the connection midway
    return num_chunks


def test_concurrent_streams_with_disconnects_leak_nothing(roles):
    async def run() -> list[int]:
        url = f"{roles.base_url}/v1/completions"
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                _one_stream(client, url, i, disconnect=i % 5 == 0) for i in range(50)])

    results = asyncio.run(run())
    assert results.count(-1) == 10
    assert all(n == 24 for n in results if n != -1)  # one chunk per token, all delivered
    # Hand-offs are pinned under leases: decode releases each once loaded; one whose client
    # left between prefill and decode is released by the prefill worker or, at the latest,
    # expires (--kv-lease-ttl-s, cluster_util.LEASE_TTL_S), well within the check's 30 s.
    roles.assert_nothing_leaked()


def test_no_internal_port_answers_a_peer_without_the_cluster_key(roles):
    """Workers and the store run CurveZMQ under the cluster key: a plaintext peer's frames
    (a status request, a store stats request) are dropped in the handshake, unanswered,
    while the cluster keeps serving."""
    import zmq

    from pdserve.protocol.store.base import STORE_PROTOCOL, StatsRequest
    from pdserve.protocol.worker import WORKER_PROTOCOL, StatusRequest

    ports = {roles.prefill_port: WORKER_PROTOCOL.encode(StatusRequest()),
             **{p: WORKER_PROTOCOL.encode(StatusRequest()) for p in roles.decode_ports},
             roles.master_port: STORE_PROTOCOL.encode(StatsRequest(request_id=1)),
             roles.data_port: STORE_PROTOCOL.encode(StatsRequest(request_id=1))}
    context = zmq.Context()
    try:
        for port, payload in ports.items():
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://127.0.0.1:{port}")
            socket.send(payload)
            assert not socket.poll(1500), f"port {port} answered a peer without the key"
            socket.close()
    finally:
        context.term()
    response = httpx.post(f"{roles.base_url}/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert response.status_code == 200


def test_garbage_and_pickle_on_worker_port_are_dropped(roles, tmp_path):
    """A worker decodes msgpack against its schema only: nothing is unpickled or run."""
    import pickle

    import zmq

    from pdserve.protocol.worker import (
        WORKER_PROTOCOL,
        AbortRequest,
        StatusRequest,
        WorkerStatus,
    )

    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    with security.using(security.ClusterKey.load(roles.key_path)):  # a peer with the key
        security.secure_client(socket)
    socket.connect(f"tcp://127.0.0.1:{roles.prefill_port}")
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.protocol.worker import GenerateRequest

    rng = random.Random(3)
    valid = WORKER_PROTOCOL.encode(GenerateRequest("fuzz", [1, 2, 3],
                                                   SamplingParams(max_tokens=2)))
    mutated = []
    for _ in range(60):  # mutated valid frames: each is refused or served, never a crash
        payload = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        mutated.append(bytes(payload))
    try:
        for payload in (pickle.dumps(Exploit()), b"\x00garbage", b"\x81\xa4type\xa5bogus",
                        b"\xc1", os.urandom(4096), *mutated):
            socket.send(payload)
        socket.send(WORKER_PROTOCOL.encode(StatusRequest()))
        reply = None
        while not isinstance(reply, WorkerStatus):  # past the fuzz's own answers
            assert socket.poll(30_000), "the worker stopped answering"
            reply = WORKER_PROTOCOL.decode(socket.recv())
        assert reply.role == "prefill"
        for request_id in {m.request_id for m in map(_try_decode, mutated) if m is not None}:
            socket.send(WORKER_PROTOCOL.encode(AbortRequest(request_id)))  # leave nothing
    finally:
        socket.close()
        context.term()
    assert not sentinel.exists()


def _try_decode(payload: bytes):
    """The GenerateRequest a fuzzed frame still decodes to, or None."""
    from pdserve.protocol.codec import WireError
    from pdserve.protocol.worker import WORKER_PROTOCOL, GenerateRequest

    try:
        message = WORKER_PROTOCOL.decode(payload)
    except (WireError, ValueError):
        return None
    return message if isinstance(message, GenerateRequest) else None


def _collect(socket, request) -> list:
    """Send a GenerateRequest to a worker as the router does; its Outputs to the last."""
    from pdserve.protocol.worker import WORKER_PROTOCOL, Output

    socket.send(WORKER_PROTOCOL.encode(request))
    outputs = []
    while socket.poll(30_000):
        message = WORKER_PROTOCOL.decode(socket.recv())
        if isinstance(message, Output) and message.staging is None:  # (a note for the router)
            outputs.append(message)
            if message.finish_reason is not None:
                return outputs
    raise TimeoutError("no finish")


def _worker_sockets(roles, context) -> dict:
    import zmq

    sockets = {}
    for role, port in (("prefill", roles.prefill_port), ("decode", roles.decode_port)):
        sockets[role] = context.socket(zmq.DEALER)
        sockets[role].setsockopt(zmq.LINGER, 0)
        security.secure_client(sockets[role])  # as the router's are
        sockets[role].connect(f"tcp://127.0.0.1:{port}")
    return sockets


def test_handoff_blocks_are_leased_until_decode_loads_them(roles):
    """Talk to the workers directly, as the router does: the prefill's hand-off names its own
    hand-off node and a lease there pinning the prompt's blocks; the decode worker reads them
    from that node and releases the lease; a write-back copy lands in the fleet store."""
    import zmq

    from pdserve.kvstore.client import StoreClient
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.protocol.worker import GenerateRequest

    context = zmq.Context()
    sockets = _worker_sockets(roles, context)
    client = roles.store_client()
    source = None
    try:
        prompt = list(range(40, 90))
        request = GenerateRequest("lease-1", prompt, SamplingParams(max_tokens=4, temperature=0))
        [first] = _collect(sockets["prefill"], request)
        assert first.finish_reason == "handoff" and first.handoff.lease_id > 0
        source = StoreClient(first.handoff.source_address, transport="zmq", timeout_s=5)
        # the hand-off's lease stays until decode reads; the write-back to the fleet store,
        # off the critical path, may hold one of its own for a moment
        seen: list[int] = []
        assert wait_until(lambda: seen.append(source.stats()["num_leases"]) or seen[-1] == 1,
                          5), f"the node's lease counts: {seen}"
        outputs = _collect(sockets["decode"], GenerateRequest(
            "lease-1", prompt, request.sampling, handoff=first.handoff))
        assert sum(len(o.token_ids) for o in outputs) == 3
        assert wait_until(lambda: source.stats()["num_leases"] == 0, 10)
        assert wait_until(lambda: all(client.exists(first.handoff.block_keys)), 10)
        assert client.stats()["num_leases"] == 0  # the store's copy is not pinned
    finally:
        if source is not None:
            source.close()
        client.close()
        for socket in sockets.values():
            socket.close()
        context.term()


def test_prefill_killed_after_handoff_decode_loads_the_store_copy(roles):
    """The prefill worker dies after handing off, its node with it: the decode worker's read
    from that node fails within its peer timeout, it loads the fleet store's write-back copy
    instead, and the tokens equal those of an undisturbed hand-off."""
    import zmq

    from pdserve.protocol.sampling import SamplingParams
    from pdserve.protocol.worker import GenerateRequest

    context = zmq.Context()
    sockets = _worker_sockets(roles, context)
    client = roles.store_client()
    try:
        prompt = list(range(200, 245))
        sampling = SamplingParams(max_tokens=5, temperature=0)

        def tokens(outputs) -> list[int]:
            return [t for o in outputs for t in o.token_ids]

        [first] = _collect(sockets["prefill"], GenerateRequest("kp-0", prompt, sampling))
        expected = tokens(_collect(sockets["decode"], GenerateRequest(
            "kp-0", prompt, sampling, handoff=first.handoff)))
        [first] = _collect(sockets["prefill"], GenerateRequest("kp-1", prompt, sampling))
        assert first.handoff.source_address and first.handoff.lease_id
        assert wait_until(lambda: all(client.exists(first.handoff.block_keys)), 10)
        roles.kill("prefill")
        roles.processes["prefill"].wait(10)
        outputs = _collect(sockets["decode"], GenerateRequest(
            "kp-1", prompt, sampling, handoff=first.handoff))
        assert outputs[-1].finish_reason == "length" and tokens(outputs) == expected
    finally:
        client.close()
        for socket in sockets.values():
            socket.close()
        context.term()
    roles.start_worker("prefill")  # back for the tests after this one
    assert wait_until(lambda: _get_status(f"{roles.base_url}/health") == 200, 120)


def test_admission_control_and_api_key(roles):
    """A second router on the same workers, with an API key and a tight in-flight limit:
    401 without the key, 429 with a clear message once the prefill worker holds its limit."""
    port = free_port_block(1)
    roles.start("router2", "router", "--model", roles.model_dir, "--port", str(port),
                 "--prefill", f"tcp://127.0.0.1:{roles.prefill_port}",
                 "--decode", f"tcp://127.0.0.1:{roles.decode_port}",
                 "--api-key", "sesame", "--max-inflight-per-worker", "2")
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer sesame"}
    assert wait_until(lambda: _get_status(f"{url}/health") == 200, 120)
    body = {"prompt": "hello", "max_tokens": 4}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401

    async def burst() -> list[int]:
        long = {"prompt": "x " * 200, "max_tokens": 64, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120, headers=auth) as client:
            responses = await asyncio.gather(*[
                client.post(f"{url}/v1/completions", json=long) for _ in range(8)])
        for r in responses:
            if r.status_code == 429:
                assert "overloaded" in r.json()["error"]["message"]
        return [r.status_code for r in responses]

    codes = asyncio.run(burst())
    assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
    assert set(codes) <= {200, 429}
    roles.processes.pop("router2").terminate()


def _get_status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_decode_killed_mid_stream_errors_fast_then_recovers(roles):
    url = f"{roles.base_url}/v1/completions"
    body = {"prompt": "long story", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    # "fast": the router fails the stream because the worker's connection dropped (it died),
    # not because it went silent past a timeout (WorkerSilent: "sent nothing for ...")
    killed = False
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if not killed:
                roles.kill("decode")
                killed = True
            events.append(line[6:])
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and "error" in json.loads(events[-2]), events[-3:]
    assert "sent nothing" not in json.dumps(errors[0]), errors
    assert len(events) - 2 < 1500  # it ended with the error, long before its tokens did
    roles.processes["decode"].wait(10)
    # no decode worker: a clear 503, not a hang
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"]
    # The new decode worker is checked like any other; the leases the killed one held expire
    # after --kv-lease-ttl-s (cluster_util.LEASE_TTL_S), within the leak check's wait.
    roles.start_worker("decode")
    assert wait_until(lambda: httpx.get(f"{roles.base_url}/health").status_code == 200, 120)
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_store_down_requests_still_complete_by_recompute(roles):
    url = f"{roles.base_url}/v1/completions"
    body = {"prompt": "def main():\n    return 1\n" * 3, "max_tokens": 12, "temperature": 0}
    before = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    # No store is left to ask for leases: from here on the leak check covers the workers only.
    roles.kill("store")
    roles.processes["store"].wait(10)
    after = httpx.post(url, json={**body, "cache_salt": "fresh"}, timeout=120)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == before


def test_dead_prefill_is_not_routed_to(roles):
    # The leak check leaves the killed prefill out; the decode worker must still read idle.
    roles.kill("prefill")
    roles.processes["prefill"].wait(10)

    def prefill_down() -> bool:
        status = httpx.get(f"{roles.base_url}/status", timeout=5).json()
        return not any(w["is_alive"] for w in status["workers"] if w["role"] == "prefill")

    assert wait_until(prefill_down, 10)
    r = httpx.post(f"{roles.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
    assert httpx.get(f"{roles.base_url}/health", timeout=5).status_code == 503
