"""Record the workload `vllm bench serve` draws, as a JSON fixture for pdserve's tests.

Runs under the vLLM peer's python (it imports vLLM), never under pdserve:

    ../shared/tools/vllm-peer python benchmarks/record_vllm_workload.py \\
        tests/data/vllm_workload_tokenizer tests/data/vllm_workload.json

For each case it parses the flags with vLLM's own parser, seeds the global RNGs as
`vllm bench serve` does, samples the dataset with vLLM's own `get_samples`, and runs vLLM's own
arrival generator (`serve.get_request`) on a virtual clock, so the recorded send offsets are
exactly the sleeps vLLM would take, without waiting for them.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import types

import numpy as np

# (name, flags): small on purpose, the fixture is committed.
CASES: list[tuple[str, list[str]]] = [
    (
        "random-poisson",
        [
            "--dataset-name",
            "random",
            "--num-prompts",
            "12",
            "--seed",
            "0",
            "--random-input-len",
            "64",
            "--random-output-len",
            "16",
            "--request-rate",
            "4",
        ],
    ),
    (
        "random-gamma-range-prefix",
        [
            "--dataset-name",
            "random",
            "--num-prompts",
            "10",
            "--seed",
            "7",
            "--random-input-len",
            "48",
            "--random-output-len",
            "12",
            "--random-range-ratio",
            "0.5",
            "--random-prefix-len",
            "8",
            "--request-rate",
            "2.5",
            "--burstiness",
            "0.5",
        ],
    ),
    (
        "random-inf-rate",
        [
            "--dataset-name",
            "random",
            "--num-prompts",
            "6",
            "--seed",
            "3",
            "--random-input-len",
            "100",
            "--random-output-len",
            "8",
            "--random-range-ratio",
            "0.25",
        ],
    ),
    (
        "random-smooth",
        [
            "--dataset-name",
            "random",
            "--num-prompts",
            "16",
            "--seed",
            "11",
            "--random-input-len",
            "24",
            "--random-output-len",
            "4",
            "--request-rate",
            "20",
            "--burstiness",
            "4",
        ],
    ),
    (
        "prefix-repetition",
        [
            "--dataset-name",
            "prefix_repetition",
            "--num-prompts",
            "13",
            "--seed",
            "1",
            "--prefix-repetition-prefix-len",
            "32",
            "--prefix-repetition-suffix-len",
            "16",
            "--prefix-repetition-num-prefixes",
            "3",
            "--prefix-repetition-output-len",
            "8",
            "--request-rate",
            "5",
            "--burstiness",
            "2",
        ],
    ),
]


class _VirtualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def time(self) -> float:
        return self.now_s

    async def sleep(self, delay_s: float) -> None:
        self.now_s += max(0.0, delay_s)


def _arrival_offsets_s(serve, requests, args) -> list[float]:
    clock = _VirtualClock()
    real_time, real_asyncio = serve.time, serve.asyncio
    serve.time = types.SimpleNamespace(time=clock.time, perf_counter=clock.time)
    serve.asyncio = types.SimpleNamespace(sleep=clock.sleep)

    async def collect() -> list[float]:
        offsets = []
        async for _request, _rate in serve.get_request(
            requests, args.request_rate, args.burstiness
        ):
            offsets.append(clock.now_s)
        return offsets

    try:
        return asyncio.run(collect())
    finally:
        serve.time, serve.asyncio = real_time, real_asyncio


def record(tokenizer_dir: str) -> dict:
    import vllm
    from vllm.benchmarks import serve
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cases = []
    for name, flags in CASES:
        parser = FlexibleArgumentParser()
        serve.add_cli_args(parser)
        args = parser.parse_args([*flags, "--model", tokenizer_dir])
        # As serve.main_async does, in its order: seed, tokenizer, samples, then arrivals.
        random.seed(args.seed)
        np.random.seed(args.seed)
        tokenizer = get_tokenizer(tokenizer_dir)
        args.request_id_prefix = ""
        requests = get_samples(args, tokenizer)
        offsets = _arrival_offsets_s(serve, requests, args)
        cases.append(
            {
                "name": name,
                "flags": flags,
                "prompts": [r.prompt for r in requests],
                "prompt_lens": [int(r.prompt_len) for r in requests],
                "output_lens": [int(r.expected_output_len) for r in requests],
                "arrival_offsets_s": offsets,
            }
        )
    return {
        "vllm_version": vllm.__version__,
        "tokenizer": "vllm_workload_tokenizer",
        "cases": cases,
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} TOKENIZER_DIR OUT.json")
    document = record(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
    print(f"wrote {sys.argv[2]}: {len(document['cases'])} cases, vLLM {document['vllm_version']}")
