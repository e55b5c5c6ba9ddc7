"""Where one request's time goes, phase by phase (vLLM's request-phase metrics, split across
the router and the workers).

Every duration is taken on one process's own clock: the router times what it sees (arrival,
a request sent, an Output received, the first token handed to the client) and each worker
times its own phases and reports them in its first Output (Output.phase_seconds). The wire
between them is what is left: the router's send-to-receive interval less the worker's phases.

    first token (TTFT):
    router arrival ─ router ─► request sent ─ [queue ─ prefill ─ layer_save ─ kv_save]
        ─ transport ─► Output received ─ first_token_out ─► to the client
    ([...]: the worker's phases; transport: the send-to-receive interval less them)
    after it (disaggregated only; not part of TTFT: the decode worker is asked only once the
    first token went out):
    prefill Output received ─ second_dispatch ─► decode request sent ─ kv_load ─ first_decode
        ─ decode_transport ─► decode Output received
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.worker import KVHandoff, Output

TTFT_PHASES = ("router", "queue", "prefill", "layer_save", "kv_save", "transport",
               "first_token_out")
"""The phases of the first-token path, in order; they add up to the router's TTFT."""
ROUTER_PHASES = ("router", "transport", "first_token_out")
"""The first-token phases outside the first worker's own accounting: what the router (and the
wire to the worker, and the worker's wait to read the request) adds to the TTFT."""
HANDOVER_PHASES = ("second_dispatch", "kv_load", "first_decode", "decode_transport")
"""The prefill -> decode hand-over, from the prefill Output to the decode worker's first."""


@dataclass(frozen=True)
class Migration:
    """The request moved off a worker that died or hung (pdserve/router/dispatch.py)."""

    at_s: float
    role: str
    from_worker_id: str
    is_resumed: bool
    """It had streamed outputs: the next worker resumes after them."""
    reason: str


@dataclass
class WorkerLeg:
    """One worker's part of a request, as the router saw it (time.monotonic seconds)."""

    sent_s: float | None = None
    received_s: float | None = None
    """When its first Output arrived."""
    worker_phases: dict[str, float] = field(default_factory=dict)
    worker_id: str = ""
    """The worker it was sent to (after a migration: the last one)."""
    handoff: KVHandoff | None = None
    """Prefill's hand-off, from its first Output (disaggregated)."""
    migrations: list[Migration] = field(default_factory=list)
    """Each worker this leg moved off, in order (request tracing reports them)."""

    def on_sent(self, sent_s: float, worker_id: str = "") -> None:
        self.sent_s, self.received_s, self.worker_phases = sent_s, None, {}
        self.worker_id, self.handoff = worker_id, None

    def on_output(self, output: Output, received_s: float) -> None:
        if self.received_s is None:
            self.received_s = received_s
            self.worker_phases = dict(output.phase_seconds)
            self.handoff = output.handoff

    def on_migration(self, migration: Migration) -> None:
        self.migrations.append(migration)

    @property
    def is_complete(self) -> bool:
        return self.sent_s is not None and self.received_s is not None

    def transport_s(self) -> float:
        """The send-to-first-Output interval less what the worker accounted for: sockets,
        codec, the worker loop's wait to read the request, and the worker's own tail."""
        assert self.sent_s is not None and self.received_s is not None
        worker_s = sum(self.worker_phases.values())
        return max(0.0, self.received_s - self.sent_s - worker_s)


@dataclass
class RequestPhases:
    """One request's phases: the dispatcher fills its legs, the streamer the first-token time.
    """

    arrival_s: float
    first: WorkerLeg = field(default_factory=WorkerLeg)
    """The prefill (or colocated) worker."""
    decode: WorkerLeg = field(default_factory=WorkerLeg)
    """The decode worker (disaggregated, when prefill handed the request off)."""

    def ttft_phases(self, first_token_s: float) -> dict[str, float]:
        """The first-token phases (TTFT_PHASES that happened), given when the first token
        went to the client; empty if the first worker never answered."""
        first = self.first
        if not first.is_complete:
            return {}
        assert first.sent_s is not None and first.received_s is not None
        phases = {"router": first.sent_s - self.arrival_s}
        for name in ("queue", "prefill", "layer_save", "kv_save"):
            if name in first.worker_phases:
                phases[name] = first.worker_phases[name]
        phases["transport"] = first.transport_s()
        phases["first_token_out"] = first_token_s - first.received_s
        return {name: max(0.0, seconds) for name, seconds in phases.items()}

    def handover_phases(self) -> dict[str, float]:
        """The hand-over phases (HANDOVER_PHASES), empty unless a decode worker answered."""
        first, decode = self.first, self.decode
        if not (first.is_complete and decode.is_complete):
            return {}
        assert first.received_s is not None and decode.sent_s is not None
        phases = {"second_dispatch": decode.sent_s - first.received_s}
        for name in ("kv_load", "first_decode"):
            if name in decode.worker_phases:
                phases[name] = decode.worker_phases[name]
        phases["decode_transport"] = decode.transport_s()
        return {name: max(0.0, seconds) for name, seconds in phases.items()}
