"""Offline inference in vLLM's style: `LLM(model_dir).generate(prompts, params)`.

    from pdserve.serve import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
    llm.shutdown()   # or `with LLM(...) as llm:`, or drop the last reference

An LLM holds its TP ranks (processes) and the torch.distributed process group until it is
shut down; shutting down (any of the three ways) releases both, so LLMs can be made one after
another in one process. Two with tensor_parallel_size > 1 cannot be open at once (torch has
one default process group per process).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.request import CompletionOutput, RequestOutput

Prompt = str | list[int]
PromptInput = str | list[int] | dict[str, Any]  # dicts as vLLM's TextPrompt / TokensPrompt
ChatMessages = list[dict[str, str]]


class LLM:
    """The offline API (vLLM's `LLM`): owns one Engine in this process and drives it to
    completion for a batch of prompts (`generate`, `chat`). Called by users, the offline
    studies in benchmarks/ and the tests; nothing in pdserve/serve/ imports it."""

    def __init__(self, model: str | os.PathLike, tensor_parallel_size: int = 1,
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, dtype: str = "auto", seed: int = 0,
                 max_model_len: int | None = None, enable_chunked_prefill: bool = True,
                 kv_cache_memory_bytes: int | None = None, device: str | None = None,
                 enable_expert_parallel: bool = False,
                 expert_capacity_factor: float | None = None,
                 gpu_memory_utilization: float = 0.9, nnodes: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 dist_timeout_s: float | None = None,
                 speculative_config: dict[str, Any] | None = None,
                 kv_cache_dtype: str = "auto", pipeline_parallel_size: int = 1,
                 pipeline_micro_batches: int | None = None,
                 context_parallel_size: int = 1, kv_offload_bytes: int = 0,
                 async_scheduling: bool | None = None, enforce_eager: bool = False) -> None:
        """The KV pool: num_kv_blocks if given; else kv_cache_memory_bytes per rank if given
        (on CPU it defaults to 512 MiB); else, on CUDA, gpu_memory_utilization of each GPU
        less the weights and the largest step's activations (vLLM's rules; CacheConfig).
        kv_cache_dtype="fp8" (or fp8_e4m3) keeps it in float8_e4m3fn
        (pdserve/serve/layers/fp8.py). kv_offload_bytes: host DRAM below the pool, where evicted
        prefix blocks wait to be copied back instead of recomputed
        (pdserve/serve/engine/kv_tiers.py).

        pipeline_parallel_size splits the layers into stages of tensor_parallel_size ranks
        each (pdserve/serve/layers/pipeline.py); a step runs as pipeline_micro_batches
        micro-batches (default: one per stage).

        context_parallel_size splits each prompt's tokens over that many ranks (zig-zag),
        attention as ring attention; every rank holds the KV of its blocks, so the pool is
        num_kv_blocks x context_parallel_size blocks in all
        (pdserve/serve/executor/context_parallel.py).

        nnodes > 1: this process is node 0 of ranks spread over nnodes hosts; the others are
        started with `pdserve <role> ... --nnodes N --node-rank k --master-addr A
        --master-port P` (or pdserve/serve/model_runner.serve_node) and join at master_port.

        speculative_config={"method": "mtp", "num_speculative_tokens": k}: the checkpoint's
        multi-token-prediction module drafts k tokens a step (pdserve/serve/engine/spec_decode.py).

        async_scheduling: schedule the next step while one runs (pdserve/serve/engine/overlap.py);
        None: on a single CUDA device only.

        enforce_eager=True runs every step eagerly (vLLM's flag): a one-rank CUDA engine
        otherwise replays its decode steps from CUDA graphs
        (pdserve/serve/executor/cuda_graphs.py)."""
        from pdserve.tokenizer import load_tokenizer

        model_dir = str(model)
        self.model_config = ModelConfig(model=model_dir, dtype=dtype, seed=seed,
                                        max_model_len=max_model_len,
                                        enforce_eager=enforce_eager)
        cache_config = CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   kv_cache_dtype=kv_cache_dtype,
                                   enable_prefix_caching=enable_prefix_caching,
                                   kv_offload_bytes=kv_offload_bytes)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = Engine(
            self.model_config, cache_config,
            ParallelConfig(tensor_parallel_size=tensor_parallel_size, device=device,
                           enable_expert_parallel=enable_expert_parallel,
                           expert_capacity_factor=expert_capacity_factor, nnodes=nnodes,
                           master_addr=master_addr, master_port=master_port,
                           dist_timeout_s=dist_timeout_s,
                           pipeline_parallel_size=pipeline_parallel_size,
                           pipeline_micro_batches=pipeline_micro_batches,
                           context_parallel_size=context_parallel_size),
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            enable_chunked_prefill=enable_chunked_prefill,
                            async_scheduling=async_scheduling),
            tokenizer=self.tokenizer, speculative_config=speculative_config)
        # What __del__ would do, but run exactly once: on shutdown(), when the last reference
        # goes, or at interpreter exit; it holds the engine, never the LLM.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._next_request_id = 0

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def cpu_path(self) -> dict[str, str]:
        """Which CPU path serves (a one-rank CPU engine; empty elsewhere), as a worker's
        /status cpu_path: "path" ("portable" until the kernels are built and the paths
        measured in the background; then the one chosen, switched to between two steps),
        "source", each path's step times, and "background" (what is under way, or took)."""
        return getattr(self.engine.runner, "cpu_path_status", dict)()

    def wait_for_cpu_path(self, timeout_s: float | None = None) -> dict[str, str]:
        """Block until the CPU kernels are built and the paths measured (at once where the
        choice was cached, or there is none to make), serve on the chosen path from the next
        step, and return cpu_path. For measurements of the path a worker ends on; raises
        TimeoutError past timeout_s."""
        wait = getattr(self.engine.runner, "wait_for_cpu_path", None)
        if wait is not None and not wait(timeout_s):
            raise TimeoutError(f"the CPU path was still being prepared after {timeout_s} s")
        return self.cpu_path

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for "
                                 f"{len(prompt_list)} prompts")
        # Validate every prompt before queueing any, so a rejection leaves the engine idle.
        requests = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            if params.num_seqs > params.n and params.logprobs is None:  # best_of ranks by them
                params = replace(params, logprobs=0)
            request = self.engine.make_request(prompt, params, self._new_request_id())
            self.engine.scheduler.check_admissible(request)
            requests.append(request)
        finals: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="requests", unit="req")
        try:
            for request in requests:
                self.engine.submit(request)
            while self.engine.has_unfinished_requests():
                deltas = self.engine.step()
                overlap = self.engine.overlap
                if not deltas and not self.engine.scheduler.running and (
                        overlap is None or overlap.in_flight is None) and \
                        self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine made no progress: waiting requests fit "
                                       "no free KV blocks")
                for delta in deltas:
                    _accumulate(finals, delta)
                    if progress is not None and delta.finished:
                        progress.update(1)
        except BaseException:
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [_best_of(finals[request.request_id], params)
                for request, params in zip(requests, params_list, strict=True)]

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
            prompts.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _new_request_id(self) -> str:
        self._next_request_id += 1
        return f"llm-{self._next_request_id}"

    def shutdown(self) -> None:
        """Stop the TP ranks and leave the process group; idempotent."""
        self._finalizer()

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[Prompt]:
    """Strings, token-id lists, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return [_one_prompt(p) for p in prompts]


def _one_prompt(prompt: object) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return [int(t) for t in prompt]  # type: ignore[union-attr]


def _best_of(final: RequestOutput, params: SamplingParams) -> RequestOutput:
    """best_of > n: the n sequences with the highest cumulative logprob, re-indexed 0..n-1
    (their logprobs were computed for the ranking: shown only if asked for)."""
    if params.num_seqs <= params.n:
        return final
    ranked = sorted(final.outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[:params.n]
    for index, out in enumerate(ranked):
        out.index = index
        if params.logprobs is None:
            out.logprobs = None
    final.outputs = ranked
    return final


def _accumulate(finals: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Fold a step's delta into the request's cumulative output (one CompletionOutput per
    choice index: n > 1 and best_of requests have several, in index order)."""
    new = delta.outputs[0]
    if delta.request_id not in finals:
        finals[delta.request_id] = RequestOutput(
            request_id=delta.request_id, prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids, outputs=[],
            finished=False, num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=delta.prompt_logprobs)
    final = finals[delta.request_id]
    out = next((o for o in final.outputs if o.index == new.index), None)
    if out is None:
        out = CompletionOutput(index=new.index, text="", token_ids=[],
                               logprobs=[] if new.logprobs is not None else None)
        final.outputs = sorted([*final.outputs, out], key=lambda o: o.index)
    out.text += new.text
    out.token_ids.extend(new.token_ids)
    if new.logprobs is not None and out.logprobs is not None:
        out.logprobs.extend(new.logprobs)
    out.cumulative_logprob = new.cumulative_logprob
    out.finish_reason, out.stop_reason = new.finish_reason, new.stop_reason
    final.finished = delta.finished
    final.num_cached_tokens = delta.num_cached_tokens
    final.kv_handoff = delta.kv_handoff
