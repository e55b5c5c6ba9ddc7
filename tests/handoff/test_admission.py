"""Each way a handed-off request joins a decode worker's batch is its own class
(pdserve/serve/worker/admission.py), chosen by the hand-off's kind: followed, in place,
loaded (keeping a held prefix), recomputed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.store.data import ShmSegment, ShmSpan
from pdserve.protocol.worker import GenerateRequest, KVHandoff
from pdserve.serve.worker.admission import (
    KINDS,
    Followed,
    HeldPrefix,
    InPlace,
    Loaded,
    Recomputed,
    handoff_kind,
)
from pdserve.serve.worker.gateway import RequestGateway

SEGMENT = ShmSegment("host", 1, 3, 4, 1 << 20)


def _message(keys=(b"k",), segment=None, spans=()) -> GenerateRequest:
    handoff = KVHandoff(list(keys), 7, shm_segment=segment, shm_spans=list(spans))
    return GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), handoff)


class FakeEngine:
    """What a gateway asks of its engine before any step: its role, its KV layout, and the
    continued (recomputed) requests."""

    def __init__(self) -> None:
        self.continued: list[tuple[str, list[int]]] = []
        self.block_manager = SimpleNamespace(block_size=8)
        self.spec = SimpleNamespace(kv_layout=lambda block_size: SimpleNamespace(dtype="f32"))

    def set_role(self, role) -> None:
        self.role = role

    def make_request(self, *args) -> None:
        pass

    def add_continued_request(self, request_id, prompt, sampling, first) -> None:
        self.continued.append((request_id, first))


def _gateway(with_transfer: bool) -> RequestGateway:
    transfer = None
    if with_transfer:
        layout = SimpleNamespace(num_layers=2)
        transfer = SimpleNamespace(connector=SimpleNamespace(layout=layout))
    return RequestGateway(FakeEngine(), "decode", "d", transfer)  # type: ignore[arg-type]


class _Transfer:
    """A KV transfer whose link policy says `source` (kv_transfer.KVTransfer.decide_source)."""

    def __init__(self, source: str = "transfer") -> None:
        self.source, self.sources = source, None
        self.asked: list[int] = []

    def decide_source(self, handoff, num_prompt_tokens: int) -> str:
        self.asked.append(num_prompt_tokens)
        return self.source


def test_the_kind_of_a_handoff() -> None:
    transfer, followers = _Transfer(), {"r"}
    assert handoff_kind(_message(), None, None) == "recompute"  # no transfer
    assert handoff_kind(_message(keys=()), transfer, None) == "recompute"  # nothing saved
    assert handoff_kind(_message(), transfer, set()) == "load"
    spans = [ShmSpan(64, 0, 1)]
    assert handoff_kind(_message(segment=SEGMENT, spans=spans), transfer,
                        set()) == "in_place"
    assert handoff_kind(_message(segment=SEGMENT, spans=spans), transfer, followers) == \
        "followed"
    assert len(transfer.asked) == 1  # only the hand-off whose KV would cross a link
    # the link policy's choice: a store read is a load (the store read first), a recompute
    # moves nothing
    assert handoff_kind(_message(), _Transfer("store"), None) == "load"
    assert handoff_kind(_message(), _Transfer("recompute"), None) == "recompute"


@pytest.mark.parametrize(("kind", "path"), [
    ("followed", [Followed, InPlace, HeldPrefix, Loaded]),
    ("in_place", [InPlace, HeldPrefix, Loaded]),
    ("load", [HeldPrefix, Loaded]),
    ("recompute", [Recomputed]),
])
def test_each_kind_tries_its_admissions_in_order(kind: str, path: list[type]) -> None:
    assert kind in KINDS
    admissions = _gateway(with_transfer=True).path(kind)
    assert [type(a) for a in admissions] == path
    assert [a.kind for a in admissions] == [cls.kind for cls in path]


def test_a_handoff_without_a_transfer_is_recomputed() -> None:
    gateway = _gateway(with_transfer=False)
    gateway.add(_message())
    assert gateway.engine.continued == [("r", [7])]
    assert gateway.path("load") == [gateway.recomputed]  # whatever the kind
    assert not gateway.is_busy and gateway.poll() == []
