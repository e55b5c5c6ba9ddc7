"""Sampling on the logits' device: the batched sampler gives the host sampler's tokens and
logprobs (tests/helpers/sampler_reference.py) on every option, and nothing larger than the
batch (plus the logprobs asked for) leaves for the host while it samples."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.host_reads import host_reads
from helpers.sampler_reference import HostSampler

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.engine.request import Request
from pdserve.serve.engine.sampler import Sampler

VOCAB = 97
EOS = 3


def make_request(request_id: str, **params: object) -> Request:
    request = Request(request_id, [1, 2, 5, 5, 9], SamplingParams(**params), max_tokens=64,
                      eos_token_ids=(EOS,))
    request.bad_words_token_ids = [[7], [11, 12]] if params.get("bad_words") else []
    return request


OPTIONS = [
    dict(temperature=0),
    dict(temperature=0, min_tokens=4),
    dict(temperature=0.7),
    dict(temperature=1.0, seed=11),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8, seed=5),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05, seed=2),
    dict(temperature=0, repetition_penalty=1.3),
    dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, seed=9),
    dict(temperature=0, logit_bias={4: 5.0, 8: -100.0}),
    dict(temperature=1.0, allowed_token_ids=[4, 8, 15, 16, 23, 42], seed=3),
    dict(temperature=0, bad_words=("x",)),
    dict(temperature=0.8, stop_token_ids=[6], min_tokens=3),
    dict(temperature=0, logprobs=3),
    dict(temperature=1.0, logprobs=0, seed=4),
    dict(temperature=1.1, top_k=7, logprobs=5),
]


def run_both(options: list[dict], num_steps: int, seed: int) -> tuple[list, list]:
    """Sample the same requests with both samplers, step after step, from the same logits."""
    samplers = (Sampler(seed), HostSampler(seed))
    batches = [[make_request(f"r{i}", **o) for i, o in enumerate(options)] for _ in samplers]
    generator = torch.Generator().manual_seed(seed)
    got: tuple[list, list] = ([], [])
    for _ in range(num_steps):
        logits = torch.randn(len(options), VOCAB, generator=generator) * 3
        for sampler, requests, out in zip(samplers, batches, got, strict=True):
            results = sampler(logits.clone(), requests)
            for request, result in zip(requests, results, strict=True):
                request.append_output_token(result.token_id, result.logprobs)
            out.append([(r.token_id, r.logprobs) for r in results])
    return got


def test_every_option_gives_the_host_samplers_tokens_and_logprobs() -> None:
    device, host = run_both(OPTIONS, num_steps=8, seed=0)
    assert device == host


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_mixes_of_options_match(seed: int) -> None:
    rng = random.Random(seed)
    options = [{**rng.choice(OPTIONS), **rng.choice(OPTIONS)} for _ in range(12)]
    device, host = run_both(options, num_steps=6, seed=seed)
    assert device == host


def test_only_the_sampled_ids_leave_for_the_host() -> None:
    options = [o for o in OPTIONS if "logprobs" not in o]
    requests = [make_request(f"r{i}", **o) for i, o in enumerate(options)]
    logits = torch.randn(len(requests), VOCAB)
    with host_reads() as seen:
        Sampler(0)(logits, requests)
    assert seen and all(numel <= len(requests) for _, numel in seen), seen


def test_logprobs_cross_once_and_no_larger_than_asked() -> None:
    requests = [make_request(f"r{i}", **o) for i, o in enumerate(OPTIONS)]
    logits = torch.randn(len(requests), VOCAB)
    max_top = max(o.get("logprobs") or 0 for o in OPTIONS)
    with host_reads() as seen:
        Sampler(0)(logits, requests)
    assert all(numel <= len(requests) * (2 + max_top) for _, numel in seen), seen
    assert len(seen) == 3  # the ids, then one read each of the logprob values and their ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_sampling_never_waits_for_the_device() -> None:
    requests = [make_request(f"r{i}", **o) for i, o in enumerate(OPTIONS)
                if "logprobs" not in o]
    logits = torch.randn(len(requests), VOCAB, device="cuda")
    sampler = Sampler(0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids, _ = sampler.sample(logits, requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy
              and not r.sampling_params.has_penalties and not r.sampling_params.has_logit_controls
              and r.sampling_params.min_tokens == 0]
    assert token_ids[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()
