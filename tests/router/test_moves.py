"""Moving a worker between pools (pdserve/router/moves.py) over scripted workers: a decode
worker that leaves hands its running request to the other decode worker, where it resumes
after the tokens already streamed (no gap, no repeat, nothing held); without hand-over the
move waits for the request; a worker that refuses the switch at first is asked again.
tests/cluster/test_server_controller.py moves real workers under load through `pdserve up`."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import KVHandoff, Output, WorkerStatus
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.worker_client import Received, WorkerClient

TOKEN_S = 0.02  # a scripted decode step
NUM_TOKENS = 12


class ScriptedWorker(WorkerClient):
    """No socket: prefill answers with a hand-off; decode streams one token per TOKEN_S,
    continuing a resumed request after its resume_output_ids, until done or aborted. A
    SetRole switches the reported role unless `refusals` says to ignore it that many times."""

    def start(self) -> None:
        self.status = WorkerStatus(f"{self.role}-{self.address[-1]}", self.role, "m", 256,
                                   True, 0, 0, 64, 64, 16)
        self.last_seen_s = time.monotonic() + 3600
        self.sent, self.aborted, self.set_roles = [], [], []
        self.refusals = 0

    async def generate(self, request):
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._reservations.pop(request.request_id, None)
        self.sent.append(request)

        def put(output: Output) -> None:
            queue.put_nowait(Received(dataclasses.replace(output, request_id=request.request_id),
                                      time.monotonic()))

        if self.role == "prefill":
            put(Output("", [100], "a", "handoff", num_prompt_tokens=4,
                       handoff=KVHandoff([bytes(32)], first_token_id=100)))
            return queue

        async def stream() -> None:
            first = len(request.resume_output_ids) or 1  # prefill gave token 100 (index 0)
            for i in range(first, NUM_TOKENS):
                await asyncio.sleep(TOKEN_S)
                if request.request_id in self.aborted:
                    return
                put(Output("", [100 + i], "x", "length" if i == NUM_TOKENS - 1 else None))

        self._tasks.append(asyncio.create_task(stream()))
        return queue

    async def abort(self, request_id: str) -> None:
        self.finish(request_id)
        self.aborted.append(request_id)

    async def set_role(self, role: str) -> None:
        self.set_roles.append(role)
        if self.refusals > 0:
            self.refusals -= 1
            return
        self.status = dataclasses.replace(self.status, role=role)


@pytest.fixture
def dispatcher(llama_dir, monkeypatch):
    monkeypatch.setattr("pdserve.router.dispatch.WorkerClient", ScriptedWorker)
    config = RouterConfig(model=str(llama_dir), prefill_addrs=("tcp://127.0.0.1:1",),
                          decode_addrs=("tcp://127.0.0.1:2", "tcp://127.0.0.1:3"))
    return Dispatcher(config)


async def _serve_and_move(dispatcher: Dispatcher, hand_over: bool, after_tokens: int = 4):
    """One request streaming while a decode worker moves to prefill once `after_tokens`
    came: (tokens the client got, the move)."""
    dispatcher.start()
    tokens: list[int] = []
    sampling = SamplingParams(max_tokens=NUM_TOKENS)

    async def client() -> None:
        async for output in dispatcher.run("r1", [1, 2, 3, 4], sampling, dispatcher.prefill[0]):
            tokens.extend(output.token_ids)

    task = asyncio.create_task(client())
    while len(tokens) < after_tokens:
        await asyncio.sleep(TOKEN_S / 4)
    [streaming] = [w for w in dispatcher.decode if w.sent]
    other = next(w for w in dispatcher.decode if w is not streaming)
    other.status = dataclasses.replace(other.status, num_waiting=5)  # so `streaming` leaves
    move = await dispatcher.flip_one("prefill", drain_timeout_s=10.0, hand_over=hand_over)
    other.status = dataclasses.replace(other.status, num_waiting=0)
    await asyncio.wait_for(task, 10.0)
    return tokens, move, streaming, other


async def test_a_leaving_decode_worker_hands_its_request_over(dispatcher):
    tokens, move, left, took = await _serve_and_move(dispatcher, hand_over=True)
    assert tokens == [100 + i for i in range(NUM_TOKENS)]  # no gap, no repeat
    assert move is not None and move.num_handed_over == 1 and move.to_role == "prefill"
    assert left in dispatcher.prefill and left.role == "prefill" and left.aborted == ["r1"]
    [resumed] = took.sent
    assert resumed.handoff is None and resumed.resume_output_ids == tokens[:len(
        resumed.resume_output_ids)] and len(resumed.resume_output_ids) >= 4
    assert all(w.num_inflight == 0 for w in dispatcher.workers)  # nothing held anywhere
    await dispatcher.close()


async def test_without_hand_over_the_move_waits_for_the_request(dispatcher):
    tokens, move, left, other = await _serve_and_move(dispatcher, hand_over=False)
    assert tokens == [100 + i for i in range(NUM_TOKENS)]
    assert move is not None and move.num_handed_over == 0
    assert left.aborted == [] and other.sent == []  # it finished where it was
    assert left in dispatcher.prefill
    await dispatcher.close()


async def test_a_worker_that_refuses_the_switch_is_asked_again(dispatcher):
    dispatcher.start()
    dispatcher.decode[0].status = dataclasses.replace(dispatcher.decode[0].status,
                                                      num_waiting=1)
    leaving = min(dispatcher.decode, key=lambda w: w.status.num_waiting)
    leaving.refusals = 2  # still ending a load, say
    move = await dispatcher.flip_one("prefill", drain_timeout_s=5.0)
    assert move is not None and leaving.set_roles == ["prefill"] * 3
    assert leaving in dispatcher.prefill and len(dispatcher.decode) == 1
    # the last decode worker never leaves its pool
    assert await dispatcher.flip_one("prefill", drain_timeout_s=5.0) is None
    await dispatcher.close()
