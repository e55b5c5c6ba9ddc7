"""`pdserve prefill | decode | colocated`: one engine behind a ZeroMQ ROUTER socket.

    router (DEALER) ──GenerateRequest/AbortRequest/StatusRequest──► worker (ROUTER)
                    ◄─────────────── Output deltas / WorkerStatus ──

One thread runs everything: it drains the socket (without blocking while the engine has
work), runs one engine step, and sends each request's delta to the router that owns it. The
engine is never touched from two threads. The role changes only a request's ends:
  prefill    the engine stops after the first token; the KV transfer saves the prompt's blocks
             to the store before they are freed, and the output carries the hand-off.
  decode     a request that comes with a hand-off loads its prompt KV from the store into fresh
             blocks and joins the running batch; if the store misses, it recomputes the prompt.
A drained prefill or decode worker flips to the other role on SetRole (the router's goodput
controller moves capacity between the phases); a colocated worker never does.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections import deque
from dataclasses import asdict, replace

import zmq

from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.kv_transfer import TransferDone
from pdserve.serve.protocol import (
    WORKER_PROTOCOL,
    AbortRequest,
    GenerateRequest,
    KVHandoff,
    Output,
    SetRole,
    StatusRequest,
    StepSample,
    TokenLogprob,
    WorkerStatus,
)
from pdserve.serve.request import RequestOutput
from pdserve.serve.sampling_params import SamplingParams
from pdserve.wire import WireError

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 20
NUM_STEP_SAMPLES_KEPT = 256
NUM_STEP_SAMPLES_PER_STATUS = 64  # 128 steps/s between two 0.5 s status polls


class Worker:
    def __init__(self, engine, role: str, address: str, worker_id: str,
                 kv_transfer=None) -> None:
        self.engine = engine
        self.role = role
        self.worker_id = worker_id
        self.kv_transfer = kv_transfer
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted router takes over
        self._socket.bind(address)
        self._owners: dict[str, bytes] = {}
        self._held_handoffs: dict[str, RequestOutput] = {}  # prefill: waiting for the save
        self._loading: dict[str, tuple[GenerateRequest, SamplingParams]] = {}  # decode
        self._step_times_s: deque[float] = deque(maxlen=32)
        self._step_samples: deque[StepSample] = deque(maxlen=NUM_STEP_SAMPLES_KEPT)
        self._num_step_samples = 0
        self.stop_event = threading.Event()
        self._wire_engine_hooks()

    def _wire_engine_hooks(self) -> None:
        """A prefill worker with a store saves each prompt's KV as it completes (layer by
        layer during the step, then the hand-off); no other role saves anything."""
        saves = self.role == "prefill" and self.kv_transfer is not None
        self.engine.prompt_done_hook = self.kv_transfer.start_layerwise_save if saves else None
        self.engine.handoff_hook = self.kv_transfer.save_handoff if saves else None

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self.stop_event.is_set():
            busy = (self.engine.has_unfinished_requests() or self._held_handoffs
                    or self._loading)
            if poller.poll(0 if busy else IDLE_POLL_MS):
                self._drain()
            if self.kv_transfer is not None:
                self._finish_transfers()
            if self.engine.has_unfinished_requests():
                start = time.perf_counter()
                outputs = self.engine.step()
                seconds = time.perf_counter() - start
                self._step_times_s.append(seconds)
                self._record_step(seconds)
                for output in outputs:
                    self._send_output(output)

    def _record_step(self, seconds: float) -> None:
        shape = self.engine.last_step_shape
        if shape is None:
            return
        self._num_step_samples += 1
        self._step_samples.append(StepSample(
            self._num_step_samples, shape.prefill_tokens, shape.prefill_attention,
            shape.decode_seqs, shape.decode_context, seconds))

    def close(self) -> None:
        self.engine.shutdown()
        self._socket.close(linger=0)
        self._context.term()

    # ---- messages in -------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                identity, raw = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not exactly [identity, payload]
                logger.warning("dropped a message with unexpected framing")
                continue
            try:
                message = WORKER_PROTOCOL.decode(raw)
            except WireError as exc:
                logger.warning("dropped a malformed message: %s", exc)
                continue
            if isinstance(message, GenerateRequest):
                self._on_generate(identity, message)
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id)
            elif isinstance(message, StatusRequest):
                self._reply(identity, self.status())
            elif isinstance(message, SetRole):
                self._on_set_role(message.role)
                self._reply(identity, self.status())
            else:
                logger.warning("unexpected %s", type(message).__name__)

    def _on_generate(self, identity: bytes, message: GenerateRequest) -> None:
        request_id = message.request_id
        if request_id in self._owners:
            self._reply(identity, Output(request_id, [], "", "error",
                                         error=f"request id {request_id} is already running"))
            return
        try:
            params = SamplingParams(**asdict(message.sampling), cache_salt=message.cache_salt)
            if message.handoff is not None:
                self._add_handed_off(message, params)
            else:
                self._add_new(message, params)
        except Exception as exc:  # any rejection is this request's error, not the worker's
            logger.info("rejected %s: %s", request_id, exc)
            self._reply(identity, Output(request_id, [], "", "error", error=str(exc)))
            return
        self._owners[request_id] = identity

    def _add_new(self, message: GenerateRequest, params: SamplingParams) -> None:
        """A new request; a prefill worker first loads the prompt's prefix from the store
        when the store holds more of it than this worker's own prefix cache."""
        request = self.engine.make_request(message.prompt_token_ids, params, message.request_id)
        if self.kv_transfer is not None and self.role == "prefill":
            keys = self.kv_transfer.store_prefix_keys(request)
            if keys:
                self.kv_transfer.start_load(message.request_id, keys)
                self._loading[message.request_id] = (message, params)
                return
        self.engine.submit(request)

    def _add_handed_off(self, message: GenerateRequest, params: SamplingParams) -> None:
        """Decode role: continue a request that a prefill worker started. With a store, its
        KV loads in the background and the request joins the batch once it has arrived."""
        handoff = message.handoff
        if self.kv_transfer is not None and handoff.block_keys:
            self.engine.make_request(message.prompt_token_ids, params)  # validate it now
            self.kv_transfer.start_load(message.request_id, list(handoff.block_keys),
                                        handoff.lease_id)
            self._loading[message.request_id] = (message, params)
            return
        # No store, or prefill could not save: recompute the prompt here.
        self.engine.add_continued_request(
            message.request_id, message.prompt_token_ids, params, [handoff.first_token_id])

    def _finish_transfers(self) -> None:
        """Prefill: send hand-offs whose save ended. Decode: admit requests whose KV came."""
        for done in self.kv_transfer.poll():
            if done.kind == "save":
                output = self._held_handoffs.pop(done.request_id, None)
                if output is not None and done.ok:
                    self._send_output(output, done.keys, done.lease_id)
                else:  # finished at its first token, aborted, or the save failed
                    self.kv_transfer.release(done.lease_id)
                    if output is not None:
                        self._send_output(output, [])
                continue
            entry = self._loading.pop(done.request_id, None)
            if entry is None:
                continue
            message, params = entry
            try:
                self._admit_loaded(message, params, done)
            except Exception as exc:  # e.g. no free blocks: this request's error
                logger.warning("could not admit %s: %s", done.request_id, exc)
                self.engine.abort_request(done.request_id)
                identity = self._owners.pop(done.request_id, None)
                if identity is not None:
                    self._reply(identity, Output(done.request_id, [], "", "error",
                                                 error=str(exc)))

    def _admit_loaded(self, message: GenerateRequest, params: SamplingParams,
                      done: TransferDone) -> None:
        """A load finished: the request joins the batch with its KV, or (a miss; the KV
        cache is a cache) recomputes what was not loaded."""
        engine, request_id = self.engine, message.request_id
        if message.handoff is None:  # prefill: the prompt's prefix
            request = engine.make_request(message.prompt_token_ids, params, request_id)
            if not done.ok:
                engine.submit(request)
                return
            block_size = engine.block_manager.block_size
            block_ids = engine.add_request_with_prefix(request, len(done.keys) * block_size)
            self.kv_transfer.install(block_ids, [t[:, :len(block_ids)] for t in done.staging])
            return
        first = [message.handoff.first_token_id]  # decode: the whole prompt
        if not done.ok:
            logger.info("KV of %s not in the store; recomputing", request_id)
            engine.add_continued_request(request_id, message.prompt_token_ids, params, first)
            return
        block_ids = engine.add_prefilled_request(request_id, message.prompt_token_ids, params,
                                                 first)
        self.kv_transfer.install(block_ids, done.staging)

    # ---- role ----------------------------------------------------------------------------
    def can_switch_role(self) -> bool:
        """Only a drained prefill or decode worker flips: no request is left in the engine,
        waiting for its hand-off save, or loading its KV."""
        return (self.role in ("prefill", "decode") and not self.engine.has_unfinished_requests()
                and not self._held_handoffs and not self._loading and not self._owners)

    def switch_role(self, role: str) -> None:
        """Become a `role` worker: the engine's scheduler config and hooks follow, the KV
        transfer (or its absence) stays, and step times start over for the new phase."""
        if not self.can_switch_role():
            raise RuntimeError(f"{self.worker_id} cannot switch role now")
        engine = self.engine
        engine.scheduler_config = replace(engine.scheduler_config, role=role)
        engine.scheduler.config = engine.scheduler_config  # the scheduler keeps its own
        self.role = role
        self._wire_engine_hooks()
        self._step_times_s.clear()

    def _on_set_role(self, role: str) -> None:
        if role == self.role:
            return
        if not self.can_switch_role():
            logger.warning("refused to switch from %s to %s (a colocated worker never "
                           "switches; others only when drained): %d requests, %d hand-offs "
                           "saving, %d loads", self.role, role, len(self._owners),
                           len(self._held_handoffs), len(self._loading))
            return
        self.switch_role(role)
        logger.info("%s is now a %s worker", self.worker_id, role)

    def _abort(self, request_id: str) -> None:
        self._owners.pop(request_id, None)
        self._held_handoffs.pop(request_id, None)
        self._loading.pop(request_id, None)
        if self.kv_transfer is not None:
            self.kv_transfer.forget(request_id)
        self.engine.abort_request(request_id)

    # ---- messages out ------------------------------------------------------------------
    def _send_output(self, output: RequestOutput, saved_keys: list[bytes] | None = None,
                     lease_id: int | None = None) -> None:
        """Send a delta. A prefill hand-off waits for its save (`saved_keys`: the keys
        decode loads; empty when the save failed and decode must recompute)."""
        identity = self._owners.get(output.request_id)
        if identity is None:
            return  # aborted meanwhile
        if output.kv_handoff is not None and self.kv_transfer is not None \
                and saved_keys is None:
            self._held_handoffs[output.request_id] = output
            return
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [
                TokenLogprob(token_id, entry[token_id].logprob,
                             {t: lp.logprob for t, lp in entry.items()})
                for token_id, entry in zip(completion.token_ids, completion.logprobs,
                                           strict=False)
            ]
        handoff = None
        if output.kv_handoff is not None:
            handoff = KVHandoff(
                block_keys=saved_keys or [],
                first_token_id=output.kv_handoff.output_token_ids[0],
                num_output_tokens=output.kv_handoff.num_generated_tokens,
                prefill_worker_id=self.worker_id, lease_id=lease_id or 0)
        self._reply(identity, Output(
            output.request_id, list(completion.token_ids), completion.text,
            completion.finish_reason, logprobs, len(output.prompt_token_ids),
            output.num_cached_tokens, handoff))
        if output.finished:
            self._owners.pop(output.request_id, None)

    def _reply(self, identity: bytes, message) -> None:
        try:
            self._socket.send_multipart([identity, WORKER_PROTOCOL.encode(message)],
                                        zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("router %r is not reading; dropped a %s", identity,
                           type(message).__name__)

    def status(self) -> WorkerStatus:
        engine = self.engine
        stats = engine.stats()
        step_s = sum(self._step_times_s) / len(self._step_times_s) if self._step_times_s else 0
        block_size = engine.block_manager.block_size
        return WorkerStatus(
            worker_id=self.worker_id, role=self.role, model=engine.spec.model_id,
            max_model_len=engine.max_model_len, is_ready=True, num_running=stats.num_running,
            num_waiting=stats.num_waiting + len(self._loading),
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_blocks,
            block_size=block_size, kv_layout=asdict(engine.spec.kv_layout(block_size)),
            prefill_step_s=step_s if self.role != "decode" else 0.0,
            decode_step_s=step_s if self.role != "prefill" else 0.0,
            num_prefix_queried_tokens=stats.num_prefix_queried_tokens,
            num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
            num_preemptions=stats.num_preemptions,
            kv_transfer=self.kv_transfer.totals() if self.kv_transfer is not None else {},
            step_samples=list(self._step_samples)[-NUM_STEP_SAMPLES_PER_STATUS:],
            max_num_seqs=engine.scheduler_config.max_num_seqs,
            max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
            tensor_parallel_size=engine.runner.tensor_parallel_size,
        )


# ---- the command ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    cache, sched = CacheConfig(), SchedulerConfig()
    parser.add_argument("--model", required=True, help="local Hugging Face checkpoint dir")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, required=True, help="ZeroMQ port for the router")
    parser.add_argument("--worker-id", default=None, help="name in status and metrics")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16",
                                                             "float16"))
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE models: whole experts spread over the TP ranks, tokens sent "
                             "to them by all-to-all (default: every expert TP-split)")
    parser.add_argument("--block-size", type=int, default=cache.block_size)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=sched.max_num_batched_tokens)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads per TP rank on CPU (default: cores / ranks)")
    parser.add_argument("--store", default=None, metavar="ADDR",
                        help="KV store data server (prefill saves, decode loads); "
                             "none: decode recomputes the prompt")
    parser.add_argument("--store-master", default=None, metavar="ADDR",
                        help="KV store master (metadata service)")
    parser.add_argument("--store-timeout-s", type=float, default=10.0,
                        help="longest wait on the store; past it a transfer is a miss")
    parser.add_argument("--kv-lease-ttl-s", type=float, default=30.0,
                        help="prefill pins a hand-off's blocks in the store this long at most "
                             "(the decode worker releases them once loaded)")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pdserve.serve.engine import Engine

    role = args.command
    try:
        model_config = ModelConfig(model=args.model, dtype=args.dtype,
                                   max_model_len=args.max_model_len, seed=args.seed)
        cache_config = CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                                   enable_prefix_caching=not args.no_prefix_caching)
        parallel_config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                         cpu_threads=args.cpu_threads,
                                         enable_expert_parallel=args.enable_expert_parallel)
        scheduler_config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           role=role)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        engine = Engine(model_config, cache_config, parallel_config, scheduler_config,
                        tokenizer=tokenizer)
    except (ValueError, FileNotFoundError, OSError) as exc:
        logger.error("cannot start the %s worker: %s", role, exc)
        return 2
    kv_transfer = None
    if args.store is not None and role != "colocated":
        from pdserve.serve.kv_transfer import KVTransfer

        try:
            kv_transfer = KVTransfer.connect(engine, args.store, args.store_master,
                                             timeout_s=args.store_timeout_s,
                                             lease_ttl_s=args.kv_lease_ttl_s)
        except Exception as exc:  # the KV cache is a cache: serve by recomputing
            logger.warning("KV store at %s unreachable (%s): decode will recompute prompts",
                           args.store, exc)
    worker_id = args.worker_id or f"{role}-{args.port}"
    worker = Worker(engine, role, f"tcp://{args.host}:{args.port}", worker_id, kv_transfer)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stop_event.set())
    logger.info("%s worker %s ready on tcp://%s:%d", role, worker_id, args.host, args.port)
    try:
        worker.serve_forever()
    finally:
        worker.close()
        if kv_transfer is not None:
            kv_transfer.close()
    return 0

