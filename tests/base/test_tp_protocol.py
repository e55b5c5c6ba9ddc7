"""Engine -> TP ranks messages (pdserve/protocol/tp.py): what round-trips, what is refused,
and that a TP rank handed a malformed message leaves without running it."""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch.distributed as dist

from pdserve.protocol.codec import WireError
from pdserve.protocol.tp import (
    TP_PROTOCOL,
    Ping,
    ReadKV,
    SeqChunk,
    StepInput,
    Stop,
    WriteKV,
)
from pdserve.protocol.worker import WORKER_PROTOCOL, AbortRequest
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.executor.model_runner import ModelRunner

UNPICKLED: list[str] = []


def _record_unpickling(what: str) -> str:
    UNPICKLED.append(what)
    return what


class _Payload:
    """Pickles to a call of _record_unpickling: if anything unpickles it, we see it."""

    def __reduce__(self):
        return (_record_unpickling, ("ran",))


def _plain_step(**chunk_overrides: object) -> bytes:
    """A step on the wire, as the codec writes it, with one chunk's fields overridden."""
    chunk = {"request_id": "a", "token_ids": [1, 2], "start_pos": 0, "block_table": [3],
             "need_logits": True, **chunk_overrides}
    return msgpack.packb({"type": "step", "chunks": [chunk]})


def test_step_with_chunks_round_trips() -> None:
    step = StepInput([SeqChunk("a", [1, 2, 3], 4, [7, 0], True),
                      SeqChunk("b", [9], 17, [2, 5, 1], False)])
    decoded = TP_PROTOCOL.decode(TP_PROTOCOL.encode(step))
    assert type(decoded) is StepInput and decoded == step
    assert all(type(c) is SeqChunk for c in decoded.chunks)
    assert decoded.num_tokens == 4
    assert TP_PROTOCOL.decode(TP_PROTOCOL.encode(StepInput())) == StepInput([])


@pytest.mark.parametrize("command", [ReadKV([4, 0, 9]), WriteKV([1]), WriteKV([]), Ping(),
                                     Stop()])
def test_each_command_round_trips(command: object) -> None:
    decoded = TP_PROTOCOL.decode(TP_PROTOCOL.encode(command))
    assert type(decoded) is type(command) and decoded == command


def test_read_and_write_are_different_messages() -> None:
    assert TP_PROTOCOL.decode(TP_PROTOCOL.encode(ReadKV([1]))) != WriteKV([1])


@pytest.mark.parametrize("raw", [
    b"",
    b"\xc1",
    msgpack.packb([1, 2]),
    msgpack.packb("stop"),  # the old bare-string form
    msgpack.packb({"kind": "stop"}),  # the old format: no type tag
    msgpack.packb({"type": "exec"}),
    msgpack.packb({"type": "step", "chunks": [["a", [1], 0, [0], True]]}),  # positional chunk
    msgpack.packb({"type": "step", "chunks": "a"}),
    _plain_step(token_ids=[1.5]),
    _plain_step(token_ids=[True]),  # a bool is not a token id
    _plain_step(start_pos="0"),
    _plain_step(block_table=None),
    _plain_step(need_logits=1),
    _plain_step(request_id=b"a"),
    _plain_step(extra=0),
    msgpack.packb({"type": "step", "chunks": [{"request_id": "a", "token_ids": [1],
                                                "start_pos": 0, "block_table": [0]}]}),
    msgpack.packb({"type": "read_kv"}),
    msgpack.packb({"type": "read_kv", "block_ids": [1, "2"]}),
    msgpack.packb({"type": "write_kv", "block_ids": 3}),
    msgpack.packb({"type": "ping", "block_ids": []}),
    WORKER_PROTOCOL.encode(AbortRequest("r")),  # another boundary's message
])
def test_malformed_messages_are_refused(raw: bytes) -> None:
    with pytest.raises(WireError):
        TP_PROTOCOL.decode(raw)


def test_pickle_payloads_are_refused_and_never_run() -> None:
    UNPICKLED.clear()
    for raw in (pickle.dumps(_Payload()),
                pickle.dumps(StepInput([SeqChunk("a", [1], 0, [0], True)])),
                pickle.dumps({"type": "stop"})):
        with pytest.raises(WireError):
            TP_PROTOCOL.decode(raw)
    assert UNPICKLED == []


def test_only_tp_messages_encode() -> None:
    with pytest.raises(WireError):
        TP_PROTOCOL.encode(SeqChunk("a", [1], 0, [0], True))  # a part, not a message
    with pytest.raises(WireError):
        TP_PROTOCOL.encode(AbortRequest("r"))


def test_wire_error_is_a_value_error() -> None:
    # The TP ranks' receive loop (and its callers) treat a bad message as a ValueError.
    assert issubclass(WireError, ValueError)


def test_module_imports_neither_torch_nor_the_engine() -> None:
    code = ("import sys, pdserve.protocol.tp; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('pdserve.serve')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_rank_sent_a_pickle_leaves_and_rank_zero_reports_it(llama_dir: Path) -> None:
    """The bytes reach rank 1's receive loop as a step would; it refuses them (nothing is
    unpickled), leaves, and rank 0 reports the dead worker instead of hanging."""
    runner = ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=8),
                         ParallelConfig(tensor_parallel_size=2, device="cpu"))
    try:
        (worker,) = runner._workers
        runner._send(pickle.dumps(_Payload()))
        worker.join(timeout=60)
        assert worker.exitcode not in (None, 0)
        with pytest.raises(RuntimeError, match="died"):
            runner.execute(StepInput([SeqChunk("a", [1, 2], 0, [0], True)]))
    finally:
        runner.shutdown()
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()
