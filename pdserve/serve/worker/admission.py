"""How a handed-off request joins a decode worker's batch: one class per path, chosen by the
hand-off's kind (handoff_kind), each declining (False) where it cannot take it, for the next.

    kind        tried in order                       the request's KV
    followed    Followed ─► InPlace ─► HeldPrefix ─► Loaded
                                                     copied while its prefill ran (follow.py)
    in_place    InPlace ─► HeldPrefix ─► Loaded      copied out of the prefill's segment now
    load        HeldPrefix ─► Loaded                 read over the network (or the store), the
                                                     blocks this worker holds kept
    recompute   Recomputed                           none: the prompt is computed again

Loaded also admits a new prompt's stored prefix (a prefill or a migrated request), and every
path ends in Recomputed where its KV did not arrive whole: the KV cache is a cache. The
hand-off subsystem (pdserve/handoff/) moves the bytes; these classes own the engine's side:
block reservations, NoFreeBlocksError, the requests themselves.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from pdserve.protocol.worker import GenerateRequest, KVHandoff, Output
from pdserve.serve.engine.block_manager import NoFreeBlocksError
from pdserve.serve.engine.engine import Engine
from pdserve.serve.worker.follow import Followers
from pdserve.serve.worker.kv_transfer import KVTransfer, TransferDone

logger = logging.getLogger(__name__)

KINDS = ("followed", "in_place", "load", "recompute")


class Admission(Protocol):
    """One way a handed-off request joins the batch."""

    kind: str

    def admit(self, message: GenerateRequest) -> bool:
        """Take the request (its KV in place, loading, or to recompute); False: declined,
        nothing changed, the next admission of its path tries."""
        ...


def handoff_kind(message: GenerateRequest, kv_transfer: KVTransfer | None,
                 followers: Followers | None) -> str:
    """Which path a handed-off request takes first (KINDS)."""
    handoff = message.handoff
    assert handoff is not None
    if kv_transfer is None or not handoff.block_keys:
        return "recompute"
    if followers is not None and message.request_id in followers:
        return "followed"  # (a pull was chosen as it started: counted once it completes)
    if handoff.shm_segment is not None and handoff.shm_spans:
        return "in_place"
    # over a link: moved, read from the store first, or recomputed, by predicted time
    # (pdserve/serve/worker/kv_source.py)
    if kv_transfer.decide_source(handoff, len(message.prompt_token_ids)) == "recompute":
        return "recompute"
    return "load"


def as_given(choice_first_tokens: dict[int, int]) -> dict[int, list[int]]:
    """A hand-off's first token per choice as the outputs each choice has so far."""
    return {index: [token] for index, token in choice_first_tokens.items()}


class LeaseReturns:
    """Leases of hand-offs admitted from mapped or followed blocks, given back one loop later,
    after the step that admitted them: at admission, the release's round trip would compete
    with that step for the core."""

    def __init__(self, kv_transfer: KVTransfer) -> None:
        self.kv_transfer = kv_transfer
        self._releases: list[tuple[int, str]] = []
        self._due: list[tuple[int, str]] = []

    def __bool__(self) -> bool:
        return bool(self._releases or self._due)

    def add(self, handoff: KVHandoff) -> None:
        self._releases.append((handoff.lease_id, handoff.source_address))

    def give_back(self) -> None:
        """Release those added before the last call (one loop turn ago)."""
        for lease_id, source in self._due:
            self.kv_transfer.release(lease_id, source)
        self._due, self._releases = self._releases, []


class Recomputed:
    """No KV arrives (no transfer, no keys, a miss): the decode worker computes the prompt
    again, continuing from the hand-off's first token (per choice, n > 1)."""

    kind = "recompute"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def admit(self, message: GenerateRequest) -> bool:
        handoff = message.handoff
        assert handoff is not None
        if handoff.choice_first_tokens:  # n > 1: one parent, forked once its prompt is in
            self.engine.parallel.add_continued(message.request_id, message.prompt_token_ids,
                                               message.sampling,
                                               as_given(handoff.choice_first_tokens))
        else:
            self.engine.add_continued_request(message.request_id, message.prompt_token_ids,
                                              message.sampling, [handoff.first_token_id])
        return True

    def unless_intact(self, intact: Callable[[], bool], message: GenerateRequest) -> None:
        """After copying a hand-off's blocks out of the prefill worker's segment: if one was
        freed meanwhile (its lease expired), the copy is not the KV, and the request, admitted
        but not yet stepped (so no block key is published), recomputes instead."""
        if intact():
            return
        logger.warning("hand-off blocks of %s were freed while read; recomputing",
                       message.request_id)
        self.engine.abort_request(message.request_id)
        self.admit(message)


class HeldPrefix:
    """A hand-off whose leading blocks this worker holds already (KVTransfer.hold_prefix:
    its pool or its host tier): they are reserved, and only the rest cross (Loaded)."""

    kind = "held_prefix"

    def __init__(self, engine: Engine, kv_transfer: KVTransfer, leases: LeaseReturns) -> None:
        self.engine = engine
        self.kv_transfer = kv_transfer
        self.leases = leases
        self.loaded: Loaded | None = None
        """Where the blocks not held load (set by Loaded)."""
        self._holding: dict[str, tuple[list[int], int]] = {}  # the blocks, how many held

    def __bool__(self) -> bool:
        return bool(self._holding)

    def admit(self, message: GenerateRequest) -> bool:
        """Reserve the held blocks and load the others; False where none is held (or n > 1)."""
        handoff, loaded = message.handoff, self.loaded
        assert handoff is not None and loaded is not None
        if handoff.choice_first_tokens:
            return False
        keys = list(handoff.block_keys)
        held = self.kv_transfer.hold_prefix(message.request_id, len(keys), keys)
        if held is None:
            return False
        self._holding[message.request_id] = held
        keys = keys[held[1]:]
        if not keys:  # every block is here
            self.leases.add(handoff)
            loaded.admit(message, TransferDone(message.request_id, "load", True, []))
            return True
        loaded.start(message, keys, handoff.lease_id, handoff.source_address)
        return True

    def join(self, message: GenerateRequest, done: TransferDone) -> bool:
        """The load finished: the reservation (made before it, or now, for blocks mapped in
        place) joins the batch with the moved blocks written after the held ones. False where
        none is held (or the load missed: the reservation goes back)."""
        request_id, handoff = message.request_id, message.handoff
        assert handoff is not None
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
        moved_bytes = 0
        if len(block_ids) > num_held:
            staging = [t[:, skip:skip + len(block_ids) - num_held] for t in done.staging]
            self.kv_transfer.install(block_ids[num_held:], staging)
            moved_bytes = sum(t.nbytes for t in staging)
        self.kv_transfer.note_handoff(moved_bytes, num_held)
        return True

    def drop(self, request_id: str) -> None:
        if self._holding.pop(request_id, None) is not None:
            self.engine.block_manager.unreserve(request_id)


class Loaded:
    """KV loading in the background (a hand-off's blocks, or a new prompt's stored prefix):
    the request joins the batch once it arrived, in arrival order when blocks are short (a
    worker queues rather than refuses), or recomputes what did not arrive."""

    kind = "load"

    def __init__(self, engine: Engine, kv_transfer: KVTransfer, held: HeldPrefix,
                 recomputed: Recomputed) -> None:
        self.engine = engine
        self.kv_transfer = kv_transfer
        self.held = held
        held.loaded = self
        self.recomputed = recomputed
        self._loading: dict[str, GenerateRequest] = {}
        self._waiting_for_blocks: deque[tuple[GenerateRequest, TransferDone]] = deque()

    @property
    def num_loading(self) -> int:
        """Not in the engine yet: loading, or loaded and waiting for blocks."""
        return len(self._loading) + len(self._waiting_for_blocks)

    @property
    def num_waiting_for_blocks(self) -> int:
        return len(self._waiting_for_blocks)

    @property
    def num_in_flight(self) -> int:
        """Loads started and not finished."""
        return len(self._loading)

    def __contains__(self, request_id: str) -> bool:
        """The request's load is in flight."""
        return request_id in self._loading

    def admit(self, message: GenerateRequest, done: TransferDone | None = None,
              can_wait: bool = False) -> bool:
        """Without `done`: start loading every block the hand-off names. With it: the load
        finished, and the request joins the batch with its KV, or (a miss) recomputes what
        was not loaded. With `can_wait`, NoFreeBlocksError means "not now" (nothing changed);
        an idle engine has every block free, so there it recomputes instead."""
        if done is None:
            handoff = message.handoff
            assert handoff is not None
            self.start(message, list(handoff.block_keys), handoff.lease_id,
                       handoff.source_address)
            return True
        if can_wait and not self.engine.has_unfinished_requests():
            can_wait = False  # nothing will free blocks: do not wait for them
        if message.handoff is None:  # prefill, or a migration: the prompt's prefix
            self._admit_prefix(message, done, can_wait)
        else:
            self._admit_handoff(message, done, can_wait)
        return True

    def start(self, message: GenerateRequest, keys: list[bytes], lease_id: int = 0,
              source: str = "") -> None:
        """Load `keys` (from `source`, else the fleet store) for the request."""
        self.kv_transfer.start_load(message.request_id, keys, lease_id, source)
        self._loading[message.request_id] = message

    def _admit_prefix(self, message: GenerateRequest, done: TransferDone,
                      can_wait: bool) -> None:
        engine = self.engine
        request = engine.make_request(message.prompt_token_ids, message.sampling,
                                      message.request_id, message.resume_output_ids)
        if done.ok:
            block_size = engine.block_manager.block_size
            try:
                block_ids = engine.add_request_with_prefix(request, len(done.keys) * block_size)
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

    def _admit_handoff(self, message: GenerateRequest, done: TransferDone,
                       can_wait: bool) -> None:
        engine, request_id, params = self.engine, message.request_id, message.sampling
        assert message.handoff is not None
        choices = as_given(message.handoff.choice_first_tokens)  # n > 1: forked
        if self.held.join(message, done):
            return
        if done.ok and (not choices or len(message.prompt_token_ids) > 1):
            try:
                if choices:  # all but the prompt's last token, which its first step computes
                    block_ids = engine.parallel.add_prefilled(
                        request_id, message.prompt_token_ids, params, choices)
                else:
                    block_ids = engine.add_prefilled_request(
                        request_id, message.prompt_token_ids, params,
                        [message.handoff.first_token_id])
            except NoFreeBlocksError:
                if can_wait:
                    raise
                logger.info("no free KV blocks for %s; recomputing its prompt", request_id)
            else:
                staging = [t[:, :len(block_ids)] for t in done.staging]
                self.kv_transfer.install(block_ids, staging)
                self.kv_transfer.note_handoff(sum(t.nbytes for t in staging))
                return
        elif not done.ok:
            logger.info("KV of %s not in the store; recomputing", request_id)
        self.recomputed.admit(message)

    def finished(self, done: TransferDone, on_error: Callable[[str], None]) -> list[Output]:
        """A load completed: admit its request (behind those waiting for blocks)."""
        message = self._loading.pop(done.request_id, None)
        if message is None:
            return []
        if self._waiting_for_blocks:  # first come, first served
            self._waiting_for_blocks.append((message, done))
            return []
        return self._try_admit(message, done, on_error)

    def admit_waiting(self, on_error: Callable[[str], None]) -> list[Output]:
        """Admit loaded requests that waited for blocks, in order, while blocks suffice."""
        outputs: list[Output] = []
        while self._waiting_for_blocks:
            message, done = self._waiting_for_blocks.popleft()
            outputs += self._try_admit(message, done, on_error)
            if self._waiting_for_blocks and self._waiting_for_blocks[0][1] is done:
                break  # it went back to the front: still no room
        return outputs

    def _try_admit(self, message: GenerateRequest, done: TransferDone,
                   on_error: Callable[[str], None]) -> list[Output]:
        """Admit one loaded request; an error Output if it can never be (`on_error` forgets
        it); back to the front of the wait when no blocks are free now."""
        try:
            self.admit(message, done, can_wait=True)
        except NoFreeBlocksError:
            self._waiting_for_blocks.appendleft((message, done))
        except Exception as exc:  # e.g. longer than the pool: this request's error
            logger.warning("could not admit %s: %s", done.request_id, exc)
            self.engine.abort_request(done.request_id)
            on_error(done.request_id)
            return [Output(done.request_id, [], "", "error", error=str(exc))]
        return []

    def drop(self, request_id: str) -> None:
        self._loading.pop(request_id, None)
        self._waiting_for_blocks = deque(
            (message, done) for message, done in self._waiting_for_blocks
            if done.request_id != request_id)


class InPlace:
    """A hand-off whose blocks lie in the prefill worker's shared memory segment on this
    host: copied from there straight into fresh pool blocks (one copy, no load job, no
    request to the prefill worker). Declines where that cannot be (another host, no segment,
    no free blocks now): the load path takes it."""

    kind = "in_place"

    def __init__(self, kv_transfer: KVTransfer, leases: LeaseReturns, loaded: Loaded) -> None:
        self.kv_transfer = kv_transfer
        self.leases = leases
        self.loaded = loaded

    def admit(self, message: GenerateRequest) -> bool:
        handoff = message.handoff
        assert handoff is not None
        start_s = time.monotonic()
        mapped = self.kv_transfer.map_handoff(handoff)
        if mapped is None:
            return False
        layers, intact = mapped
        done = TransferDone(message.request_id, "load", True, list(handoff.block_keys), layers)
        try:
            self.loaded.admit(message, done, can_wait=True)
        except NoFreeBlocksError:
            return False  # the load path waits for blocks
        except Exception:  # the request's error (add reports it); the lease goes back all the same
            self.leases.add(handoff)
            raise
        self.loaded.recomputed.unless_intact(intact, message)
        self.leases.add(handoff)
        self.kv_transfer.note_in_place(time.monotonic() - start_s)
        return True


class Followed:
    """A hand-off whose prompt was copied while its prefill ran (follow.py): the blocks
    reserved then join the batch now. One whose pulled layers still cross waits for them
    (`admit_pulled`, each loop turn). Declines where it was not followed."""

    kind = "followed"

    def __init__(self, engine: Engine, kv_transfer: KVTransfer, followers: Followers,
                 leases: LeaseReturns, recomputed: Recomputed) -> None:
        self.engine = engine
        self.kv_transfer = kv_transfer
        self.followers = followers
        self.leases = leases
        self.recomputed = recomputed
        self._waiting: dict[str, GenerateRequest] = {}  # pulled layers still crossing

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def admit(self, message: GenerateRequest) -> bool:
        handoff = message.handoff
        assert handoff is not None
        start_s = time.monotonic()
        if self.followers.pending(message.request_id, handoff):  # its last layers cross
            self._waiting[message.request_id] = message
            return True
        followed = self.followers.finish(message.request_id, handoff)
        if followed is None:
            return False
        block_ids, intact, pulled = followed
        self.leases.add(handoff)  # read or not, the lease goes back
        try:
            self.engine.add_prefilled_request(message.request_id, message.prompt_token_ids,
                                              message.sampling, [handoff.first_token_id],
                                              block_ids)
        except Exception:  # the request's error (add reports it)
            self.engine.block_manager.unreserve(message.request_id)
            raise
        self.recomputed.unless_intact(intact, message)
        self.kv_transfer.note_in_place(time.monotonic() - start_s, followed=True,
                                       pulled=pulled)
        return True

    def admit_pulled(self, readmit: Callable[[GenerateRequest], None],
                     on_error: Callable[[str], None]) -> list[Output]:
        """Hand-offs whose pulled layers were still crossing: those whose pull completed (or
        failed: then they load the usual way) go on through `readmit`."""
        outputs: list[Output] = []
        for request_id, message in list(self._waiting.items()):
            assert message.handoff is not None
            if self.followers.pending(request_id, message.handoff):
                continue
            del self._waiting[request_id]
            try:
                readmit(message)
            except Exception as exc:  # this request's error, as add() would have raised it
                logger.warning("could not admit %s: %s", request_id, exc)
                on_error(request_id)
                outputs.append(Output(request_id, [], "", "error", error=str(exc)))
            finally:
                self.followers.drop(request_id)
        return outputs

    def drop(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self.followers.drop(request_id)


class Admissions:
    """A worker's admissions over its KV transfer, sharing its followers, its lease returns
    and its loads; `path(kind)` is the order a hand-off of that kind tries them."""

    def __init__(self, engine: Engine, kv_transfer: KVTransfer, recomputed: Recomputed) -> None:
        self.followers = Followers(engine, kv_transfer)
        self.leases = LeaseReturns(kv_transfer)
        self.recomputed = recomputed
        self.held_prefix = HeldPrefix(engine, kv_transfer, self.leases)
        self.loaded = Loaded(engine, kv_transfer, self.held_prefix, recomputed)
        self.in_place = InPlace(kv_transfer, self.leases, self.loaded)
        self.followed = Followed(engine, kv_transfer, self.followers, self.leases, recomputed)

    def path(self, kind: str) -> list[Admission]:
        """The admissions a hand-off of `kind` (KINDS) tries, in order."""
        if kind == "recompute":
            return [self.recomputed]
        path: list[Admission] = [self.held_prefix, self.loaded]
        if kind in ("followed", "in_place"):
            path.insert(0, self.in_place)
        if kind == "followed":
            path.insert(0, self.followed)
        return path

    @property
    def is_busy(self) -> bool:
        """Something is loading, waiting for blocks, followed, or a lease to give back."""
        return bool(self.loaded.num_loading or self.leases or self.followers or self.followed)

    def drop(self, request_id: str) -> None:
        """The request was aborted: whatever an admission holds for it goes back."""
        self.followed.drop(request_id)
        self.held_prefix.drop(request_id)
        self.loaded.drop(request_id)
