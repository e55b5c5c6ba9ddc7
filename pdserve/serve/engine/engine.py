"""The engine: requests in, one step at a time, streamed deltas out.

    add_request ─► Scheduler.schedule ─► ModelRunner.execute ─► Sampler ─► stop checks
                                                                              │
    step() returns RequestOutput deltas (new token ids, new text, finish_reason) ◄┘

A step is schedule -> run -> postprocess. The worker's role (roles.py, a policy
object the engine holds) changes only a request's start and end:
  colocated  a request runs from prompt to its last token here.
  prefill    a request finishes after its first token (finish_reason 'handoff'); the role's
             hooks see its KV before the blocks are freed (per layer during the step, then
             on_handoff), and its output carries a KVHandoff (block keys, first token).
  decode     add_prefilled_request admits a request whose prompt KV is (or will be, before
             the next step) in the blocks it names; decoding starts at its next token.
Every step that ran leaves a StepSample (its work by phase and its wall time) in
`step_samples`, for the router's step-latency models.

The engine is single-threaded: a worker calls add/abort/step from one thread (or under one
lock), so nothing changes under a running step.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import KVHandoff, StepSample
from pdserve.serve.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.serve.engine.block_manager import BlockManager
from pdserve.serve.engine.detokenizer import IncrementalDetokenizer
from pdserve.serve.engine.kv_tiers import KVOffload, WriteDown
from pdserve.serve.engine.logit_controls import resolve_logit_controls
from pdserve.serve.engine.overlap import Overlap
from pdserve.serve.engine.parallel_sampling import ParallelSampling
from pdserve.serve.engine.prompt_logprobs import (
    record_prompt_logprobs,
    start_prompt_logprobs,
    take_prompt_logprobs,
)
from pdserve.serve.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from pdserve.serve.engine.roles import Role
from pdserve.serve.engine.sampler import Sampler, SampleResult
from pdserve.serve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.serve.engine.spec_decode import MTPSpeculator
from pdserve.serve.engine.structured import StructuredOutputManager

logger = logging.getLogger(__name__)

NUM_STEP_SAMPLES_KEPT = 256


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and load reports (counters are totals since start)."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    """Allocatable blocks: free plus evictable cached ones."""
    num_cached_blocks: int
    num_preemptions: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool held by requests (vLLM's kv_cache_usage_perc / 100)."""
        return 1.0 - self.num_free_blocks / self.num_blocks


def step_sample(scheduled: SchedulerOutput, seq: int, seconds: float) -> StepSample:
    """What a step computed, by phase: a chunk is a decode iff it is one token at or past the
    end of its prompt; every other chunk is prefill, including a decode worker's recompute of
    a prompt and its outputs."""
    prefill_tokens = query_keys = decode_seqs = decode_context = 0
    for (request, _), chunk in zip(scheduled.scheduled, scheduled.step.chunks, strict=True):
        num_tokens = len(chunk.token_ids)
        end = chunk.start_pos + num_tokens
        # a verify chunk (1 + k drafts, pdserve/serve/engine/spec_decode.py) is one sequence's
        # decode
        if num_tokens - chunk.num_draft_tokens == 1 and chunk.start_pos >= \
                request.num_prompt_tokens:
            decode_seqs += 1
            decode_context += end
        else:
            prefill_tokens += num_tokens
            query_keys += num_tokens * end
    return StepSample(seq, prefill_tokens, query_keys, decode_seqs, decode_context, seconds)


def _first_rows(num_drafts: list[int]) -> torch.Tensor:
    """Row of each sampled request's first logits row when request i has 1 + num_drafts[i]
    rows (a verify chunk, pdserve/serve/engine/spec_decode.py)."""
    counts = torch.tensor([0] + num_drafts[:-1]) + 1
    return counts.cumsum(0) - 1


class Engine:
    """One worker's engine: owns the scheduler, the block manager, the model runner (through
    which every rank steps), the sampler, the detokenizers and the role's policy, and runs
    schedule -> run -> postprocess once per `step()`. Called by the worker's request gateway
    (pdserve/serve/worker/gateway.py), by the offline LLM and by `pdserve profile`."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig | None = None,
                 parallel_config: ParallelConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, tokenizer: Any = None,
                 runner: Any = None, role: Role | None = None,
                 speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
                 ) -> None:
        speculative_config = SpeculativeConfig.parse(speculative_config)
        self.model_config = model_config
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        if runner is None:
            from pdserve.serve.executor.model_runner import ModelRunner

            runner = ModelRunner(model_config, self.cache_config,
                                 parallel_config or ParallelConfig(),
                                 scheduler_config=self.scheduler_config,
                                 speculative_config=speculative_config)
        self.runner = runner
        self.spec = runner.spec
        self.tokenizer = tokenizer
        self.role = role or Role()
        """The worker's role policy (roles.py); swapped only while no request
        runs."""
        self.max_model_len = self.spec.max_model_len
        """Longest prompt + output: the model's, capped to what the KV pool holds."""
        self.block_manager = BlockManager(
            runner.num_blocks, runner.block_size, self.spec.model_id,
            self.spec.kv_layout(runner.block_size), self.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, self.max_model_len)
        self.kv_offload: KVOffload | None = None
        """The host tier below the pool (kv_tiers.py); see enable_kv_offload."""
        if self.cache_config.kv_offload_bytes:
            self.enable_kv_offload()
        self.sampler = Sampler(model_config.seed, getattr(runner, "device", "cpu"))
        self.speculator: MTPSpeculator | None = None
        """MTP speculative decoding (spec_decode.py): drafts after each step, verify
        and roll back in the next."""
        if speculative_config is not None:
            self.speculator = MTPSpeculator(speculative_config, runner, self.block_manager,
                                            self.max_model_len)
        self.structured: StructuredOutputManager | None = None
        """Grammars for structured outputs (structured.py), built on the first request
        that asks for them."""
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._num_reported_tokens: dict[str, int] = {}
        self.parallel = ParallelSampling(self)
        """Requests of n > 1 sequences: prefilled once, forked
        (parallel_sampling.py)."""
        self.step_samples: deque[StepSample] = deque(maxlen=NUM_STEP_SAMPLES_KEPT)
        """The most recent steps' work and wall time, oldest first (seq increases from 1)."""
        self._num_steps = 0
        self.overlap: Overlap | None = Overlap.build(self)
        """Async scheduling (overlap.py), where it is on (asked for, or by default
        on one CUDA device) and can run."""

    def enable_kv_offload(self, write_down: WriteDown | None = None) -> KVOffload | None:
        """Put a host DRAM tier of cache_config.kv_offload_bytes below the pool (again, with
        `write_down`: where blocks it evicts go, e.g. the fleet store); None where it
        cannot have one (kv_tiers.KVOffload.build)."""
        if self.kv_offload is not None:
            self.kv_offload.close()
        self.kv_offload = KVOffload.build(self.runner, self.block_manager,
                                          self.cache_config.kv_offload_bytes, write_down)
        self.scheduler.lower = self.kv_offload
        return self.kv_offload

    def set_role(self, role: Role) -> None:
        """Take another role's policy; only between requests (nothing may be in flight)."""
        if self.has_unfinished_requests():
            raise RuntimeError("the role changes only while no request is in the engine")
        self.role = role

    # ---- requests in --------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, output_token_ids: Sequence[int] = ()
                     ) -> Request:
        """Tokenize and bound a request (nothing is queued). `output_token_ids`: the tokens
        it already generated elsewhere (a hand-off or a migration): they are computed with the
        prompt, never reported again, and seeded sampling continues after them."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            prompt_text: str | None = prompt
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_text, prompt_ids = None, [int(t) for t in prompt]
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        vocab_size = self.spec.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if any(not 0 <= int(t) < vocab_size for t in output_token_ids):
            raise ValueError(f"output token ids must be in [0, {vocab_size})")
        room = max(1, self.max_model_len - len(prompt_ids))
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id=request_id or uuid.uuid4().hex,
                          prompt_token_ids=prompt_ids, sampling_params=params,
                          max_tokens=max_tokens, prompt=prompt_text,
                          eos_token_ids=tuple(self.spec.eos_token_ids),
                          num_seqs=params.num_seqs)
        for token_id in output_token_ids:
            request.append_output_token(int(token_id))
        if params.structured_outputs is not None:  # replays the output tokens it already has
            if self.structured is None:
                self.structured = StructuredOutputManager(self.tokenizer, vocab_size)
            request.grammar = self.structured.grammar_for(request)
        resolve_logit_controls(request, self.tokenizer, vocab_size)
        start_prompt_logprobs(request)
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a request; raises RequestRejectedError if it can never be served."""
        request = self.make_request(prompt, params, request_id)
        self.submit(request)
        return request

    def submit(self, request: Request) -> None:
        """Queue a request made by make_request."""
        self.scheduler.add_request(request)
        self._start_tracking(request)
        self.parallel.track(request)

    def add_request_with_prefix(self, request: Request, num_prefix_tokens: int) -> list[int]:
        """Admit a request (from make_request) whose first `num_prefix_tokens` tokens' KV
        comes from outside, e.g. the KV store: it gets fresh blocks for them (returned; the
        caller writes the KV there before the next step) and computes only the rest. At
        least one prompt token is always computed, so there are logits to sample from."""
        num_computed = min(num_prefix_tokens, request.num_tokens - 1)
        if num_computed <= 0:
            raise ValueError("a prefix must cover at least one token and leave one")
        request.num_computed_tokens = num_computed
        block_ids = self.scheduler.add_running_request(request, None)
        self._start_tracking(request)
        self.parallel.track(request)
        return block_ids

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int],
                              params: SamplingParams, output_token_ids: list[int],
                              block_ids: list[int] | None = None) -> list[int]:
        """Decode role: admit a request whose prompt KV another worker computed.

        The prompt's KV must be in `block_ids` (or, if None, in the returned fresh blocks)
        before the next step(); output_token_ids are the tokens sampled so far (at least the
        first). Seeded sampling continues at output index len(output_token_ids)."""
        if not output_token_ids:
            raise ValueError("a prefilled request needs its first output token")
        request = self.make_request(prompt_token_ids, params, request_id, output_token_ids)
        request.num_computed_tokens = request.num_tokens - 1
        block_ids = self.scheduler.add_running_request(request, block_ids)
        if self.speculator is not None:
            # The MTP layer's KV of the prompt needs the main model's hidden states there,
            # which no hand-off carries: the first step recomputes the prompt in the blocks
            # (the same KV again) and the MTP pass fills its layer (spec_decode.py).
            request.num_computed_tokens = 0
        self._start_tracking(request)
        return block_ids

    def add_continued_request(self, request_id: str, prompt_token_ids: list[int],
                              params: SamplingParams, output_token_ids: list[int]) -> Request:
        """Decode role when the prompt's KV could not be loaded (the KV cache is a cache):
        queue the request to recompute its prompt and the outputs so far, then continue
        sampling at output index len(output_token_ids), exactly where prefill stopped."""
        if not output_token_ids:
            raise ValueError("a continued request needs its first output token")
        request = self.make_request(prompt_token_ids, params, request_id, output_token_ids)
        self.submit(request)
        return request

    def _start_tracking(self, request: Request) -> None:
        """Track text and reported tokens. Outputs the request already has when it arrives
        were streamed to the client by another worker (a hand-off, a migration): they only
        advance the detokenizer and are not reported again."""
        already_streamed = list(request.output_token_ids)
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request)
            if already_streamed:
                detokenizer.update(already_streamed)
                detokenizer.take_delta(finished=False)
            self._detokenizers[request.request_id] = detokenizer
        self._num_reported_tokens[request.request_id] = len(already_streamed)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any state and free its blocks; returns its final output (None if it is
        unknown or already finished)."""
        if request_id in self.parallel.parents:  # the parent and all its children
            return self.parallel.abort(request_id)
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self._make_output(request)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> postprocess: one forward over every scheduled chunk, then
        sampling and stop checks for the chunks that end at a request's last token. Under
        async scheduling (overlap.py) this schedules and launches the next step,
        then returns the outputs of the one before it."""
        if self.overlap is not None:
            return self.overlap.step()
        start_s = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        return self.run_scheduled(scheduled, start_s)

    def run_scheduled(self, scheduled: SchedulerOutput, start_s: float) -> list[RequestOutput]:
        """Run -> postprocess a scheduled step on this thread (`start_s`: perf_counter() before
        it was scheduled)."""
        scheduled.mark_started()
        to_sample = [request for (request, _), chunk in
                     zip(scheduled.scheduled, scheduled.step.chunks, strict=True)
                     if chunk.need_logits]
        num_drafts = [chunk.num_draft_tokens for chunk in scheduled.step.chunks
                      if chunk.need_logits]
        masks = self.structured.start_masks(to_sample) if self.structured else None
        logits = self._run(scheduled, to_sample, sum(num_drafts))
        if masks is not None and any(num_drafts):  # a grammar's row: its request's first
            first_rows = _first_rows(num_drafts)  # (a request with a grammar has no drafts)
            masked = logits[first_rows]
            masks.apply(masked)
            logits[first_rows] = masked
        elif masks is not None:  # filled on a thread during the forward
            masks.apply(logits)
        if any(num_drafts):
            outputs = self._postprocess_verified(to_sample, logits, num_drafts)
        else:
            outputs = self._postprocess(to_sample, logits)
        if self.speculator is not None and not self.role.ends_at_first_token:
            self.speculator.propose(scheduled)
        self.record_step(scheduled, time.perf_counter() - start_s)
        return outputs

    def record_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Keep a step's work and wall time (step_samples; the host tier's recompute cost)."""
        self._num_steps += 1
        sample = step_sample(scheduled, self._num_steps, seconds)
        self.step_samples.append(sample)
        if self.kv_offload is not None and not sample.num_decode_seqs:  # the recompute cost
            self.kv_offload.costs.note_prefill(sample.num_prefill_tokens, sample.seconds)

    def _run(self, scheduled: SchedulerOutput, to_sample: list[Request], num_drafts: int = 0
             ) -> torch.Tensor:
        """The forward: logits [len(to_sample), vocab]. Requests whose prompt completes in
        this step are shown to the role first (a prefill role saves their KV per layer)."""
        layer_done = self.role.layer_saver([r for r in to_sample if r.num_output_tokens == 0])
        logits = self.runner.execute(scheduled.step, layer_done)
        self.scheduler.update_after_step(scheduled)
        num_rows = len(to_sample) + num_drafts  # a verify chunk has 1 + k rows
        logits = record_prompt_logprobs(scheduled.scheduled, scheduled.step, logits, num_rows)
        if logits.shape[0] != num_rows:
            raise RuntimeError(f"runner returned {logits.shape[0]} logit rows for "
                               f"{len(to_sample)} chunks that need logits")
        return logits

    def _postprocess(self, to_sample: list[Request], logits: torch.Tensor
                     ) -> list[RequestOutput]:
        if not to_sample:
            return []
        # A parent of n > 1 sequences whose prompt completed forks here into its children,
        # each sampling from its row (parallel_sampling.py).
        to_sample, logits = self.parallel.expand(to_sample, logits)
        return self.take_samples(to_sample, self.sampler(logits, to_sample))

    def take_samples(self, to_sample: list[Request], results: list[SampleResult]
                     ) -> list[RequestOutput]:
        """Append each request's sampled token, check its stops, make its output."""
        outputs = []
        sampled_s = time.monotonic()
        for request, result in zip(to_sample, results, strict=True):
            request.append_output_token(result.token_id, result.logprobs)
            if request.grammar is not None and not request.grammar.accept(result.token_id):
                logger.error("%s: the grammar rejected token %d", request.request_id,
                             result.token_id)
                outputs.append(self._finish(request, RequestStatus.FINISHED_ABORTED))
                continue
            if request.first_sampled_s is None:
                request.first_sampled_s = sampled_s
            finished_status = self._check_stop(request)
            if finished_status is not None:
                outputs.append(self._finish(request, finished_status))
            else:
                outputs.append(self._make_output(request))
        return self.parallel.finish_step(outputs)

    def _postprocess_verified(self, to_sample: list[Request], logits: torch.Tensor,
                              num_drafts: list[int]) -> list[RequestOutput]:
        """A step with verify chunks (spec_decode.py): rows [1 + k] per request. The
        requests without drafts sample as usual; each with drafts keeps the tokens the
        accept/reject rule yields, checked for stops one by one, and rolls back the rest."""
        assert self.speculator is not None
        starts = _first_rows(num_drafts)
        plain = [i for i, k in enumerate(num_drafts) if k == 0]
        outputs = self._postprocess([to_sample[i] for i in plain],
                                    logits[starts[plain]] if plain else logits[:0])
        sampled_s = time.monotonic()
        verified: list[RequestOutput] = []
        for i, k in enumerate(num_drafts):
            if k == 0:
                continue
            request, start = to_sample[i], int(starts[i])
            generator = self.speculator.generator_for(request, self.sampler.generator)
            # verification walks its drafts on the host (MTP runs on one CPU rank)
            tokens = self.speculator.verify(request, logits[start:start + k + 1].cpu(),
                                            self.sampler, generator)
            status = None
            for token_id in tokens:
                request.append_output_token(token_id)
                status = self._check_stop(request)
                if status is not None:
                    break
            if request.first_sampled_s is None:
                request.first_sampled_s = sampled_s
            if status is not None:
                verified.append(self._finish(request, status))
                continue
            self.speculator.roll_back(request, len(tokens) - 1)
            verified.append(self._make_output(request))
        return outputs + self.parallel.finish_step(verified)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        num_output_tokens = request.num_output_tokens
        detokenizer = self._detokenizers.get(request.request_id)
        status = None
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        if status is None and request.grammar is not None and request.grammar.is_terminated:
            # The grammar's end ends the output, ignore_eos or not (structured.py).
            status = RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
        if detokenizer is not None:
            stop_str = detokenizer.update(
                [token_id], stop_terminated=status is not None,
                check_stop_strings=num_output_tokens >= params.min_tokens)
            if stop_str is not None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and num_output_tokens >= request.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is None and self.role.ends_at_first_token:
            status = RequestStatus.FINISHED_HANDOFF
        return status

    def _finish(self, request: Request, status: RequestStatus) -> RequestOutput:
        handoff = None
        # A forked child's prompt KV is handed off once, by its parent (parallel_sampling).
        if status is RequestStatus.FINISHED_HANDOFF and request.parent_id is None:
            block_ids, block_keys = self.block_manager.request_blocks(request)
            self.role.on_handoff(request, block_ids, block_keys)  # before the blocks are freed
            handoff = KVHandoff(block_keys=block_keys,
                                first_token_id=request.output_token_ids[0],
                                num_output_tokens=request.num_output_tokens)
        elif status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            # (each sequence of a fork too: its keys chain over the prompt and its own tokens)
            block_ids, block_keys = self.block_manager.request_blocks(request)
            self.role.on_finish(request, block_ids, block_keys)  # before the blocks are freed
        detokenizer = self._detokenizers.get(request.request_id)
        ends_text = status is not RequestStatus.FINISHED_HANDOFF
        if detokenizer is not None and ends_text and not isinstance(request.stop_reason, str):
            detokenizer.flush()
        self.scheduler.finish_request(request.request_id, status)
        output = self._make_output(request)
        output.kv_handoff = handoff
        return output

    def _make_output(self, request: Request) -> RequestOutput:
        """The delta since this request's last output; forgets a finished request."""
        request_id = request.request_id
        start = self._num_reported_tokens.get(request_id, 0)
        self._num_reported_tokens[request_id] = request.num_output_tokens
        detokenizer = self._detokenizers.get(request_id)
        # A hand-off is not the end of the text: hold back what the decode worker's own
        # detokenizer will also hold back (a possible stop-string start), so the two workers'
        # streams join without a gap or a repeat.
        ends_text = request.is_finished and request.status is not RequestStatus.FINISHED_HANDOFF
        text = detokenizer.take_delta(ends_text) if detokenizer is not None else ""
        logprobs, cumulative_logprob = None, None
        if request.sampling_params.logprobs is not None:
            # Outputs another worker sampled (a hand-off, a migration) come first and have no
            # logprobs here: those of this worker's tokens start after them.
            num_without = request.num_output_tokens - len(request.output_logprobs)
            logprobs = request.output_logprobs[max(0, start - num_without):]
            with_logprobs = request.output_token_ids[num_without:]
            cumulative_logprob = sum(entry[token_id].logprob for token_id, entry in
                                     zip(with_logprobs, request.output_logprobs, strict=True))
        if request.is_finished:
            self._detokenizers.pop(request_id, None)
            self._num_reported_tokens.pop(request_id, None)
        completion = CompletionOutput(
            index=0, text=text, token_ids=request.output_token_ids[start:],
            cumulative_logprob=cumulative_logprob, logprobs=logprobs,
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason)
        return RequestOutput(
            request_id=request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=[completion],
            finished=request.is_finished, num_cached_tokens=request.num_cached_tokens or 0,
            first_scheduled_s=request.first_scheduled_s, first_sampled_s=request.first_sampled_s,
            prompt_logprobs=take_prompt_logprobs(request))

    # ---- state --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        scheduler, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.parked),
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks, num_preemptions=scheduler.num_preemptions,
            num_prefix_queried_tokens=scheduler.num_prefix_queried_tokens,
            num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens)

    def has_unfinished_requests(self) -> bool:
        """Requests in the scheduler, or a launched step whose outputs are still to come."""
        return self.scheduler.has_unfinished_requests() or (
            self.overlap is not None and self.overlap.in_flight is not None)

    def shutdown(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        for request_id in list(self.scheduler.requests):
            self.abort_request(request_id)
        if self.structured is not None:
            self.structured.close()
        if self.kv_offload is not None:
            self.kv_offload.close()
        self.runner.shutdown()
