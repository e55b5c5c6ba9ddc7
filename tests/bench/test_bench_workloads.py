"""Workloads of the goodput harness: arrival processes, random / shared-prefix prompts, and
Mooncake trace replay with prefix sharing kept through scaling."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import SHARED

from pdserve.benchmarks.arrivals import ArrivalConfig, arrival_offsets_s, trace_offsets_s
from pdserve.benchmarks.datasets import (
    DatasetError,
    TokenCodec,
    TraceScaling,
    block_token_ids,
    load_mooncake_trace,
    mooncake_requests,
    shared_prefix_requests,
)
from pdserve.benchmarks.vllm_datasets import random_requests

TRACE_DIR = SHARED / "traces"


@pytest.fixture(scope="module")
def codec(tokenizer_dir: Path) -> TokenCodec:
    return TokenCodec.load(str(tokenizer_dir))  # tokenizers alone, no transformers


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path):
    """What the server tokenizes with: lengths are checked against it, not against ourselves."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_seeded_poisson_has_the_requested_mean_rate() -> None:
    config = ArrivalConfig(request_rate=5.0, burstiness=1.0, seed=7)
    offsets_s = arrival_offsets_s(20_000, config)
    assert offsets_s[0] > 0.0 and np.all(np.diff(offsets_s) >= 0)
    # vLLM rescales the gaps so the last request goes out at exactly num_requests / rate.
    assert offsets_s[-1] == pytest.approx(20_000 / 5.0, rel=1e-12)
    gaps_s = np.diff(offsets_s)
    assert gaps_s.mean() == pytest.approx(0.2, rel=0.03)
    # Poisson: coefficient of variation 1 (gamma shape 1).
    assert gaps_s.std() / gaps_s.mean() == pytest.approx(1.0, rel=0.05)
    np.testing.assert_array_equal(offsets_s, arrival_offsets_s(20_000, config))
    assert not np.array_equal(offsets_s, arrival_offsets_s(20_000, ArrivalConfig(5.0, seed=8)))


def test_burstiness_keeps_the_rate_and_changes_the_spread() -> None:
    gaps_s = np.diff(arrival_offsets_s(20_000, ArrivalConfig(5.0, burstiness=0.25, seed=1)))
    assert gaps_s.mean() == pytest.approx(0.2, rel=0.05)
    # Gamma shape k: coefficient of variation 1 / sqrt(k) = 2.
    assert gaps_s.std() / gaps_s.mean() == pytest.approx(2.0, rel=0.1)


def test_infinite_rate_and_bad_configs() -> None:
    np.testing.assert_array_equal(arrival_offsets_s(4, ArrivalConfig(math.inf)), np.zeros(4))
    # Burstiness inf: evenly spaced, 1 / rate apart (vLLM's limit of the gamma).
    np.testing.assert_allclose(arrival_offsets_s(4, ArrivalConfig(2.0, math.inf)),
                               [0.5, 1.0, 1.5, 2.0])
    for bad in (dict(request_rate=0.0), dict(request_rate=-1.0), dict(burstiness=0.0)):
        with pytest.raises(ValueError):
            ArrivalConfig(**bad)


def test_trace_offsets_start_at_zero_and_scale() -> None:
    np.testing.assert_allclose(trace_offsets_s([1000, 1500, 4000], time_scale=0.1),
                               [0.0, 0.05, 0.3])
    with pytest.raises(ValueError):
        trace_offsets_s([10, 5])


def test_random_prompts_have_the_requested_token_lengths(codec: TokenCodec,
                                                         hf_tokenizer) -> None:
    requests = random_requests(codec, 8, input_len=64, output_len=16, range_ratio=0.5, seed=3)
    for request in requests:
        assert 32 <= request.prompt_len <= 96 and 8 <= request.expected_output_len <= 24
        # Re-tokenizing a prompt, as the server does, gives the length it claims.
        assert len(hf_tokenizer.encode(request.prompt, add_special_tokens=False)) == \
            request.prompt_len
    assert [r.prompt for r in requests] == \
        [r.prompt for r in random_requests(codec, 8, 64, 16, 0.5, seed=3)]
    with pytest.raises(DatasetError):
        random_requests(codec, 8, 64, 16, range_ratio=1.0)


def test_shared_prefix_groups(codec: TokenCodec) -> None:
    requests = shared_prefix_requests(codec, num_prefixes=3, num_suffixes=4, prefix_len=40,
                                      suffix_len=8, output_len=5, seed=0)
    assert len(requests) == 12
    heads = [r.prompt[:30] for r in requests]
    # 3 distinct heads, each shared by 4 prompts, and 12 distinct prompts.
    assert sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]
    assert len({r.prompt for r in requests}) == 12
    assert all(r.expected_output_len == 5 and r.prompt_len >= 48 for r in requests)


def test_tokenizer_load_needs_no_torch(tokenizer_dir: Path, tmp_path: Path) -> None:
    code = ("import sys; from pdserve.benchmarks.datasets import TokenCodec; "
            f"c = TokenCodec.load({str(tokenizer_dir)!r}); assert c.is_exact; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with pytest.raises(DatasetError):
        TokenCodec.load(str(tmp_path / "no-such-tokenizer"))


def test_same_block_id_gives_same_tokens_and_different_ids_differ() -> None:
    codec = TokenCodec(None)
    a = block_token_ids(codec, 42, 16, seed=0)
    np.testing.assert_array_equal(a, block_token_ids(codec, 42, 16, seed=0))
    assert not np.array_equal(a, block_token_ids(codec, 43, 16, seed=0))
    assert not np.array_equal(a, block_token_ids(codec, 42, 16, seed=1))


def _write_trace(path: Path, entries: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_trace_scaling_keeps_prefix_sharing(tmp_path: Path, codec: TokenCodec,
                                            hf_tokenizer) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1500, "output_length": 320, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 700, "output_length": 10, "hash_ids": [4, 5]},
    ])
    scaling = TraceScaling(time_scale=0.5, length_scale=1 / 32)  # 512 -> 16 tokens per block
    assert scaling.block_size == 16
    first, second, third = mooncake_requests(codec, load_mooncake_trace(trace), scaling)
    # Lengths scale with the block: ceil(len / 16) still equals the number of hash ids.
    assert (first.prompt_len, second.prompt_len, third.prompt_len) == (47, 34, 22)
    assert (first.expected_output_len, second.expected_output_len,
            third.expected_output_len) == (10, 2, 1)
    assert [r.arrival_offset_s for r in (first, second, third)] == [0.0, 1.0, 1.5]
    two_blocks = codec.decode(block_token_ids(codec, 0, 16)) + \
        codec.decode(block_token_ids(codec, 1, 16))
    # Shared ids 0, 1: both prompts start with the same two blocks' text ...
    assert first.prompt.startswith(two_blocks) and second.prompt.startswith(two_blocks)
    # ... and diverge right after (ids 2 vs 3); id 4's prompt shares nothing with them.
    assert first.prompt[len(two_blocks):][:8] != second.prompt[len(two_blocks):][:8]
    assert not third.prompt.startswith(first.prompt[:8])
    # In tokens, as the server sees them: whole-word block tokens re-tokenize exactly, so the
    # prompts are exactly as long as claimed and share exactly their two 16-token blocks.
    assert codec.is_exact
    a = hf_tokenizer.encode(first.prompt, add_special_tokens=False)
    b = hf_tokenizer.encode(second.prompt, add_special_tokens=False)
    assert (len(a), len(b)) == (first.prompt_len, second.prompt_len)
    np.testing.assert_array_equal(a[:32], np.concatenate(
        [block_token_ids(codec, 0, 16), block_token_ids(codec, 1, 16)]))
    assert a[:32] == b[:32] and a[32:34] != b[32:34]


def test_real_mooncake_trace_loads_and_scales() -> None:
    path = TRACE_DIR / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    entries = load_mooncake_trace(path, num_requests=50)
    requests = mooncake_requests(TokenCodec(None), entries, TraceScaling(0.01, 1 / 32))
    assert len(requests) == 50
    for entry, request in zip(entries, requests, strict=True):
        assert math.ceil(request.prompt_len / 16) == len(entry["hash_ids"])


def test_trace_errors_are_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError):
        load_mooncake_trace(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError):
        load_mooncake_trace(_write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0}]))
    (tmp_path / "garbage.jsonl").write_text("not json\n")
    with pytest.raises(DatasetError):
        load_mooncake_trace(tmp_path / "garbage.jsonl")
