"""Engine process (TP rank 0) -> the other TP ranks: the control messages.

Each message is msgpack bytes (broadcast as a uint8 tensor over the gloo control group by
serve/model_runner.py), validated on decode, never pickled:

    {"kind": "step", "chunks": [[request_id, token_ids, start_pos, block_table, need_logits]]}
    {"kind": "read_kv" | "write_kv", "block_ids": [...]}    KV hand-off gather / scatter
    {"kind": "ping"}                                          keeps idle ranks' receive alive
    {"kind": "stop"}
"""

from __future__ import annotations

import dataclasses

import msgpack

from pdserve.serve.batch import SeqChunk, StepInput


def encode_step(step: StepInput | None) -> bytes:
    """A step, or None for "stop"."""
    if step is None:
        return msgpack.packb({"kind": "stop"})
    chunks = [[c.request_id, c.token_ids, c.start_pos, c.block_table, c.need_logits]
              for c in step.chunks]
    return msgpack.packb({"kind": "step", "chunks": chunks})


PING = msgpack.packb({"kind": "ping"})


@dataclasses.dataclass(frozen=True)
class KVCommand:
    """Rank 0 asks every rank to take part in moving whole-head KV blocks (hand-off)."""

    kind: str  # "read_kv" (gather to rank 0) | "write_kv" (broadcast from rank 0)
    block_ids: list[int]


def encode_kv_command(command: KVCommand) -> bytes:
    return msgpack.packb({"kind": command.kind, "block_ids": command.block_ids})


def decode_message(data: bytes) -> StepInput | KVCommand | str:
    """StepInput for a step, a KVCommand, or the kind ("stop" / "ping"); ValueError when
    malformed."""
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable control message: {exc}") from exc
    kinds = ("step", "stop", "ping", "read_kv", "write_kv")
    if not isinstance(message, dict) or message.get("kind") not in kinds:
        raise ValueError(f"control message must be a map with kind in {kinds}")
    if message["kind"] in ("read_kv", "write_kv"):
        block_ids = message.get("block_ids")
        if not isinstance(block_ids, list) or not all(isinstance(b, int) for b in block_ids):
            raise ValueError("a KV command needs a list of integer block_ids")
        return KVCommand(message["kind"], block_ids)
    if message["kind"] != "step":
        return message["kind"]
    chunks = []
    for raw in message.get("chunks", []):
        if not (isinstance(raw, list) and len(raw) == 5 and isinstance(raw[0], str)
                and isinstance(raw[1], list) and isinstance(raw[2], int)
                and isinstance(raw[3], list) and isinstance(raw[4], bool)):
            raise ValueError("malformed chunk in step message")
        if not all(isinstance(x, int) for x in raw[1]) or not all(
            isinstance(x, int) for x in raw[3]
        ):
            raise ValueError("token ids and block ids must be integers")
        chunks.append(SeqChunk(raw[0], raw[1], raw[2], raw[3], raw[4]))
    return StepInput(chunks=chunks)
