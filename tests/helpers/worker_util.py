"""Helpers for tests that run Worker loops in-process and talk to them over ZeroMQ."""

from __future__ import annotations

import time

from transformers import AutoTokenizer

from pdserve.protocol.worker import (
    WORKER_PROTOCOL,
    GenerateRequest,
    Output,
    SetRole,
    StatusRequest,
    WorkerStatus,
)
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.engine.engine import Engine

BLOCK = 8


def make_engine(model_dir, block_size: int = BLOCK, num_blocks: int = 64,
                enable_prefix_caching: bool = True, kv_offload_bytes: int = 0) -> Engine:
    """A small engine over `model_dir`; a Worker gives it its role."""
    return Engine(ModelConfig(str(model_dir)),
                  CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_offload_bytes=kv_offload_bytes),
                  tokenizer=AutoTokenizer.from_pretrained(model_dir))


def collect(socket, request: GenerateRequest, timeout_s: float = 60.0) -> list[Output]:
    """Send `request` on a DEALER socket and gather its Outputs until one finishes it (not a
    prefill worker's note of where it stages the prompt, Output.staging: the router's)."""
    socket.send(WORKER_PROTOCOL.encode(request))
    outputs, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if socket.poll(100):
            message = WORKER_PROTOCOL.decode(socket.recv())
            if (isinstance(message, Output) and message.request_id == request.request_id
                    and message.staging is None):
                outputs.append(message)
                if message.finish_reason is not None:
                    return outputs
    raise TimeoutError(f"no finish for {request.request_id}")


def status_reply(socket, message: SetRole | StatusRequest | None = None,
                 timeout_s: float = 30.0) -> WorkerStatus:
    """Send `message` (a StatusRequest by default) and wait for the WorkerStatus answer."""
    socket.send(WORKER_PROTOCOL.encode(message or StatusRequest()))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if socket.poll(100):
            reply = WORKER_PROTOCOL.decode(socket.recv())
            if isinstance(reply, WorkerStatus):
                return reply
    raise TimeoutError("no WorkerStatus")


def assert_worker_idle(worker) -> None:
    """Nothing left in a worker: no request, hand-off, load or owner; every block free."""
    assert not worker.engine.has_unfinished_requests()
    assert not worker.gateway.is_busy
    if worker.gateway.kv_transfer is not None:
        assert worker.gateway.kv_transfer.num_in_flight == 0
    worker.engine.block_manager.check_integrity()
    assert worker.engine.block_manager.num_used_blocks == 0


def dealer_sockets(context, base_port: int, names) -> dict:
    """A DEALER socket to each in-process worker, the i-th of `names` on base_port + i."""
    import zmq

    sockets = {}
    for i, name in enumerate(names):
        sockets[name] = context.socket(zmq.DEALER)
        sockets[name].setsockopt(zmq.LINGER, 0)
        sockets[name].connect(f"tcp://127.0.0.1:{base_port + i}")
    return sockets


def stop_workers(workers: dict, threads: list, sockets: dict, context,
                 check_idle: bool = False) -> None:
    """Stop in-process workers' loops (checking, with check_idle, that each left nothing
    behind), close their KV transfers, sockets and the context."""
    for worker in workers.values():
        worker.stop_event.set()
    for thread in threads:
        thread.join(10)
    for worker in workers.values():
        if check_idle:
            assert_worker_idle(worker)
        if worker.gateway.kv_transfer is not None:
            worker.gateway.kv_transfer.close()
        worker.close()
    for socket in sockets.values():
        socket.close()
    context.term()

