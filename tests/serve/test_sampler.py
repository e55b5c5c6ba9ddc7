"""Sampler masks and penalties against independent references; seeded draws reproducible and
resumable from (seed, i); incremental detokenization and stop strings cut exactly."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.engine.detokenizer import IncrementalDetokenizer
from pdserve.serve.engine.request import Request
from pdserve.serve.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from pdserve.serve.engine.seeded_draw import seeded_uniform

VOCAB = 50
EOS = 3


def make_request(request_id: str = "r", prompt: list[int] | None = None,
                 **params: object) -> Request:
    return Request(request_id, prompt or [1, 2], SamplingParams(**params), max_tokens=64,
                   eos_token_ids=(EOS,))


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in masked]


def softmax_list(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    return [e / sum(exps) for e in exps]


def test_top_k_mask_matches_reference() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[3, :5] = 9.0  # a tie at the k-th value keeps every tied token
    ks = [1, 7, 0, 3]
    got = kept(apply_top_k(logits, torch.tensor(ks)))
    for row, k in enumerate(ks):
        values = logits[row].tolist()
        kth = sorted(values, reverse=True)[k - 1] if k else -math.inf
        assert got[row] == {i for i, v in enumerate(values) if v >= kth}
    assert got[3] == set(range(5))


def test_top_p_mask_matches_reference() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    ps = [0.1, 0.5, 0.9, 1.0, 1e-6]
    got = kept(apply_top_p(logits, torch.tensor(ps)))
    for row, p in enumerate(ps):
        probs = softmax_list(logits[row].tolist())
        order = sorted(range(VOCAB), key=lambda i: -probs[i])
        expected, mass = set(), 0.0
        for i in order:  # the smallest prefix whose mass reaches p
            expected.add(i)
            mass += probs[i]
            if mass >= p:
                break
        assert got[row] == expected, row
    assert len(got[4]) == 1


def test_min_p_mask_matches_reference() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    ps = [0.0, 0.05, 0.5]
    got = kept(apply_min_p(logits, torch.tensor(ps)))
    for row, p in enumerate(ps):
        probs = softmax_list(logits[row].tolist())
        assert got[row] == {i for i, q in enumerate(probs) if q >= p * max(probs) - 1e-9}


def test_penalties_equal_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    got = apply_penalties(logits, prompt_ids=[[0, 3]], output_ids=[[1, 1, 4]],
                          presence=torch.tensor([0.25]), frequency=torch.tensor([0.5]),
                          repetition=torch.tensor([2.0]))
    # token 0: in prompt, positive: 2/2. token 1: output twice, negative: -1*2 - 0.5*2 - 0.25
    # token 3: prompt, negative: -3*2. token 4: output once: 1/2 - 0.5 - 0.25
    expected = [1.0, -3.25, 0.5, -6.0, -0.25, 0.0]
    assert got[0].tolist() == pytest.approx(expected)


def test_greedy_is_argmax_and_min_tokens_suppresses_eos() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 5.0
    logits[:, 9] = 4.0
    logits[:, 11] = 4.5
    requests = [make_request("a", temperature=0),
                make_request("b", temperature=0, min_tokens=2, stop_token_ids=[11]),
                make_request("c", temperature=0, min_tokens=2, ignore_eos=True)]
    before = logits.clone()
    tokens = [r.token_id for r in Sampler(0)(logits, requests)]
    assert tokens == [EOS, 9, EOS]  # ignore_eos means "do not stop", not "never sample"
    assert torch.equal(logits, before)  # masked on a copy: the caller's rows stay as they were
    biased = [make_request("d", temperature=0, logit_bias={9: 10.0})]
    assert [r.token_id for r in Sampler(0)(logits[:1], biased)] == [9]
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    requests = [make_request(str(i), temperature=2.0, top_k=1) for i in range(4)]
    tokens = [r.token_id for r in Sampler(5)(logits, requests)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_logprobs_top_n_and_sampled_rank() -> None:
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)
    result = Sampler(0)(logits, [make_request(temperature=1.0, top_k=3, logprobs=2,
                                              seed=1)])[0]
    reference = torch.log_softmax(logits[0], dim=-1)
    assert result.token_id in (47, 48, 49)
    assert set(result.logprobs) == {49, 48, result.token_id}
    for token_id, entry in result.logprobs.items():
        assert entry.logprob == pytest.approx(float(reference[token_id]))
        assert entry.rank == VOCAB - token_id


def step_logits(step: int) -> torch.Tensor:
    """The 'model': fixed logits per step, independent of who samples."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step))


def sample_sequence(sampler: Sampler, request: Request, num_tokens: int,
                    batch_noise: int = 0) -> list[int]:
    """Sample num_tokens more for request, next to batch_noise unseeded neighbours."""
    for _ in range(num_tokens):
        step = request.num_output_tokens
        neighbours = [make_request(f"n{j}", temperature=1.0) for j in range(batch_noise)]
        logits = torch.stack([step_logits(step)] + [torch.randn(VOCAB)] * batch_noise)
        result = sampler(logits, [request] + neighbours)[0]
        request.append_output_token(result.token_id)
    return list(request.output_token_ids)


def test_seeded_sampling_is_reproducible_and_resumable() -> None:
    params = dict(temperature=1.3, top_p=0.95, seed=1234)
    full = sample_sequence(Sampler(0), make_request(**params), 20)
    again = sample_sequence(Sampler(99), make_request(**params), 20, batch_noise=3)
    assert again == full
    # a "decode worker" that knows only the first 12 tokens and the seed continues exactly
    resumed = make_request(**params)
    for token_id in full[:12]:
        resumed.append_output_token(token_id)
    assert sample_sequence(Sampler(7), resumed, 8, batch_noise=2) == full
    other = sample_sequence(Sampler(0), make_request(**{**params, "seed": 4321}), 20)
    assert other != full
    assert seeded_uniform(1234, 5) == seeded_uniform(1234, 5) != seeded_uniform(1234, 6)


def test_unseeded_sampling_follows_the_engine_seed() -> None:
    a = sample_sequence(Sampler(3), make_request(temperature=1.0), 10)
    b = sample_sequence(Sampler(3), make_request(temperature=1.0), 10)
    c = sample_sequence(Sampler(4), make_request(temperature=1.0), 10)
    assert a == b and a != c


# ---- detokenization and stop strings ------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


TEXT = "def hello_world(x):\n    return x + 1  # stop here, then more text"


def stream(tokenizer, text: str, **params: object) -> tuple[IncrementalDetokenizer, str | None,
                                                            str, int]:
    """Feed text's tokens one by one; returns (detok, stop, streamed deltas, tokens fed)."""
    token_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, make_request(prompt=[5, 6], **params))
    streamed, stop, fed = "", None, 0
    for token_id in token_ids:
        fed += 1
        stop = detok.update([token_id])
        streamed += detok.take_delta(finished=stop is not None)
        if stop is not None:
            break
    streamed += detok.take_delta(finished=True)
    return detok, stop, streamed, fed


def test_incremental_text_equals_full_decode(tokenizer) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # random ids include byte tokens that split UTF-8 characters
        token_ids = torch.randint(0, len(tokenizer), (40,), generator=gen).tolist()
        detok = IncrementalDetokenizer(tokenizer, make_request())
        streamed = ""
        for token_id in token_ids:
            detok.update([token_id])
            streamed += detok.take_delta(finished=False)
        streamed += detok.take_delta(finished=True)
        full = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert streamed == detok.text
        # equal up to a trailing incomplete character, which is held back
        assert streamed.rstrip("\ufffd") == full.rstrip("\ufffd")
    detok, stop, streamed, _ = stream(tokenizer, "héllo wörld ✓ done")
    assert stop is None and streamed == "héllo wörld ✓ done"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_cuts_exactly(tokenizer, include: bool) -> None:
    stop_str = "1  # st"
    token_texts = [tokenizer.decode([t]) for t in tokenizer.encode(TEXT)]
    assert not any(stop_str in t for t in token_texts)  # it spans several tokens
    detok, stop, streamed, fed = stream(tokenizer, TEXT, stop=["never", stop_str],
                                        include_stop_str_in_output=include)
    cut = TEXT.index(stop_str) + (len(stop_str) if include else 0)
    assert stop == stop_str
    assert detok.text == streamed == TEXT[:cut]
    # it stopped at the token that completed the stop string, not later
    assert stop_str in "".join(token_texts[:fed]) and stop_str not in "".join(token_texts[:fed - 1])


def test_earliest_stop_string_wins_and_streaming_never_leaks_it(tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, make_request(stop=["here", "return"]))
    deltas = []
    for token_id in token_ids:
        stop = detok.update([token_id])
        deltas.append(detok.take_delta(finished=stop is not None))
        if stop is not None:
            break
    assert stop == "return"
    assert "".join(deltas) == TEXT[:TEXT.index("return")]
    assert all("ret" not in d for d in deltas)


def test_stop_token_text_is_left_out_unless_included(tokenizer) -> None:
    token_ids = tokenizer.encode("abc xyz")
    for include, expected in ((False, tokenizer.decode(token_ids[:-1])),
                              (True, "abc xyz")):
        detok = IncrementalDetokenizer(tokenizer, make_request(include_stop_str_in_output=include))
        detok.update(token_ids[:-1])
        detok.update(token_ids[-1:], stop_terminated=True)
        assert detok.text == expected
