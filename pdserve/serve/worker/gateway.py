"""The worker's request gateway: requests in from the wire, deltas out to it, and the KV that
crosses between prefill and decode in the middle.

    GenerateRequest ─► add ─┬─ new prompt ─────────────► engine (prefill: maybe a store prefix
                            │                                      load first, see below)
                            └─ with a KVHandoff (decode) ─► load the prompt's KV ─► engine
    engine RequestOutput ─► to_wire ─► Output        (a prefill hand-off is held until its
                                                      save completed: poll releases it)

It owns what the hand-off needs between engine steps: the prefill outputs held for their
save, the requests whose KV is loading, those whose KV arrived while no blocks were free
(they wait, in arrival order, for the running requests to free some: a worker queues rather
than refuses), and the role policy (pdserve/serve/engine/roles.py), which it swaps on a role flip. A
prefill worker with a store also loads a prompt's prefix from the store when the store holds
more of it than the worker's own prefix cache and host tier (a colocated worker too, the
store being the tier below its host DRAM: pdserve/serve/engine/kv_tiers.py), where the cost rule
finds that faster than recomputing it. Every failure of the store is a miss: the request
recomputes what did not arrive (the KV cache is a cache).

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
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from pdserve.protocol.worker import (
    FollowPrefill,
    GenerateRequest,
    KVHandoff,
    Output,
    TokenLogprob,
)
from pdserve.serve.engine.block_manager import NoFreeBlocksError
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.prompt_logprobs import wants_prompt_logits, wire_prompt_logprobs
from pdserve.serve.engine.request import RequestOutput
from pdserve.serve.engine.roles import make_role
from pdserve.serve.worker.follow import Followers, StagingAnnouncer
from pdserve.serve.worker.kv_transfer import KVTransfer, TransferDone

logger = logging.getLogger(__name__)


def check_kv_cache_dtype(handoff: KVHandoff, mine: str) -> None:
    """Refuse a hand-off whose blocks hold another dtype than this worker's cache (an FP8
    prefill worker paired with a bf16 decode worker): its bytes cannot be read here."""
    if handoff.kv_cache_dtype and handoff.block_keys and handoff.kv_cache_dtype != mine:
        raise ValueError(
            f"KV hand-off from prefill worker {handoff.prefill_worker_id or '?'} holds "
            f"{handoff.kv_cache_dtype} blocks but this decode worker's KV cache is {mine}: "
            "start prefill and decode workers with the same --kv-cache-dtype")


class RequestGateway:
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
        self._followers = Followers(engine, kv_transfer) if kv_transfer is not None else None
        self._held: dict[str, RequestOutput] = {}  # prefill: hand-offs waiting for the save
        # Requests whose KV (decode: the whole prompt; prefill: a stored prefix) is loading,
        # and those loaded while no blocks were free.
        self._loading: dict[str, GenerateRequest] = {}
        self._waiting_for_blocks: deque[tuple[GenerateRequest, TransferDone]] = deque()
        # decode: hand-offs loading only the blocks this worker lacks, and their reservation
        # (KVTransfer.hold_prefix: the blocks, how many are held here)
        self._holding: dict[str, tuple[list[int], int]] = {}
        # leases of hand-offs admitted in place (their blocks copied from a mapped segment),
        # given back one loop later, after the step that admitted them: at admission, the
        # release's round trip would compete with that step for the core
        self._releases: list[tuple[int, str]] = []
        self._releases_due: list[tuple[int, str]] = []
        self._write_backs: list[Callable[[], None] | None] = []  # started at the next poll
        # decode: hand-offs of pulled follows whose last layers are still crossing
        self._follow_waiting: dict[str, GenerateRequest] = {}
        # request id -> (time.monotonic() it arrived here, whether it was handed off to this
        # worker), until its first Output reports its phases
        self._arrivals: dict[str, tuple[float, bool]] = {}
        engine.set_role(make_role(role, kv_transfer))

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
        return len(self._loading) + len(self._waiting_for_blocks)

    @property
    def is_busy(self) -> bool:
        """Something is held, loading or waiting for blocks."""
        return bool(self._held or self._loading or self._waiting_for_blocks or self._releases
                    or self._releases_due or self._followers or self._follow_waiting)

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
        return bool(self._waiting_for_blocks or self._releases or self._releases_due
                    or self._write_backs) or (
            self.kv_transfer is not None and self.kv_transfer.has_failed)

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
                if (self._followers is not None
                        and message.request_id not in self._follow_waiting):
                    self._followers.drop(message.request_id)
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
        if self.kv_transfer is not None and not wants_prompt_logits(request) and (
                self.role != "decode" or message.resume_output_ids):
            keys = self.kv_transfer.store_prefix_keys(request)
            if keys:
                self.kv_transfer.start_load(message.request_id, keys)
                self._loading[message.request_id] = message
                return
        self.engine.submit(request)

    def _add_handed_off(self, message: GenerateRequest) -> None:
        """Continue a request that a prefill worker started: with a store, its KV loads in
        the background and it joins the batch once it arrived; else it recomputes."""
        handoff = message.handoff
        assert handoff is not None
        check_kv_cache_dtype(handoff, self._kv_cache_dtype)
        if self.kv_transfer is not None and handoff.block_keys:
            self.engine.make_request(message.prompt_token_ids, message.sampling)  # validate
            if self._admit_followed(message) or self._admit_in_place(message):
                return
            keys = list(handoff.block_keys)
            held = None if handoff.choice_first_tokens else self.kv_transfer.hold_prefix(
                message.request_id, len(keys), keys)
            if held is not None:  # only the blocks this worker lacks cross
                self._holding[message.request_id] = held
                keys = keys[held[1]:]
                if not keys:  # every block is here
                    self._releases.append((handoff.lease_id, handoff.source_address))
                    self._admit_loaded(message, TransferDone(message.request_id, "load", True,
                                                             []))
                    return
            self.kv_transfer.start_load(message.request_id, keys, handoff.lease_id,
                                        handoff.source_address)
            self._loading[message.request_id] = message
            return
        if handoff.choice_first_tokens:  # n > 1: one parent, forked once its prompt is in
            self.engine.parallel.add_continued(message.request_id, message.prompt_token_ids,
                                               message.sampling,
                                               _as_given(handoff.choice_first_tokens))
            return
        self.engine.add_continued_request(message.request_id, message.prompt_token_ids,
                                          message.sampling, [handoff.first_token_id])

    def _admit_followed(self, message: GenerateRequest) -> bool:
        """A hand-off whose prompt was copied while its prefill ran (follow): the blocks
        reserved then join the batch now. False where it was not followed."""
        handoff = message.handoff
        assert handoff is not None and self._followers is not None
        start_s = time.monotonic()
        if self._followers.pending(message.request_id, handoff):  # its last layers cross
            self._follow_waiting[message.request_id] = message
            return True
        followed = self._followers.finish(message.request_id, handoff)
        if followed is None:
            return False
        block_ids, intact, pulled = followed
        lease = (handoff.lease_id, handoff.source_address)
        self._releases.append(lease)  # read or not, the lease goes back
        try:
            self.engine.add_prefilled_request(message.request_id, message.prompt_token_ids,
                                              message.sampling, [handoff.first_token_id],
                                              block_ids)
        except Exception:  # the request's error (add reports it)
            self.engine.block_manager.unreserve(message.request_id)
            raise
        self._recompute_unless(intact, message)
        self.kv_transfer.note_in_place(time.monotonic() - start_s, followed=True,
                                       pulled=pulled)
        return True

    def _admit_in_place(self, message: GenerateRequest) -> bool:
        """A hand-off whose blocks lie in the prefill worker's shared memory segment on this
        host joins the batch now: its blocks are copied from there straight into fresh pool
        blocks (one copy, no load job, no request to the prefill worker). False where that
        cannot be (another host, no segment, no free blocks now): load it as usual."""
        handoff = message.handoff
        assert handoff is not None and self.kv_transfer is not None
        start_s = time.monotonic()
        mapped = self.kv_transfer.map_handoff(handoff)
        if mapped is None:
            return False
        layers, intact = mapped
        done = TransferDone(message.request_id, "load", True, list(handoff.block_keys), layers)
        lease = (handoff.lease_id, handoff.source_address)
        try:
            self._admit_loaded(message, done, can_wait=True)
        except NoFreeBlocksError:
            return False  # the load path waits for blocks
        except Exception:  # the request's error (add reports it); the lease goes back all the same
            self._releases.append(lease)
            raise
        self._recompute_unless(intact, message)
        self._releases.append(lease)
        self.kv_transfer.note_in_place(time.monotonic() - start_s)
        return True

    def _recompute_unless(self, intact: Callable[[], bool], message: GenerateRequest) -> None:
        """After copying a hand-off's blocks out of the prefill worker's segment: if one was
        freed meanwhile (its lease expired), the copy is not the KV, and the request, admitted
        but not yet stepped (so no block key is published), recomputes instead."""
        if intact():
            return
        logger.warning("hand-off blocks of %s were freed while read; recomputing",
                       message.request_id)
        self.engine.abort_request(message.request_id)
        self._admit_loaded(message, TransferDone(message.request_id, "load", False, []))

    def abort(self, request_id: str) -> None:
        self._follow_waiting.pop(request_id, None)
        if self._followers is not None:
            self._followers.drop(request_id)
        if self._holding.pop(request_id, None) is not None:
            self.engine.block_manager.unreserve(request_id)
        self._held.pop(request_id, None)
        self._arrivals.pop(request_id, None)
        self._take_layer_save_s(request_id)
        self._loading.pop(request_id, None)
        self._waiting_for_blocks = deque(
            (message, done) for message, done in self._waiting_for_blocks
            if done.request_id != request_id)
        if self.kv_transfer is not None:
            self.kv_transfer.forget(request_id)
        self.engine.abort_request(request_id)

    # ---- transfers --------------------------------------------------------------------------
    def poll(self) -> list[Output]:
        """Finish what the store completed: the hand-offs whose save ended (to send), and
        requests whose KV arrived (into the engine; an error Output if that fails)."""
        if self.kv_transfer is None:
            return []
        outputs: list[Output] = []
        if self._followers:
            self._followers.copy_ready()
            outputs += self._admit_pulled()
        for lease_id, source in self._releases_due:
            self.kv_transfer.release(lease_id, source)
        self._releases_due, self._releases = self._releases, []
        for job in self._write_backs:  # their hand-offs went out after the last poll
            self.kv_transfer.start_write_back(job)
        self._write_backs = []
        outputs += self._admit_waiting()
        for done in self.kv_transfer.poll():
            if done.kind == "save":
                output = self._held.pop(done.request_id, None)
                if output is not None and done.ok:
                    outputs.append(self._wire_output(output, done.keys, done.lease_id,
                                                     done.source, done))
                    # the store's copy once the hand-off is sent: before, its CPU would be
                    # taken from this loop's turn that sends it
                    self._write_backs.append(done.write_back)
                else:  # finished at its first token, aborted, or the save failed
                    self.kv_transfer.release(done.lease_id, done.source)
                    self.kv_transfer.start_write_back(done.write_back)
                    if output is not None:
                        outputs.append(self._wire_output(output, [], None))
                continue
            message = self._loading.pop(done.request_id, None)
            if message is None:
                continue
            if self._waiting_for_blocks:  # first come, first served
                self._waiting_for_blocks.append((message, done))
                continue
            outputs += self._try_admit(message, done)
        return outputs

    def _admit_pulled(self) -> list[Output]:
        """Hand-offs whose pulled layers were still crossing: those whose pull completed (or
        failed: then they load the usual way) go on."""
        outputs: list[Output] = []
        for request_id, message in list(self._follow_waiting.items()):
            assert message.handoff is not None and self._followers is not None
            if self._followers.pending(request_id, message.handoff):
                continue
            del self._follow_waiting[request_id]
            try:
                self._add_handed_off(message)
            except Exception as exc:  # this request's error, as add() would have raised it
                logger.warning("could not admit %s: %s", request_id, exc)
                self._arrivals.pop(request_id, None)
                outputs.append(Output(request_id, [], "", "error", error=str(exc)))
            finally:
                self._followers.drop(request_id)
        return outputs

    def _admit_waiting(self) -> list[Output]:
        """Admit loaded requests that waited for blocks, in order, while blocks suffice."""
        outputs: list[Output] = []
        while self._waiting_for_blocks:
            message, done = self._waiting_for_blocks.popleft()
            outputs += self._try_admit(message, done)
            if self._waiting_for_blocks and self._waiting_for_blocks[0][1] is done:
                break  # it went back to the front: still no room
        return outputs

    def _try_admit(self, message: GenerateRequest, done: TransferDone) -> list[Output]:
        """Admit one loaded request; an error Output if it can never be; back to the front
        of the wait when no blocks are free now (the running requests will free some)."""
        try:
            self._admit_loaded(message, done, can_wait=True)
        except NoFreeBlocksError:
            self._waiting_for_blocks.appendleft((message, done))
        except Exception as exc:  # e.g. longer than the pool: this request's error
            logger.warning("could not admit %s: %s", done.request_id, exc)
            self.engine.abort_request(done.request_id)
            self._arrivals.pop(done.request_id, None)
            self._take_layer_save_s(done.request_id)
            return [Output(done.request_id, [], "", "error", error=str(exc))]
        return []

    def _admit_loaded(self, message: GenerateRequest, done: TransferDone,
                      can_wait: bool = False) -> None:
        """A load finished: the request joins the batch with its KV, or (a miss) recomputes
        what was not loaded. With `can_wait`, NoFreeBlocksError means "not now" (nothing
        changed); an idle engine has every block free, so there it recomputes instead."""
        engine, request_id, params = self.engine, message.request_id, message.sampling
        assert self.kv_transfer is not None
        if can_wait and not engine.has_unfinished_requests():
            can_wait = False  # nothing will free blocks: do not wait for them
        if message.handoff is None:  # prefill, or a migration: the prompt's prefix
            request = engine.make_request(message.prompt_token_ids, params, request_id,
                                          message.resume_output_ids)
            if done.ok:
                block_size = engine.block_manager.block_size
                try:
                    block_ids = engine.add_request_with_prefix(request,
                                                               len(done.keys) * block_size)
                except NoFreeBlocksError:
                    if can_wait:
                        raise
                else:
                    staging = [t[:, :len(block_ids)] for t in done.staging]
                    self.kv_transfer.install(block_ids, staging)
                    self.kv_transfer.note_store_hit(len(block_ids) * block_size,
                                                    sum(t.nbytes for t in staging), done.seconds)
                    return
            engine.submit(request)  # the scheduler queues it until blocks are free
            return
        first = [message.handoff.first_token_id]  # decode: the whole prompt
        choices = _as_given(message.handoff.choice_first_tokens)  # n > 1: forked
        if self._admit_holding(message, done):
            return
        if done.ok and (not choices or len(message.prompt_token_ids) > 1):
            try:
                if choices:  # all but the prompt's last token, which its first step computes
                    block_ids = engine.parallel.add_prefilled(
                        request_id, message.prompt_token_ids, params, choices)
                else:
                    block_ids = engine.add_prefilled_request(
                        request_id, message.prompt_token_ids, params, first)
            except NoFreeBlocksError:
                if can_wait:
                    raise
                logger.info("no free KV blocks for %s; recomputing its prompt", request_id)
            else:
                staging = [t[:, :len(block_ids)] for t in done.staging]
                self.kv_transfer.install(block_ids, staging)
                self.kv_transfer.note_handoff_bytes(sum(t.nbytes for t in staging))
                return
        elif not done.ok:
            logger.info("KV of %s not in the store; recomputing", request_id)
        if choices:
            engine.parallel.add_continued(request_id, message.prompt_token_ids, params, choices)
            return
        engine.add_continued_request(request_id, message.prompt_token_ids, params, first)

    def _admit_holding(self, message: GenerateRequest, done: TransferDone) -> bool:
        """A hand-off whose leading blocks this worker holds (KVTransfer.hold_prefix: reserved
        before its load, or now, for one mapped in place): the reservation joins the batch
        with the moved blocks written after the held ones. False where none is held (or the
        load missed: the reservation goes back and the request recomputes)."""
        request_id, handoff = message.request_id, message.handoff
        assert handoff is not None and self.kv_transfer is not None
        held, skip = self._holding.pop(request_id, None), 0
        if held is None and done.ok and done.staging and not handoff.choice_first_tokens:
            held = self.kv_transfer.hold_prefix(request_id, len(done.keys), done.keys)
            skip = held[1] if held is not None else 0  # (the staging has every block)
        if held is None:
            return False
        block_ids, num_held = held
        if not done.ok:
            self.engine.block_manager.unreserve(request_id)
            return False
        try:
            self.engine.add_prefilled_request(request_id, message.prompt_token_ids,
                                              message.sampling, [handoff.first_token_id],
                                              block_ids)
        except Exception:  # the request's error (add reports it)
            self.engine.block_manager.unreserve(request_id)
            raise
        if len(block_ids) > num_held:
            staging = [t[:, skip:skip + len(block_ids) - num_held] for t in done.staging]
            self.kv_transfer.install(block_ids[num_held:], staging)
            self.kv_transfer.note_handoff_bytes(sum(t.nbytes for t in staging))
        return True

    # ---- deltas out -------------------------------------------------------------------------
    def to_wire(self, output: RequestOutput) -> Output | None:
        """The Output for an engine delta; None for a prefill hand-off, which waits for its
        save and comes out of poll()."""
        if output.kv_handoff is not None and self.kv_transfer is not None:
            self._held[output.request_id] = output
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
        return (f"{len(self._held)} hand-offs saving, {len(self._loading)} loads, "
                f"{len(self._waiting_for_blocks)} waiting for KV blocks")


def _as_given(choice_first_tokens: dict[int, int]) -> dict[int, list[int]]:
    """A hand-off's first token per choice as the outputs each choice has so far."""
    return {index: [token] for index, token in choice_first_tokens.items()}
