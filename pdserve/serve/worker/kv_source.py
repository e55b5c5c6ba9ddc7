"""Decode: where a handed-off request's KV comes from, per request (the engine-aware half of
pdserve/handoff/link_policy.py): the policy's inputs that only the engine knows (this worker's
prefill seconds per token), the one call the admission makes (`choose`, side-effect free),
and the counts of what was chosen (`note`; WorkerStatus.kv_transfer
`handoff_source_<choice>`, `pdserve:kv_handoff_source_choices` on the router's /metrics).

    hand-off (or a FollowPrefill) from another host
      └► KVSources.choose(prompt tokens, blocks, source)
           transfer   follow the staging / load the offer from the prefill's node (today's)
           store      load it, the fleet store read first (the node serves what it lacks)
           recompute  no bytes move: the prompt is computed here (admission Recomputed)

A same-host hand-off (a segment to map) moves no bytes over a link and is not asked.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

from pdserve.handoff.link_policy import KV_SOURCES, KVSource, KVSourcePolicy
from pdserve.protocol.worker import StepSample

MIN_PREFILL_TOKENS = 16
"""Steps that computed fewer prompt tokens say more about the step's fixed cost than about a
token's: not counted."""


def prefill_s_per_token(samples: Iterable[StepSample],
                        measured: float | None = None) -> float | None:
    """This worker's prefill seconds per prompt token: `measured` where the host tier's cost
    rule has it (TierCosts, prefill-only steps), else the median over recent steps that
    computed at least MIN_PREFILL_TOKENS prompt tokens of (step seconds, less a decode-only
    step's median where the step also decoded) / prompt tokens; None where no such step ran
    (a decode worker that never computed a prompt: the policy's rule 2 then recomputes one,
    which measures it, where a transfer is slow)."""
    if measured:
        return measured
    samples = list(samples)
    decode_only = [s.seconds for s in samples if s.num_decode_seqs and not s.num_prefill_tokens]
    decode_s = statistics.median(decode_only) if decode_only else 0.0
    rates = [max(0.0, s.seconds - (decode_s if s.num_decode_seqs else 0.0))
             / s.num_prefill_tokens
             for s in samples if s.num_prefill_tokens >= MIN_PREFILL_TOKENS]
    rates = [rate for rate in rates if rate > 0]
    return statistics.median(rates) if rates else None


class EnginePrefillSpeed:
    """An engine's prefill seconds per token (prefill_s_per_token over its host tier's measure
    and its recent steps), the last one known kept: a decode worker's recompute ages out of
    its step samples within a few hundred decode steps, and is not forgotten with them."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.s_per_token: float | None = None

    def __call__(self) -> float | None:
        offload = getattr(self.engine, "kv_offload", None)
        measured = offload.costs.prefill_s_per_token if offload is not None else None
        fresh = prefill_s_per_token(self.engine.step_samples, measured)
        if fresh is not None:
            self.s_per_token = fresh
        return self.s_per_token


class KVSources:
    """A decode worker's choice of KV source per hand-off, and its counts."""

    def __init__(self, policy: KVSourcePolicy, block_bytes: int,
                 prefill_speed: Callable[[], float | None]) -> None:
        """`prefill_speed()`: this worker's prefill seconds per token now (None: unknown)."""
        self.policy = policy
        self.block_bytes = block_bytes
        self._prefill_speed = prefill_speed
        self.counts: dict[KVSource, int] = dict.fromkeys(KV_SOURCES, 0)

    def choose(self, num_prompt_tokens: int, num_blocks: int, source: str,
               during_prefill: bool = False) -> KVSource:
        """Where the KV of a prompt of `num_prompt_tokens` (`num_blocks` blocks offered at
        `source`) comes from; counts nothing. `during_prefill`: asked as the prefill's
        forward starts (a follow), whose time — this worker's prefill speed standing in for
        the prefill worker's — hides as much of a transfer."""
        speed = self._prefill_speed()
        overlap_s = num_prompt_tokens * speed if during_prefill and speed else 0.0
        return self.policy.choose(num_prompt_tokens, num_blocks * self.block_bytes, source,
                                  speed, overlap_s=overlap_s)

    def note(self, choice: KVSource) -> None:
        """A hand-off took `choice` (once per hand-off)."""
        self.counts[choice] += 1

    def totals(self) -> dict[str, float]:
        """Choice counts and each peer's measured rate, for WorkerStatus.kv_transfer."""
        totals = {f"handoff_source_{name}": float(count) for name, count in self.counts.items()}
        speed = self._prefill_speed()
        totals["recompute_prefill_tokens_per_s"] = 1.0 / speed if speed else 0.0
        totals.update(self.policy.links.as_status())
        return totals
