"""n > 1 and best_of: one prompt, several sequences, the prompt's KV computed once.

vLLM's V1 front end fans a request of n out into n child requests and lets prefix caching
find the shared prompt; here the engine does it itself (as vLLM's V0 sequence groups did), so
the prompt is prefilled exactly once even without prefix caching and on a prefill worker:

    parent (the request id the client knows; num_seqs batch seats from its admission on)
      │ prefill the prompt, chunked or not, like any request
      ▼ the step that completes the prompt: FORK
    child i = '{i}_{parent id}', i in the parent's choice indices
      · shares every full prompt block (block manager reference counts) and gets its own
        copy of a partially filled last block (copy-on-write, done at the fork)
      · samples its own first token from the parent's logits row, with params.for_child(i):
        a seeded request's child i draws with seed + i (vLLM's rule), so child 0 is what
        n = 1 gives, and each child is reproducible alone
      · its own detokenizer, stop checks and grammar matcher (structured outputs: rebuilt
        by replaying its outputs, StructuredOutputManager.grammar_for)
    the parent's own table is freed at once: the children hold the shared blocks now

Roles only change the two ends, as for any request:
    colocated  the children join the running batch and decode to their ends.
    prefill    the children hold no blocks: each samples its first token and ends (stop,
               length, or 'handoff'); the parent's prompt KV is saved ONCE (role.on_handoff
               on the parent), and the hand-off, on the last handed-off child's output,
               carries every continuing choice's first token (KVHandoff.choice_first_tokens).
    decode     the parent's prompt KV is loaded once into its blocks, but for its last
               prompt token, which the first step recomputes (a parent forks at the end of
               the step that completes its prompt, in every role); the fork then takes the
               first tokens from the hand-off instead of sampling, and the children decode.
               Without the KV (a miss) the parent recomputes its whole prompt, same fork.

A child that finds no free block for its copy of the partial block is not refused: it goes
to the front of the waiting queue, preempted (recompute), with its first token; with prefix
caching on, its prompt's full blocks are cache hits when it comes back.

Outputs leave under the parent's id with CompletionOutput.index = the child's index, and
RequestOutput.finished is True on the last one, when every choice has finished (vLLM's
RequestOutput). Aborting the parent's id aborts the parent and every child: no block is left
behind (BlockManager.check_integrity holds throughout). best_of > n picks its n choices by
cumulative logprob where all choices meet: the router (pdserve/router/choices.py), or LLM.generate.

Migration (pdserve/router/dispatch.py): before its first output a parent moves as it is; after
outputs it moves with each unfinished choice's outputs so far (GenerateRequest.resume_choices):
the new worker prefills the prompt once, forks, and each child computes the KV of its own
outputs before it samples the next token (seeded draws continue at its own count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import KVHandoff
from pdserve.serve.engine.request import Request, RequestOutput, RequestStatus

if TYPE_CHECKING:
    from pdserve.serve.engine.engine import Engine


def child_request_id(parent_id: str, index: int) -> str:
    """vLLM's child id: '{index}_{parent id}'."""
    return f"{index}_{parent_id}"


@dataclass
class ParentRequest:
    """A request of several sequences, from its admission until its last choice ends."""

    request_id: str
    params: SamplingParams
    indices: list[int]
    """The choices it forks into (all of 0..num_seqs-1, or those a hand-off continues)."""
    given: dict[int, list[int]] = field(default_factory=dict)
    """The outputs each choice has already (decode: the first token prefill sampled; a
    migration: every token another worker streamed); empty: sample them here."""
    live: set[str] = field(default_factory=set)
    """Ids of the children that have not finished."""
    is_forked: bool = False
    handoff_pending: bool = False
    """Prefill role: forked this step; the group's hand-off is made at the end of it."""


class ParallelSampling:
    """The engine's parents and their children (one per engine, used from its thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, str] = {}  # child id -> parent id

    # ---- parents in -----------------------------------------------------------------------
    def track(self, request: Request, given: dict[int, list[int]] | None = None) -> None:
        """Register `request` (already in the scheduler) as a parent if it forks."""
        if request.num_seqs <= 1 and not given:
            return
        params = request.sampling_params
        indices = sorted(given) if given else list(range(params.num_seqs))
        self.parents[request.request_id] = ParentRequest(
            request.request_id, params, indices, {i: list(t) for i, t in (given or {}).items()})

    def add_continued(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, given: dict[int, list[int]]) -> Request:
        """The prompt's KV is not here (decode without it; a migration): the parent
        recomputes its prompt, then forks into the given choices, each continuing after its
        own outputs (a handed-off first token; all a dead worker streamed, whose KV the
        child computes before it samples again)."""
        request = self._make_parent(request_id, prompt_token_ids, params, given)
        engine = self.engine
        engine.scheduler.add_request(request)
        engine._start_tracking(request)
        self.track(request, given)
        return request

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, given: dict[int, list[int]]) -> list[int]:
        """Decode with the prompt's KV loaded: the parent joins the batch with every prompt
        token but the last computed; returns its blocks, into which the caller writes the
        KV of their positions before the next step (NoFreeBlocksError: none now)."""
        request = self._make_parent(request_id, prompt_token_ids, params, given)
        if request.num_prompt_tokens < 2:
            raise ValueError("a one-token prompt has no KV to load")
        request.num_computed_tokens = request.num_prompt_tokens - 1
        engine = self.engine
        block_ids = engine.scheduler.add_running_request(request, None)
        engine._start_tracking(request)
        self.track(request, given)
        return block_ids

    def _make_parent(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, given: dict[int, list[int]]) -> Request:
        if not given or not all(given.values()):
            raise ValueError("a continued parent needs its choices' outputs so far")
        if any(i >= params.num_seqs for i in given):
            raise ValueError("a choice index is past the request's sequences")
        request = self.engine.make_request(prompt_token_ids, params, request_id)
        request.num_seqs = len(given)
        return request

    # ---- the fork -----------------------------------------------------------------------
    def expand(self, to_sample: list[Request], logits: torch.Tensor
               ) -> tuple[list[Request], torch.Tensor]:
        """The step's rows to sample, with every parent whose prompt just completed replaced
        by its children (forked now), each sampling from the parent's row; children whose
        first token came with a hand-off sample nothing this step."""
        if not self.parents or not any(self._is_unforked(r) for r in to_sample):
            return to_sample, logits
        rows: list[int] = []
        requests: list[Request] = []
        for row, request in enumerate(to_sample):
            if not self._is_unforked(request):
                rows.append(row)
                requests.append(request)
                continue
            parent = self.parents[request.request_id]
            for child in self._fork(parent, request):
                if child.index not in parent.given:
                    rows.append(row)
                    requests.append(child)
        return requests, logits[rows]

    def _is_unforked(self, request: Request) -> bool:
        parent = self.parents.get(request.request_id)
        return parent is not None and not parent.is_forked

    def _fork(self, parent: ParentRequest, request: Request) -> list[Request]:
        engine = self.engine
        scheduler, bm = engine.scheduler, engine.block_manager
        holds_blocks = not engine.role.ends_at_first_token
        children, copies = [], []
        for index in parent.indices:
            child = engine.make_request(
                request.prompt_token_ids, parent.params.for_child(index),
                child_request_id(request.request_id, index), parent.given.get(index, ()))
            child.index, child.parent_id, child.prompt = index, request.request_id, request.prompt
            child.arrival_time_s = request.arrival_time_s
            child.first_scheduled_s = request.first_scheduled_s
            child.num_cached_tokens = request.num_cached_tokens
            child.block_keys = list(request.block_keys)
            # The prompt's logprobs (computed once, by the parent) go out with the first
            # child's first output; a decode parent never computed them (prefill sent them).
            # prompt logprobs (pdserve/serve/engine/prompt_logprobs.py): the parent computed them;
            # its first child reports them, unless the prompt was prefilled elsewhere (a hand-off)
            # or the client has them already (a migration)
            child.prompt_logprobs = (request.prompt_logprobs
                                     if not children and not parent.given else None)
            scheduler.requests[child.request_id] = child
            if not holds_blocks:  # prefill: it ends at its first token, in this step
                child.status = RequestStatus.RUNNING
            elif bm.can_fork(request):
                copy = bm.fork(request, child)
                if copy is not None:
                    copies.append(copy)
                child.num_computed_tokens = request.num_computed_tokens
                child.status = RequestStatus.RUNNING
                scheduler.running.append(child)
            else:  # no block for its copy: recompute later (its full blocks are cached)
                child.status = RequestStatus.PREEMPTED
                scheduler.waiting.appendleft(child)
            engine._start_tracking(child)
            parent.live.add(child.request_id)
            self._parent_of[child.request_id] = request.request_id
            children.append(child)
        self._copy_partial_blocks(copies)
        parent.is_forked = True
        if holds_blocks:
            self._forget_parent_sequence(request, RequestStatus.FINISHED_STOPPED)
        else:
            parent.handoff_pending = True
        return children

    def _copy_partial_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the parent's partial last block into each child's own (every TP rank)."""
        if not copies:
            return
        runner = self.engine.runner
        source = runner.read_kv_blocks([copies[0][0]])  # per layer [P, 1, bs, heads, D]
        targets = [dst for _, dst in copies]
        runner.write_kv_blocks(targets, [layer.expand(-1, len(targets), -1, -1, -1)
                                         for layer in source])

    def _forget_parent_sequence(self, request: Request, status: RequestStatus) -> None:
        """The parent's own sequence ends (its children carry on): free its table."""
        engine = self.engine
        engine.scheduler.finish_request(request.request_id, status)
        engine._detokenizers.pop(request.request_id, None)
        engine._num_reported_tokens.pop(request.request_id, None)

    # ---- outputs ------------------------------------------------------------------------
    def finish_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs go out under the parent's id and their index; a prefill
        parent forked this step hands off its prompt once; finished groups are forgotten."""
        if not self._parent_of:
            return outputs
        mine: list[tuple[ParentRequest, RequestOutput]] = []
        handed_off: dict[str, list[RequestOutput]] = {}
        for output in outputs:
            parent_id = self._parent_of.get(output.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            completion = output.outputs[0]
            if completion.finish_reason is not None:
                parent.live.discard(output.request_id)
                del self._parent_of[output.request_id]
            self._relabel(output, parent_id)
            if completion.finish_reason == "handoff":
                handed_off.setdefault(parent_id, []).append(output)
            mine.append((parent, output))
        for parent in [p for p in self.parents.values() if p.handoff_pending]:
            self._hand_off(parent, handed_off.get(parent.request_id, []))
        last_of = {parent.request_id: output for parent, output in mine}
        for parent, output in mine:
            output.finished = not parent.live and last_of[parent.request_id] is output
            if output.finished:
                self.parents.pop(parent.request_id, None)
        return outputs

    @staticmethod
    def _relabel(output: RequestOutput, parent_id: str) -> None:
        """A child's output as the client sees it: the parent's id, the child's index."""
        output.outputs[0].index = int(output.request_id.split("_", 1)[0])
        output.request_id = parent_id

    def _hand_off(self, parent: ParentRequest, outputs: list[RequestOutput]) -> None:
        """Prefill: save the prompt's KV once for every choice that continues on decode, and
        put the hand-off on the last of their outputs (the one the worker holds for the
        save, so it leaves after the others)."""
        engine = self.engine
        parent.handoff_pending = False
        request = engine.scheduler.requests[parent.request_id]
        if not outputs:  # every choice ended at its first token: nothing to hand off
            self._forget_parent_sequence(request, RequestStatus.FINISHED_STOPPED)
            return
        block_ids, block_keys = engine.block_manager.request_blocks(request)
        engine.role.on_handoff(request, block_ids, block_keys)  # before the blocks are freed
        firsts = {out.outputs[0].index: out.outputs[0].token_ids[0] for out in outputs}
        carrier = outputs[-1]
        carrier.kv_handoff = KVHandoff(block_keys=block_keys,
                                       first_token_id=carrier.outputs[0].token_ids[0],
                                       num_output_tokens=1, choice_first_tokens=firsts)
        self._forget_parent_sequence(request, RequestStatus.FINISHED_HANDOFF)

    # ---- abort --------------------------------------------------------------------------
    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a parent: its own sequence if it has not forked, and every live child."""
        parent = self.parents.pop(request_id)
        engine = self.engine
        last = None
        if not parent.is_forked or parent.handoff_pending:
            request = engine.scheduler.requests.get(request_id)
            if request is not None:
                self._forget_parent_sequence(request, RequestStatus.FINISHED_ABORTED)
        for child_id in sorted(parent.live):
            self._parent_of.pop(child_id, None)
            output = engine.abort_request(child_id)
            if output is not None:
                self._relabel(output, request_id)
                output.finished = True
                last = output
        return last
