"""A decode step's sampling never makes the host wait for the device but once: the logits are
tagged as device tensors (tests/helpers/host_reads.py) and a mixed batch (greedy, temperature,
top-k, top-p, min-p, seeded, penalties, logit bias, allowed ids, bad words, min_tokens,
logprobs) is sampled; the one read is the packed copy of ids and logprobs, and nothing
vocabulary-sized goes down. The recorder itself is checked on each thing it must catch."""

from __future__ import annotations

import pytest
import torch
from helpers.host_reads import host_reads

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.engine.request import Request
from pdserve.serve.engine.sampler import Sampler, apply_top_k, apply_top_p

VOCAB = 300
EOS = 3

MIXED = [
    dict(temperature=0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, top_k=20, top_p=0.9, seed=2),
    dict(temperature=1.0, min_p=0.1, seed=11),
    dict(temperature=1.0, seed=7, logprobs=2),
    dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=0.8, logit_bias={4: 5.0, 8: -100.0}, min_tokens=5),
    dict(temperature=1.0, allowed_token_ids=[4, 8, 15, 16, 23, 42], seed=3),
    dict(temperature=0, bad_words=("x",), logprobs=0),
    dict(temperature=1.1, top_p=0.5, stop_token_ids=[6], min_tokens=3, logprobs=4),
]


def make_request(request_id: str, **params: object) -> Request:
    request = Request(request_id, [1, 2, 5, 5, 9], SamplingParams(**params), max_tokens=64,
                      eos_token_ids=(EOS,))
    request.bad_words_token_ids = [[7], [11, 12]] if params.get("bad_words") else []
    for token_id in (11, 40, 40):  # some output so far, for penalties and bad words
        request.append_output_token(token_id)
    return request


def test_a_mixed_decode_step_reads_once_and_sends_nothing_vocabulary_sized() -> None:
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    requests = [make_request(f"r{i}", **o) for i, o in enumerate(MIXED)]
    expected = Sampler(0)(logits.clone(), requests)
    tagged = logits.clone()
    with host_reads(tagged) as seen:
        got = Sampler(0)(tagged, requests)
    assert got == expected  # the recorder changes nothing
    assert [what for what, _ in seen] == ["copy_to_host"], seen
    num_asked = sum(o.get("logprobs") is not None for o in MIXED)
    max_top = max(o.get("logprobs") or 0 for o in MIXED)
    assert seen[0][1] == len(MIXED) + num_asked * (3 + 2 * max_top)
    assert seen.uploads and all(numel < VOCAB for _, numel in seen.uploads), seen.uploads


def test_without_logprobs_sampling_on_the_device_waits_for_nothing() -> None:
    options = [o for o in MIXED if "logprobs" not in o]
    requests = [make_request(f"r{i}", **o) for i, o in enumerate(options)]
    logits = torch.randn(len(options), VOCAB)
    with host_reads(logits) as seen:
        token_ids, logprobs = Sampler(0).sample(logits, requests)
        Sampler(0).sampling_probs(logits, requests)
    assert logprobs == [None] * len(options)
    assert [what for what, _ in seen] == ["copy_to_host"], seen  # queued, never read here


def test_top_p_over_top_k_candidates_equals_ranking_the_whole_row() -> None:
    """Exact, ties included: logits rounded to bf16 tie often, at the k-th and beyond it."""
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(64, VOCAB, generator=generator) * 2).bfloat16().float()
    top_k = torch.randint(1, 40, (64,), generator=generator)
    top_p = torch.rand(64, generator=generator).clamp(0.05, 1.0)
    masked = apply_top_k(logits, top_k, max_k=int(top_k.max()))
    bounded = apply_top_p(masked, top_p, max_candidates=int(top_k.max()))
    assert torch.equal(bounded, apply_top_p(masked, top_p))
    assert torch.isfinite(bounded).sum(dim=1).min() >= 1


def device_tensor() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32)


CAUGHT = {
    "item": lambda t: t[0].item(),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "int": lambda t: int(t[1]),
    "float": lambda t: float(t.sum()),
    "bool": lambda t: bool((t > 2).any()),
    "to_host": lambda t: t.to("cpu"),
    "copy_to_host": lambda t: torch.empty(6).copy_(t),
    "nonzero": lambda t: t.nonzero(),
    "mask_index": lambda t: t[t > 2],
    "list_index": lambda t: t[[0, 2]],
    "host_index": lambda t: t[torch.tensor([0, 2])],
    "tensor_to_device": lambda t: torch.tensor([1.0, 2.0], device=t.device) + t[:2],
    "to_device_blocking": lambda t: t + torch.ones(6).to(t.device),
    "host_tensor_in_device_op": lambda t: t + torch.ones(6),
    "bincount": lambda t: torch.bincount(t.long()),
}


@pytest.mark.parametrize("what", sorted(CAUGHT))
def test_the_recorder_catches(what: str) -> None:
    tensor = device_tensor()
    with host_reads(tensor) as seen:
        CAUGHT[what](tensor)
    assert what in [w for w, _ in seen], seen


def test_the_recorder_lets_device_work_and_unwaited_uploads_pass() -> None:
    tensor = device_tensor()
    with host_reads(tensor) as seen:
        index = torch.tensor([0, 2]).to(tensor.device, non_blocking=True)
        picked = tensor.index_select(0, index) * 2
        mask = torch.zeros(6, dtype=torch.bool, device=tensor.device)
        mask.index_fill_(0, index, True)
        filled = tensor.masked_fill(mask, float("-inf")).topk(2).values
        torch.where(filled > 0, filled, picked).argmax()
        int(torch.ones(3).sum())  # a host tensor's read is no wait
    assert list(seen) == [] and seen.uploads == [("to_device", 2)]
