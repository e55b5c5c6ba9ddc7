"""The `random` and `prefix_repetition` workloads exactly as `vllm bench serve` draws them.

Reproduces the sampling of vLLM 0.32 (`vllm/benchmarks/datasets`), call for call, so that for
the same flags, seed and tokenizer both clients send the same prompts; the tests hold pdserve
to a fixture recorded from vLLM itself (benchmarks/record_vllm_workload.py).

random (its own `np.random.default_rng(seed)`, in this order):
  1. input lengths  ~ integers[floor(L' (1 - r_in)), ceil(L' (1 + r_in))], L' = input_len minus
     the tokens the tokenizer adds; output lengths ~ integers[max(1, floor(O (1 - r_out))),
     max(1, ceil(O (1 + r_out)))]; vocabulary offsets ~ integers[0, vocab_size);
  2. a shared prefix of `prefix_len` ids drawn from the allowed (non-special) ids, fixed up;
  3. per request i: the allowed ids at (offset_i + i + 0..len-1) mod num_allowed after the
     prefix, fixed up to prefix_len + len tokens.
prefix_repetition (the process-wide legacy numpy RNG and Python's `random`, both seeded):
  for each prefix, ids ~ randint[0, vocab_size), fixed up; for each of its
  num_prompts // num_prefixes suffixes the same; then Python's `random.shuffle` of the list.
  The arrival gaps are drawn afterwards from that same legacy RNG (see arrivals.py).

"Fixed up" is vLLM's decode / re-encode loop: decode the ids, encode the text; if too short,
append ids ~ [0, vocab_size) from the same RNG, if too long, truncate; at most 10 rounds.
The prompt is the text of the last decode.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.benchmarks.datasets import BenchRequest, DatasetError, TokenCodec

VLLM_SAMPLING_VERSION = "0.32.0"
_MAX_FIXUP_ROUNDS = 10


def parse_range_ratio(value: str | float | dict) -> tuple[float, float]:
    """`--random-range-ratio` as vLLM takes it: one float, or JSON {"input": a, "output": b}."""
    if isinstance(value, dict):
        parsed: Any = value
    elif isinstance(value, float | int):
        parsed = float(value)
    else:
        try:
            parsed = float(value)
        except ValueError:
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as e:
                raise DatasetError(f"--random-range-ratio {value!r}: not a float or JSON") from e
    if isinstance(parsed, dict):
        try:
            ratios = (float(parsed["input"]), float(parsed["output"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(
                "--random-range-ratio as JSON needs numeric 'input' and 'output' keys"
            ) from e
    else:
        ratios = (parsed, parsed)
    for ratio in ratios:
        if not 0.0 <= ratio < 1.0:
            raise DatasetError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return ratios


def _draw_ids(rng: np.random.Generator | np.random.RandomState, high: int, size: int) -> list[int]:
    # vLLM draws from its dataset's Generator when it has one, else from the legacy global RNG.
    if isinstance(rng, np.random.Generator):
        return rng.integers(0, high, size=size).tolist()
    return rng.randint(0, high, size=size).tolist()


def fix_up_length(
    codec: TokenCodec,
    token_ids: list[int],
    target_len: int,
    rng: np.random.Generator | np.random.RandomState,
) -> tuple[str, list[int]]:
    """vLLM's decode / re-encode loop; returns (prompt text, its token ids)."""
    if not codec.has_tokenizer:
        return codec.decode(token_ids), list(token_ids)  # words: lengths are nominal
    tokenizer = codec.tokenizer
    rounds_left = _MAX_FIXUP_ROUNDS
    while True:
        prompt = tokenizer.decode(token_ids)
        token_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        if rounds_left <= 0 or len(token_ids) == target_len:
            return prompt, token_ids
        if len(token_ids) < target_len:
            token_ids += _draw_ids(rng, codec.vocab_size, target_len - len(token_ids))
        else:
            token_ids = token_ids[:target_len]
        rounds_left -= 1


def random_requests(
    codec: TokenCodec,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: str | float | dict = 0.0,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """vLLM's `random` dataset: `num_prompts` prompts of about prefix_len + input_len tokens."""
    if num_prompts < 1 or output_len < 1 or prefix_len < 0:
        raise DatasetError(
            "random dataset needs num_prompts and output length >= 1, prefix length >= 0"
        )
    input_ratio, output_ratio = parse_range_ratio(range_ratio)
    real_input_len = max(0, input_len - codec.num_special_tokens_to_add)
    input_low = math.floor(real_input_len * (1 - input_ratio))
    input_high = math.ceil(real_input_len * (1 + input_ratio))
    if prefix_len + input_low < 1:
        raise DatasetError(
            f"--random-input-len {input_len} is too small: with the "
            f"tokenizer's {codec.num_special_tokens_to_add} special tokens and "
            f"range ratio {input_ratio} a prompt could be empty"
        )
    output_low = max(1, math.floor(output_len * (1 - output_ratio)))
    output_high = max(1, math.ceil(output_len * (1 + output_ratio)))
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_low, input_high + 1, size=num_prompts)
    output_lens = rng.integers(output_low, output_high + 1, size=num_prompts)
    offsets = rng.integers(0, codec.vocab_size, size=num_prompts)
    allowed = codec.allowed_ids
    prefix_ids: list[int] = []
    if prefix_len > 0:
        prefix_ids = allowed[rng.integers(0, allowed.size, size=prefix_len)].tolist()
        _, prefix_ids = fix_up_length(codec, prefix_ids, prefix_len, rng)
    requests = []
    for i in range(num_prompts):
        # A sliding window over the allowed ids: cheap, and different for every request.
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % allowed.size]
        prompt, ids = fix_up_length(
            codec, prefix_ids + inner.tolist(), prefix_len + int(input_lens[i]), rng
        )
        requests.append(BenchRequest(prompt, len(ids), int(output_lens[i])))
    return requests


def prefix_repetition_requests(
    codec: TokenCodec,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    legacy_rng: np.random.RandomState,
    shuffle_seed: int | None,
) -> list[BenchRequest]:
    """vLLM's `prefix_repetition` dataset: num_prefixes x (num_prompts // num_prefixes) prompts.

    `legacy_rng` stands for vLLM's seeded global numpy RNG and is advanced in place (the
    arrival gaps continue from it); `shuffle_seed` None keeps vLLM's --disable-shuffle order.
    """
    if min(prefix_len, suffix_len, num_prefixes, output_len) < 1:
        raise DatasetError("prefix_repetition needs every length and count >= 1")
    per_prefix = num_prompts // num_prefixes
    if per_prefix == 0:
        raise DatasetError(
            f"--num-prompts {num_prompts} must be >= "
            f"--prefix-repetition-num-prefixes {num_prefixes}"
        )

    def exact_ids(length: int) -> list[int]:
        ids = legacy_rng.randint(0, codec.vocab_size, size=length).tolist()
        return fix_up_length(codec, ids, length, legacy_rng)[1]

    requests = []
    for _ in range(num_prefixes):
        prefix_ids = exact_ids(prefix_len)
        for _ in range(per_prefix):
            ids = prefix_ids + exact_ids(suffix_len)
            requests.append(BenchRequest(codec.decode(ids), len(ids), output_len))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(requests)
    return requests


def same_prompts(a: Sequence[BenchRequest], b: Sequence[BenchRequest]) -> bool:
    """Whether two workloads send the same prompts with the same lengths, in order."""
    return [(r.prompt, r.prompt_len, r.expected_output_len) for r in a] == [
        (r.prompt, r.prompt_len, r.expected_output_len) for r in b
    ]
