"""The worker's request gateway: requests in from the wire, deltas out to it, and the KV that
crosses between prefill and decode in the middle.

    GenerateRequest ─► add ─┬─ new prompt ─────────────► engine (prefill: maybe a store prefix
                            │                                      load first, see below)
                            └─ with a KVHandoff (decode) ─► load the prompt's KV ─► engine
    engine RequestOutput ─► to_wire ─► Output        (a prefill hand-off is held until its
                                                      save completed: poll releases it)

How a handed-off request joins the batch is admission.py's: one class per path (followed, in
place, held prefix, loaded, recomputed), chosen by the hand-off's kind. The gateway keeps the
prefill outputs held for their save, the request phases, and the role policy
(pdserve/serve/engine/roles.py), which it swaps on a role flip. A prefill worker with a store
also loads a prompt's prefix from the store when the store holds more of it than the worker's
own prefix cache and host tier (a colocated worker too, the store being the tier below its
host DRAM: pdserve/serve/engine/kv_tiers.py), where the cost rule finds that faster than
recomputing it. Every failure of the store is a miss: the request recomputes what did not
arrive (the KV cache is a cache).

A request's first Output also says how long it spent in this worker's phases (Output.
phase_seconds, see protocol/worker.py), from its arrival here and the engine's stamps:

    arrived ─ queue ─► first scheduled ─ prefill ─► first token sampled ─ kv_save ─► sent
                                         (layer_save: the part of the prefill interval spent
                                          in the per-layer KV save hook, taken out of prefill)
    arrived ─ kv_load ─► first scheduled ─ first_decode ─► first token sampled   (decode)

On one host the decode side can start before the hand-off: a prefill worker announces each
save that stages in its shared memory segment (Output.staging, sent as the forward stages its
first layer: follow.py's StagingAnnouncer), the router forwards it (FollowPrefill), and the
decode worker reserves blocks and copies the layers as they land (pdserve/serve/worker/follow.py);
the hand-off then only finishes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from pdserve.protocol.worker import (
    FollowPrefill,
    GenerateRequest,
    KVHandoff,
    Output,
    TokenLogprob,
)
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.prompt_logprobs import wants_prompt_logits, wire_prompt_logprobs
from pdserve.serve.engine.request import RequestOutput
from pdserve.serve.engine.roles import make_role
from pdserve.serve.worker.admission import Admission, Admissions, Recomputed, handoff_kind
from pdserve.serve.worker.follow import Followers, StagingAnnouncer
from pdserve.serve.worker.kv_transfer import KVTransfer, TransferDone

logger = logging.getLogger(__name__)

ANSWER_HOLD_S = 0.2
"""Decode: the longest a finished request's last Output waits for its answer's blocks to reach
the store (KVTransfer.save_answer). A put to a store on the same host or network takes
milliseconds; past this the store is slow or gone, and the last token goes out anyway."""


def check_kv_cache_dtype(handoff: KVHandoff, mine: str) -> None:
    """Refuse a hand-off whose blocks hold another dtype than this worker's cache (an FP8
    prefill worker paired with a bf16 decode worker): its bytes cannot be read here."""
    if handoff.kv_cache_dtype and handoff.block_keys and handoff.kv_cache_dtype != mine:
        raise ValueError(
            f"KV hand-off from prefill worker {handoff.prefill_worker_id or '?'} holds "
            f"{handoff.kv_cache_dtype} blocks but this decode worker's KV cache is {mine}: "
            "start prefill and decode workers with the same --kv-cache-dtype")


class RequestGateway:
    """A worker's requests between the wire and its engine: add (new, or handed off: through
    the admission its hand-off's kind chooses), abort, poll (finished transfers: saved
    hand-offs out, loaded requests in), to_wire (engine deltas out, a prefill's held for its
    save), and the role flip."""

    def __init__(self, engine: Engine, role: str, worker_id: str,
                 kv_transfer: KVTransfer | None = None,
                 announcer: StagingAnnouncer | None = None) -> None:
        """`kv_transfer`: the worker's KV hand-off (pdserve/serve/worker/kv_transfer.py
        make_kv_transfer; None: decode recomputes prompts); `announcer`: what its connector
        calls as a prefill's save starts staging (given to that transfer as it was made)."""
        self.engine = engine
        self.worker_id = worker_id
        self.kv_transfer = kv_transfer
        self.announcer = announcer
        self._held: dict[str, RequestOutput] = {}  # prefill: hand-offs waiting for the save
        # decode: last Outputs waiting for their answer's put, until a time.monotonic()
        self._held_answers: dict[str, tuple[RequestOutput, float]] = {}
        self._write_backs: list[Callable[[], None] | None] = []  # started at the next poll
        # request id -> (time.monotonic() it arrived here, whether it was handed off to this
        # worker), until its first Output reports its phases
        self._arrivals: dict[str, tuple[float, bool]] = {}
        self.recomputed = Recomputed(engine)
        self.admissions = (Admissions(engine, kv_transfer, self.recomputed)
                           if kv_transfer is not None else None)
        """How handed-off requests join the batch (None without a KV transfer: recomputed)."""
        engine.set_role(make_role(role, kv_transfer))

    def path(self, kind: str) -> list[Admission]:
        """The admissions a hand-off of `kind` tries, in order (admission.py)."""
        return [self.recomputed] if self.admissions is None else self.admissions.path(kind)

    @property
    def _followers(self) -> Followers | None:
        return self.admissions.followers if self.admissions is not None else None

    @property
    def _kv_cache_dtype(self) -> str:
        """What this worker's KV blocks hold (its layout's dtype)."""
        return self.engine.spec.kv_layout(self.engine.block_manager.block_size).dtype

    @property
    def role(self) -> str:
        return self.engine.role.name

    @property
    def borrowing_cores(self) -> bool:
        """Prefill: this worker runs on an idle decode worker's cores now (StagingAnnouncer)."""
        return self.announcer is not None and self.announcer.borrowing_cores

    @borrowing_cores.setter
    def borrowing_cores(self, value: bool) -> None:
        if self.announcer is not None:
            self.announcer.borrowing_cores = value

    @property
    def num_loading(self) -> int:
        """Requests not in the engine yet: KV loading, or loaded and waiting for blocks."""
        return self.admissions.loaded.num_loading if self.admissions is not None else 0

    @property
    def is_busy(self) -> bool:
        """Something is held, loading or waiting for blocks."""
        return bool(self._held) or bool(self._held_answers) or (
            self.admissions is not None and self.admissions.is_busy)

    @property
    def copy_early(self) -> bool:
        """Whether a followed prefill's layers are copied as they land
        (pdserve/serve/worker/follow.py)."""
        return self._followers is None or self._followers.copy_early

    @copy_early.setter
    def copy_early(self, value: bool) -> None:
        if self._followers is not None:
            self._followers.copy_early = value

    @property
    def is_following(self) -> bool:
        """A followed prefill has layers still to come: the loop should look again soon."""
        return self._followers is not None and self._followers.has_layers_to_copy

    @property
    def must_poll(self) -> bool:
        """poll() has work now, without a transfer finishing: a loaded request waits for blocks
        (engine steps free them), a lease waits to be given back, a sent hand-off's write-back
        waits to start, or a save failed in this thread. The loop must not sleep;
        for transfers in flight it sleeps on `wakeup_fd`."""
        admissions, kv_transfer = self.admissions, self.kv_transfer
        return bool(self._write_backs) or (
            admissions is not None and bool(admissions.loaded.num_waiting_for_blocks
                                            or admissions.leases)) or (
            kv_transfer is not None and kv_transfer.has_failed)

    def next_deadline_s(self) -> float | None:
        """The earliest time.monotonic() at which poll() has work with nothing arriving: a
        held answer's last output going out anyway (None: none)."""
        return min((deadline for _, deadline in self._held_answers.values()), default=None)

    @property
    def wakeup_fd(self) -> int | None:
        """Readable once a transfer finished (None without a KV transfer)."""
        return None if self.kv_transfer is None else self.kv_transfer.connector.wakeup_fd

    # ---- requests in ------------------------------------------------------------------------
    def add(self, message: GenerateRequest) -> None:
        """Start a request; raises (ValueError, RequestRejectedError, ...) when it can't be
        served, which is that request's error, not the worker's."""
        arrived_s = time.monotonic()
        if message.handoff is not None:
            try:
                self._add_handed_off(message)
            finally:  # a follow the hand-off did not take (no keys, refused, ...) lets go
                admissions = self.admissions
                if admissions is not None and not admissions.followed.is_waiting(
                        message.request_id):
                    admissions.followers.drop(message.request_id)
        else:
            self._add_new(message)
        self._arrivals[message.request_id] = (arrived_s, message.handoff is not None)

    def follow(self, message: FollowPrefill) -> None:
        """Start copying a prompt that a prefill worker on this host is staging now
        (pdserve/serve/worker/follow.py); where that cannot be, its hand-off takes the usual
        path."""
        if self._followers is None or self.role != "decode":
            return
        if not self._followers.start(message, self._kv_cache_dtype):
            logger.debug("not following %s (cannot map, reserve, or not this layout)",
                         message.request_id)

    def _add_new(self, message: GenerateRequest) -> None:
        """From the prompt; or, migrated from a worker that died (resume_output_ids), from
        the prompt and the outputs it streamed, recomputed after the prompt's stored prefix;
        a request of several sequences by choice (resume_choices: one parent, forked)."""
        if message.resume_choices:
            self.engine.parallel.add_continued(message.request_id, message.prompt_token_ids,
                                               message.sampling, message.resume_choices)
            return
        request = self.engine.make_request(message.prompt_token_ids, message.sampling,
                                           message.request_id, message.resume_output_ids)
        # (prompt logprobs need the whole prompt computed here: no stored prefix)
        kv_transfer, admissions = self.kv_transfer, self.admissions
        if kv_transfer is not None and admissions is not None and not wants_prompt_logits(
                request) and (self.role != "decode" or message.resume_output_ids):
            keys = kv_transfer.store_prefix_keys(request)
            if keys:
                admissions.loaded.start(message, keys)
                return
        self.engine.submit(request)

    def _add_handed_off(self, message: GenerateRequest) -> None:
        """Continue a request that a prefill worker started, through the first admission of
        its kind's path that takes it (admission.py)."""
        handoff = message.handoff
        assert handoff is not None
        check_kv_cache_dtype(handoff, self._kv_cache_dtype)
        kind = handoff_kind(message, self.kv_transfer, self._followers)
        if kind != "recompute":
            self.engine.make_request(message.prompt_token_ids, message.sampling)  # validate
        for admission in self.path(kind):
            if admission.admit(message):
                return
        raise AssertionError(f"no admission took {message.request_id}")  # (Loaded takes all)

    def abort(self, request_id: str) -> None:
        if self.admissions is not None:
            self.admissions.drop(request_id)
        self._held.pop(request_id, None)
        self._held_answers.pop(request_id, None)
        self._forget_arrival(request_id)
        if self.kv_transfer is not None:
            self.kv_transfer.forget(request_id)
        self.engine.abort_request(request_id)

    def _forget_arrival(self, request_id: str) -> None:
        """The request leaves with no phases to report (aborted, or an error)."""
        self._arrivals.pop(request_id, None)
        self._take_layer_save_s(request_id)

    # ---- transfers --------------------------------------------------------------------------
    def poll(self) -> list[Output]:
        """Finish what the store completed: the hand-offs whose save ended (to send), and
        requests whose KV arrived (into the engine; an error Output if that fails)."""
        admissions, kv_transfer = self.admissions, self.kv_transfer
        if admissions is None or kv_transfer is None:
            return []
        outputs: list[Output] = []
        if admissions.followers:
            admissions.followers.copy_ready()
            outputs += admissions.followed.admit_pulled(self._add_handed_off,
                                                        self._forget_arrival)
        admissions.leases.give_back()
        for job in self._write_backs:  # their hand-offs went out after the last poll
            kv_transfer.start_write_back(job)
        self._write_backs = []
        outputs += admissions.loaded.admit_waiting(self._forget_arrival)
        now_s = time.monotonic()
        for request_id, (output, deadline_s) in list(self._held_answers.items()):
            if now_s >= deadline_s:  # the store is slow: the last token goes out anyway
                del self._held_answers[request_id]
                outputs.append(self._wire_output(output, [], None))
        for done in kv_transfer.poll():
            if done.kind == "save":
                outputs += self._saved(done)
            elif done.kind == "answer":
                held = self._held_answers.pop(done.request_id, None)
                if held is not None:
                    outputs.append(self._wire_output(held[0], [], None))
            else:
                outputs += admissions.loaded.finished(done, self._forget_arrival)
        return outputs

    def _saved(self, done: TransferDone) -> list[Output]:
        """A prefill's save ended: its held hand-off goes out, naming the saved blocks."""
        assert self.kv_transfer is not None
        output = self._held.pop(done.request_id, None)
        if output is not None and done.ok:
            # the store's copy once the hand-off is sent: before, its CPU would be taken from
            # this loop's turn that sends it
            self._write_backs.append(done.write_back)
            return [self._wire_output(output, done.keys, done.lease_id, done.source, done)]
        # finished at its first token, aborted, or the save failed
        self.kv_transfer.release(done.lease_id, done.source)
        self.kv_transfer.start_write_back(done.write_back)
        return [self._wire_output(output, [], None)] if output is not None else []

    # ---- deltas out -------------------------------------------------------------------------
    def to_wire(self, output: RequestOutput) -> Output | None:
        """The Output for an engine delta; None for a prefill hand-off, which waits for its
        save, and for decode's last Output while its answer goes to the store: both come
        out of poll()."""
        kv_transfer = self.kv_transfer
        if output.kv_handoff is not None and kv_transfer is not None:
            self._held[output.request_id] = output
            return None
        if output.finished and kv_transfer is not None and kv_transfer.is_saving_answer(
                output.request_id):  # the next turn must find the answer: see ANSWER_HOLD_S
            self._held_answers[output.request_id] = (output, time.monotonic() + ANSWER_HOLD_S)
            return None
        return self._wire_output(output, [], None)

    def _wire_output(self, output: RequestOutput, saved_keys: list[bytes],
                     lease_id: int | None, source: str = "",
                     saved: TransferDone | None = None) -> Output:
        """`saved_keys`: what decode loads (empty: the save failed or there is no store, and
        decode recomputes the prompt); `saved`: the save, which may say where the blocks lie
        in this worker's shared memory segment."""
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [
                TokenLogprob(token_id, entry[token_id].logprob,
                             {t: lp.logprob for t, lp in entry.items()})
                for token_id, entry in zip(completion.token_ids, completion.logprobs,
                                           strict=False)
            ]
        handoff: KVHandoff | None = None
        if output.kv_handoff is not None:
            spans = saved.shm_spans if saved is not None else None
            handoff = replace(output.kv_handoff, block_keys=saved_keys,
                              prefill_worker_id=self.worker_id, lease_id=lease_id or 0,
                              source_address=source, kv_cache_dtype=self._kv_cache_dtype,
                              shm_segment=saved.shm_segment if spans else None,
                              shm_spans=spans or [])
        return Output(output.request_id, list(completion.token_ids), completion.text,
                      completion.finish_reason, logprobs, len(output.prompt_token_ids),
                      output.num_cached_tokens, handoff,
                      phase_seconds=self._phase_seconds(output), index=completion.index,
                      prompt_logprobs=wire_prompt_logprobs(output.prompt_logprobs,
                                                           output.prompt_token_ids))

    def _phase_seconds(self, output: RequestOutput) -> dict[str, float]:
        """The request's phases on this worker, once: on its first Output (empty after)."""
        arrival = self._arrivals.pop(output.request_id, None)
        layer_save_s = self._take_layer_save_s(output.request_id)
        scheduled_s, sampled_s = output.first_scheduled_s, output.first_sampled_s
        if arrival is None or scheduled_s is None or sampled_s is None:
            return {}
        arrived_s, is_handed_off = arrival
        if is_handed_off:
            return {"kv_load": max(0.0, scheduled_s - arrived_s),
                    "first_decode": max(0.0, sampled_s - scheduled_s)}
        phases = {"queue": max(0.0, scheduled_s - arrived_s),
                  "prefill": max(0.0, sampled_s - scheduled_s - layer_save_s)}
        if layer_save_s > 0:
            phases["layer_save"] = layer_save_s
        if output.kv_handoff is not None and self.kv_transfer is not None:  # held for the save
            phases["kv_save"] = max(0.0, time.monotonic() - sampled_s)
        return phases

    def _take_layer_save_s(self, request_id: str) -> float:
        if self.kv_transfer is None:
            return 0.0
        return self.kv_transfer.take_layer_save_s(request_id)

    # ---- role -------------------------------------------------------------------------------
    def can_switch_role(self) -> bool:
        """Only a drained prefill or decode worker flips: nothing in the engine, held for a
        save, or loading."""
        return (self.engine.role.can_flip and not self.engine.has_unfinished_requests()
                and not self.is_busy)

    def switch_role(self, role: str) -> None:
        """Become a `role` worker; the KV transfer (or its absence) stays."""
        if not self.can_switch_role():
            raise RuntimeError(f"{self.worker_id} cannot switch role now")
        self.engine.set_role(make_role(role, self.kv_transfer))

    def describe_in_flight(self) -> str:
        admissions = self.admissions
        num_waiting = admissions.loaded.num_waiting_for_blocks if admissions is not None else 0
        return (f"{len(self._held)} hand-offs saving, {self.num_loading - num_waiting} loads, "
                f"{num_waiting} waiting for KV blocks")
