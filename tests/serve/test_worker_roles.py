"""What a worker tells the router's goodput controller and what it lets it change: the shape
and time of each engine step (for per-phase step-latency models), and a flip of a drained
worker between the prefill and decode roles. In-process workers over real ZeroMQ sockets."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq
from helpers.cluster_util import free_port_block
from helpers.engine_util import run_to_completion
from helpers.worker_util import BLOCK, collect, make_engine, status_reply, stop_workers

from pdserve.protocol.codec import WireError
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import (
    WORKER_PROTOCOL,
    GenerateRequest,
    SetRole,
    StepSample,
    WorkerStatus,
)
from pdserve.serve.worker.server import Worker

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _work(engine) -> tuple[int, int, int, int]:
    """What the engine's last step computed, by phase."""
    s = engine.step_samples[-1]
    return (s.num_prefill_tokens, s.num_prefill_query_keys, s.num_decode_seqs,
            s.num_decode_context_tokens)


def test_step_samples_count_prefill_and_decode_work(llama_dir):
    engine = make_engine(llama_dir)
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first = list(range(10, 23))  # 13 tokens: one full block, then 5
        engine.add_request(first, params, "r1")
        engine.step()
        assert _work(engine) == (13, 13 * 13, 0, 0)
        # r2 shares r1's first block: its prefill starts at position 8
        engine.add_request(first[:BLOCK] + [50, 51, 52], params, "r2")
        engine.step()
        assert _work(engine) == (3, 3 * 11, 1, 14)
        engine.step()
        assert _work(engine) == (0, 0, 2, 15 + 12)
        run_to_completion(engine)
        num_steps = len(engine.step_samples)
        assert [s.seq for s in engine.step_samples] == list(range(1, num_steps + 1))
        assert all(s.seconds > 0 for s in engine.step_samples)
        engine.step()  # nothing to run: no sample
        assert len(engine.step_samples) == num_steps
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def workers(llama_dir):
    """A prefill worker without a store (it flips) and a colocated one (the reference)."""
    base = free_port_block(2)
    context = zmq.Context()
    workers, threads, sockets = {}, [], {}
    for i, role in enumerate(("prefill", "colocated")):
        address = f"tcp://127.0.0.1:{base + i}"
        workers[role] = Worker(make_engine(llama_dir), role, address, role)
        threads.append(threading.Thread(target=workers[role].serve_forever, daemon=True))
        threads[-1].start()
        sockets[role] = context.socket(zmq.DEALER)
        sockets[role].setsockopt(zmq.LINGER, 0)
        sockets[role].connect(address)
    yield workers, sockets
    stop_workers(workers, threads, sockets, context, check_idle=True)


def _tokens(socket, request: GenerateRequest) -> list[int]:
    return [t for output in collect(socket, request) for t in output.token_ids]


def test_status_carries_step_samples(workers):
    _, sockets = workers
    prompt = list(range(30, 41))
    tokens = _tokens(sockets["colocated"], GenerateRequest("s1", prompt, GREEDY))
    samples = status_reply(sockets["colocated"]).step_samples
    assert 0 < len(samples) <= 64
    assert [s.seq for s in samples] == sorted({s.seq for s in samples})
    assert all(s.seconds > 0 for s in samples)
    # the last steps were s1's: its prompt, then a decode per further token
    mine = samples[-len(tokens):]
    assert (mine[0].num_prefill_tokens, mine[0].num_decode_seqs) == (len(prompt), 0)
    assert [s.num_decode_context_tokens for s in mine[1:]] == \
        [len(prompt) + i for i in range(1, len(tokens))]


def test_worker_flips_between_prefill_and_decode(workers):
    by_role, sockets = workers
    prompt = list(range(60, 79))
    expected = _tokens(sockets["colocated"], GenerateRequest("ref", prompt, GREEDY))
    [first] = collect(sockets["prefill"], GenerateRequest("f1", prompt, GREEDY))
    assert first.finish_reason == "handoff" and first.handoff.block_keys == []
    assert status_reply(sockets["prefill"], SetRole("decode")).role == "decode"
    assert by_role["prefill"].engine.role.name == "decode"
    rest = _tokens(sockets["prefill"], GenerateRequest("f1", prompt, GREEDY,
                                                       handoff=first.handoff))
    assert first.token_ids + rest == expected
    assert status_reply(sockets["prefill"], SetRole("prefill")).role == "prefill"
    [again] = collect(sockets["prefill"], GenerateRequest("f2", prompt, GREEDY))
    assert again.finish_reason == "handoff" and again.token_ids == expected[:1]


def test_colocated_worker_never_flips(workers):
    by_role, sockets = workers
    assert status_reply(sockets["colocated"], SetRole("prefill")).role == "colocated"
    assert by_role["colocated"].engine.role.name == "colocated"


def test_busy_worker_refuses_to_flip(workers):
    """Steps do nothing until the refusal came back, so the request is surely unfinished."""
    by_role, sockets = workers
    worker, socket = by_role["prefill"], sockets["prefill"]
    may_step = threading.Event()
    real_step = worker.engine.step
    worker.engine.step = lambda: real_step() if may_step.is_set() else []
    try:
        socket.send(WORKER_PROTOCOL.encode(GenerateRequest("b1", [5, 6, 7], GREEDY)))
        status = status_reply(socket, SetRole("decode"))
        assert (status.role, status.num_waiting) == ("prefill", 1)
        may_step.set()
        [output] = collect(socket, GenerateRequest("b2", [5, 6, 7], GREEDY))
        # b1's hand-off came first and _collect skipped it; b2 ran on a prefill worker too
        assert output.finish_reason == "handoff"
    finally:
        del worker.engine.step
    assert status_reply(socket, SetRole("decode")).role == "decode"
    assert status_reply(socket, SetRole("prefill")).role == "prefill"


def test_bogus_role_is_dropped(workers):
    _, sockets = workers
    bogus = msgpack.packb({"type": "set_role", "role": "bogus"}, use_bin_type=True)
    with pytest.raises(WireError):
        WORKER_PROTOCOL.decode(bogus)
    with pytest.raises(ValueError):
        SetRole("colocated")
    sockets["prefill"].send(bogus)
    assert status_reply(sockets["prefill"]).role == "prefill"  # no reply to the bogus one
    [output] = collect(sockets["prefill"], GenerateRequest("g1", [9, 8, 7], GREEDY))
    assert output.finish_reason == "handoff"


def test_worker_status_with_step_samples_round_trips():
    samples = [StepSample(1, 13, 169, 0, 0, 0.02), StepSample(2, 0, 0, 3, 40, 0.005)]
    status = WorkerStatus("w", "decode", "m", 2048, True, 3, 0, 10, 64, 8,
                          step_samples=samples)
    assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(status)) == status
    assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(SetRole("decode"))) == \
        SetRole("decode")
