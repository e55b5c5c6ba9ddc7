"""vLLM's offline decode step and prefill time, as step_roofline measures pdserve's.

Runs inside vLLM's own venv (../shared/tools/vllm-peer python
benchmarks/peer_step.py ...), so
it imports nothing of pdserve. Prints one JSON object on its last line:

    {"decode": [{"batch", "context", "step_s"}], "prefill": [{"tokens", "seconds"}]}

Every timed prompt is fresh (random tokens from a new seed; prefix caching off), so nothing
is served from a cache. The decode step is timed as step_roofline times pdserve's: the batch's
prompts are added to vLLM's engine, stepped through their prefill and --warmup-steps decode
steps untimed, then N decode steps are timed one by one and the median is the step; with
--rounds the sweep runs that many times and a point's step is the median of its rounds'.
(Not (time to generate N tokens - time to generate 1) / (N - 1): at batch 8 and 32 the
prefill both runs share is most of either, and its noise divided by N swamps a step.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--decode-tokens", type=int, default=12, help="decode steps timed")
    parser.add_argument("--warmup-steps", type=int, default=24,
                        help="untimed decode steps after the prefill, before the timed ones")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="decode sweeps; a point's step is the median of its rounds'")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--dtype", default="float32",
                        help="float32, or the checkpoint's own bfloat16/float16")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt

    budget = max(2048, max(args.prefill_lengths))  # tokens per step, as step_roofline's
    # the batch's first prompts decode while the last still prefill (one token ahead per
    # prefill step): they must not finish inside the timed steps
    head_start = -(-max(args.batch_sizes) * max(args.contexts) // budget) + 1
    longest = max(args.contexts + args.prefill_lengths) + args.warmup_steps \
        + args.decode_tokens + head_start + 8
    llm = LLM(args.model, dtype=args.dtype, max_model_len=longest, enable_prefix_caching=False,
              max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(budget, longest),
              seed=0)
    llm.wait_for_cpu_path()  # time the CPU path a worker ends on, not its first one
    rng = random.Random(1234)

    def fresh(length: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[rng.randrange(10, args.vocab_size)
                                              for _ in range(length)])

    def timed(prompts: list[TokensPrompt], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed([fresh(32)], 4)  # warm-up
    engine = llm.llm_engine
    request_ids = itertools.count()

    def decode_step_s(prompts: list[TokensPrompt], steps: int) -> float:
        params = SamplingParams(temperature=0,
                                max_tokens=args.warmup_steps + steps + head_start + 4,
                                ignore_eos=True)
        pending = set()
        for prompt in prompts:
            request_id = f"decode-{next(request_ids)}"
            engine.add_request(request_id, prompt, params)
            pending.add(request_id)
        request_ids_added = set(pending)
        deadline = time.monotonic() + 600
        while pending and time.monotonic() < deadline:  # prefill (chunked), untimed
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    pending.discard(out.request_id)
        for _ in range(args.warmup_steps):
            engine.step()
        times = []
        for _ in range(steps):
            if engine.get_num_unfinished_requests() != len(prompts):
                raise RuntimeError(f"{engine.get_num_unfinished_requests()} of {len(prompts)} "
                                   "sequences left to time")
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        engine.abort_request(list(request_ids_added))  # the tokens left were only a margin
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            engine.step()
        times.sort()
        return times[len(times) // 2]

    rounds: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):  # whole sweeps, so a noisy minute spreads over every point
        for context in args.contexts:
            for batch in args.batch_sizes:
                step_s = decode_step_s([fresh(context) for _ in range(batch)],
                                       args.decode_tokens)
                rounds.setdefault((batch, context), []).append(step_s)
                print(f"vllm decode batch {batch} context {context}: {step_s * 1e3:.2f} ms",
                      flush=True)
    decode = [{"batch": batch, "context": context, "step_s": sorted(values)[len(values) // 2],
               "rounds_s": values} for (batch, context), values in rounds.items()]
    prefill = []
    for length in args.prefill_lengths:
        seconds = min(timed([fresh(length)], 1) for _ in range(args.repeats))
        prefill.append({"tokens": length, "seconds": seconds})
        print(f"vllm prefill {length}: {seconds * 1e3:.1f} ms", flush=True)
    print(json.dumps({"decode": decode, "prefill": prefill}))


if __name__ == "__main__":
    main()
