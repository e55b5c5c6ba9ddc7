"""Async scheduling: the host schedules step N+1 and turns step N's tokens into text while the
device runs (vLLM's async scheduling, SGLang's overlap scheduler).

    host     │ schedule N+1 │ launch N+1 │ wait N's ids │ append, stops, text of N │ schedule N+2
    device   │ ····· step N ·····························│ ····· step N+1 ··················

Step N+1 is scheduled before step N's tokens reach the host. Each request that step N samples
counts one pending token (Request.num_pending_tokens): the scheduler gives it its next row as
usual, with a placeholder id in the chunk, and the launched step takes the real id from step
N's sampled ids where they are, on the device. What step N's postprocess learns afterwards can
only end a request: one that stopped at N (or was aborted) computed one more row in N+1, which
is dropped. That row's KV lands in blocks the request freed and never published (blocks are
published only once the step that filled them is done, Scheduler.commit), so nobody reads it.

Only plain requests run ahead. A step that samples a request whose next sampling reads what
the host learns from the step before it (a grammar's state, the output history of penalties and
bad words, a parent forking into its n sequences, prompt logprobs), or a step of a prefill
worker (its requests end at their first token), waits for the step in flight and runs as the
synchronous engine runs it (Engine.run_scheduled): its placeholders are filled from the host
first, and the requests that step ended are dropped from it. Greedy and seeded tokens are the
synchronous engine's (tested).

On CUDA a launch returns as soon as the kernels are queued and the ids come back in one
non-blocking copy. On CPU a torch op computes where it is called, so the launched step runs on
a thread of its own (its compiled loop does not hold the GIL) and the engine's Python runs beside
it. One rank only: a TP or PP group's ranks take their step's token ids from the message that
carries the step, so placeholders cannot reach them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdserve.serve.engine.request import Request, RequestOutput
from pdserve.serve.engine.sampler import SampledBatch
from pdserve.serve.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pdserve.serve.engine.engine import Engine

logger = logging.getLogger(__name__)

STEP_TIMEOUT_S = 600.0
"""Longest wait for a launched step's ids: a step this long means the device or the step's
thread is stuck, and the engine fails instead of hanging."""


@dataclass
class StepResult:
    """What a launched step leaves: its sampled ids on the device (the next step's inputs),
    and their copy, with the logprobs asked for, on its way to the host (`SampledBatch`)."""

    token_ids: torch.Tensor  # [rows] int64, on the device
    sampled: SampledBatch


@dataclass
class LaunchedStep:
    scheduled: SchedulerOutput
    to_sample: list[Request]
    ends: list[int]
    """Each scheduled request's computed tokens once this step is done (Scheduler.commit)."""
    result: Future[StepResult]
    start_s: float


def is_plain(request: Request, parents: Any) -> bool:
    """The request's next sampling reads nothing the host learns from its last token
    (`parents`: the ids of requests that fork into n sequences once prefilled)."""
    params = request.sampling_params
    return (request.grammar is None and not params.has_penalties
            and not request.bad_words_token_ids and request.prompt_logprobs is None
            and request.request_id not in parents)


class Overlap:
    """The engine's step when async scheduling is on: at most one step in flight."""

    def __init__(self, engine: Engine, device: torch.device) -> None:
        self.engine = engine
        self.device = device
        self.in_flight: LaunchedStep | None = None
        self.num_launched = 0
        """Steps launched before the one before them finished (tests, benchmarks)."""
        self._thread = (None if device.type == "cuda"
                        else ThreadPoolExecutor(1, thread_name_prefix="pdserve-step"))
        self._last_done_s = time.perf_counter()

    @classmethod
    def build(cls, engine: Engine) -> Overlap | None:
        """An Overlap where async scheduling is on (SchedulerConfig.async_scheduling; None:
        on one CUDA device) and the engine can run it; None otherwise."""
        setting = engine.scheduler_config.async_scheduling
        device = torch.device(getattr(engine.runner, "device", "cpu"))
        reason = cls.why_not(engine)
        if setting is None:
            setting = device.type == "cuda" and reason is None
        elif setting and reason is not None:
            logger.warning("async scheduling is off: %s", reason)
            setting = False
        if not setting:
            return None
        logger.info("async scheduling on: each step is scheduled while the one before runs%s",
                    "" if device.type == "cuda" else " (on a step thread)")
        return cls(engine, device)

    @staticmethod
    def why_not(engine: Engine) -> str | None:
        runner = engine.runner
        sizes = (getattr(runner, "tensor_parallel_size", 1),
                 getattr(runner, "pipeline_parallel_size", 1),
                 getattr(runner, "context_parallel_size", 1))
        if sizes != (1, 1, 1):
            return "the model spans several ranks (TP, PP or CP > 1)"
        if engine.speculator is not None:
            return "speculative decoding verifies its drafts on the host"
        return None

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then return the outputs of the one before it
        (or, where the next step cannot run ahead, finish both in order)."""
        start_s = time.perf_counter()
        engine = self.engine
        scheduled = engine.scheduler.schedule()
        if scheduled.is_empty:
            return self.finish_in_flight()
        if self._can_launch(scheduled):
            previous, self.in_flight = self.in_flight, self._launch(scheduled, start_s)
            return self._finish(previous) if previous is not None else []
        outputs = self.finish_in_flight()
        self._resolve(scheduled)
        if scheduled.is_empty:
            return outputs
        return outputs + engine.run_scheduled(scheduled, start_s)

    def finish_in_flight(self) -> list[RequestOutput]:
        launched, self.in_flight = self.in_flight, None
        return self._finish(launched) if launched is not None else []

    def close(self) -> None:
        """Wait for the step in flight (its outputs are dropped) and stop the step thread."""
        try:
            self.finish_in_flight()
        except Exception:  # the engine is closing: nothing is left to report it to
            logger.exception("the step in flight failed while the engine closed")
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _can_launch(self, scheduled: SchedulerOutput) -> bool:
        if self.engine.role.ends_at_first_token:
            return False
        parents = self.engine.parallel.parents
        return all(is_plain(request, parents) or not chunk.need_logits and
                   request.prompt_logprobs is None
                   for (request, _), chunk in zip(scheduled.scheduled, scheduled.step.chunks,
                                                  strict=True))

    def _launch(self, scheduled: SchedulerOutput, start_s: float) -> LaunchedStep:
        scheduled.mark_started()
        chunks = scheduled.step.chunks
        to_sample = [request for (request, _), chunk in zip(scheduled.scheduled, chunks,
                                                             strict=True) if chunk.need_logits]
        # the output token each row samples: after the ones still on their way
        indices = [r.num_output_tokens + r.num_pending_tokens for r in to_sample]
        fills = self._pending_rows(scheduled)
        for request in to_sample:
            request.num_pending_tokens += 1
        ends = self.engine.scheduler.advance(scheduled)
        previous = self.in_flight.result if self.in_flight is not None else None
        args = (scheduled, to_sample, indices, fills, previous)
        if self._thread is not None:
            result = self._thread.submit(self._run, *args)
        else:
            result = Future()
            try:
                result.set_result(self._run(*args))
            except Exception as exc:  # raised where the step finishes, as on the thread
                result.set_exception(exc)
        self.num_launched += 1
        return LaunchedStep(scheduled, to_sample, ends, result, start_s)

    def _pending_rows(self, scheduled: SchedulerOutput) -> tuple[list[int], list[int]]:
        """(row of the step's tokens, row of the step in flight's sampled ids) of every token
        the step takes from the device: a chunk's last token, where it is pending."""
        if self.in_flight is None:
            return [], []
        sampled_row = {id(r): i for i, r in enumerate(self.in_flight.to_sample)}
        rows: list[int] = []
        sources: list[int] = []
        row = 0
        for (request, _), chunk in zip(scheduled.scheduled, scheduled.step.chunks, strict=True):
            row += len(chunk.token_ids)
            if chunk.start_pos + len(chunk.token_ids) > request.num_tokens:
                rows.append(row - 1)
                sources.append(sampled_row[id(request)])
        return rows, sources

    def _run(self, scheduled: SchedulerOutput, to_sample: list[Request], indices: list[int],
             fills: tuple[list[int], list[int]], previous: Future[StepResult] | None
             ) -> StepResult:
        """The step's forward and sampling (on the step thread on CPU)."""
        from pdserve.serve.executor.rank import step_token_ids

        engine, device = self.engine, self.device
        input_ids = None
        rows, sources = fills
        if rows:
            assert previous is not None  # done: it ran before this one, in order
            sampled = previous.result().token_ids
            input_ids = step_token_ids(scheduled.step).to(device, non_blocking=True)
            input_ids[torch.tensor(rows).to(device, non_blocking=True)] = \
                sampled[torch.tensor(sources).to(device, non_blocking=True)]
        logits = engine.runner.execute(scheduled.step, None, input_ids)
        if logits.shape[0] != len(to_sample):
            raise RuntimeError(f"runner returned {logits.shape[0]} logit rows for "
                               f"{len(to_sample)} chunks that need logits")
        sampled = engine.sampler.launch(logits, to_sample, indices)
        return StepResult(sampled.token_ids, sampled)

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's ids, publish its blocks, and take its samples."""
        try:
            result = launched.result.result(timeout=STEP_TIMEOUT_S)
            if result.sampled.ready is not None:
                wait_for(result.sampled.ready, STEP_TIMEOUT_S)
        except BaseException:
            for request in launched.to_sample:  # nothing of this step will arrive
                request.num_pending_tokens = 0
            raise
        engine = self.engine
        engine.scheduler.commit(launched.scheduled, launched.ends)
        requests, results = [], []
        for request, sample in zip(launched.to_sample, result.sampled.results(), strict=True):
            request.num_pending_tokens -= 1
            if not request.is_finished:  # else it ended after this step was launched
                requests.append(request)
                results.append(sample)
        outputs = engine.take_samples(requests, results)
        # Steps overlap: a step's time is from the end of the one before (or its start).
        now_s = time.perf_counter()
        engine.record_step(launched.scheduled, now_s - max(launched.start_s, self._last_done_s))
        self._last_done_s = now_s
        return outputs

    @staticmethod
    def _resolve(scheduled: SchedulerOutput) -> None:
        """A step about to run synchronously after the step in flight finished: fill its
        placeholders from the host, drop the requests that step ended."""
        kept: list[tuple[Any, Any]] = []
        for (request, num_new), chunk in zip(scheduled.scheduled, scheduled.step.chunks,
                                             strict=True):
            if request.is_finished:
                continue
            end = chunk.start_pos + len(chunk.token_ids) - chunk.num_draft_tokens
            known = request.all_token_ids[chunk.start_pos:end]
            chunk.token_ids = known + chunk.token_ids[len(known):]
            kept.append(((request, num_new), chunk))
        scheduled.scheduled = [entry for entry, _ in kept]
        scheduled.step.chunks = [chunk for _, chunk in kept]


def wait_for(event: torch.cuda.Event, timeout_s: float) -> None:
    """event.synchronize() with a deadline: poll, yielding the GIL between polls."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a launched step did not finish within {timeout_s:.0f} s")
        time.sleep(20e-6)
