"""Seeded rows' noise (pdserve/serve/engine/seeded_noise.py): fixed bits for a (seed, index),
the same on CPU and GPU, Exponential(1) in distribution; and the samples it draws follow the
sampling distribution. Top-p's threshold search keeps exactly the sort's set."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.host_reads import host_reads

from pdserve.serve.engine.sampler import _top_p_candidates_threshold, apply_top_p
from pdserve.serve.engine.seeded_noise import keyed_noise, seeded_noise, token_key

# The first 4 draws of (seed 1234, index 5) and (seed 0, index 0), as float32 hex: any device
# must give these bits (a worker on another device continues a seeded request from them).
KNOWN = [["0x1.a22008p-2", "0x1.466aap-2", "0x1.d4e2e6p-1", "0x1.432782p-2"],
         ["0x1.3aa228p+0", "0x1.1cec6cp-1", "0x1.f3bd06p-6", "0x1.d8eb9ep-5"]]


def test_noise_has_fixed_bits_for_a_seed_and_index() -> None:
    noise = seeded_noise([1234, 0], [5, 0], vocab_size=4)
    assert noise.dtype == torch.float32
    assert noise.tolist() == [[float.fromhex(v) for v in row] for row in KNOWN]
    # a row's noise depends on its own key only, not on the batch or the vocabulary size
    wide = seeded_noise([7, 1234], [3, 5], vocab_size=1000)
    assert torch.equal(wide[1, :4], noise[0])
    assert not torch.equal(wide[0, :4], noise[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_is_the_same_on_cpu_and_gpu() -> None:
    seeds, indices = list(range(16)), [s * 3 for s in range(16)]
    cpu = seeded_noise(seeds, indices, 50_000)
    gpu = seeded_noise(seeds, indices, 50_000, "cuda").cpu()
    assert torch.equal(cpu, gpu)


def test_noise_is_exponential() -> None:
    noise = keyed_noise(torch.tensor([token_key(s, i) for s in range(8) for i in range(8)]),
                        4096).double()
    assert noise.min() > 0
    # 262144 draws: the mean's standard error is 0.002, a tail fraction's under 0.001
    assert abs(noise.mean().item() - 1.0) < 0.01
    for x in (0.1, 1.0, 3.0):
        assert abs((noise > x).double().mean().item() - math.exp(-x)) < 0.005, x
    # consecutive token ids and consecutive indices are not correlated
    flat = noise.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()) < 0.01


def test_seeded_draws_follow_the_distribution() -> None:
    """argmax(p / E) over 20000 seeds picks token t with frequency p_t (within 4 sigma)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    num_draws = 20_000
    noise = seeded_noise(list(range(num_draws)), [0] * num_draws, probs.shape[0])
    counts = torch.bincount((probs / noise).argmax(dim=-1), minlength=5).double() / num_draws
    sigma = (probs.double() * (1 - probs.double()) / num_draws).sqrt()
    assert ((counts - probs.double()).abs() < 4 * sigma).all(), counts


def test_making_seeded_noise_reads_nothing_back() -> None:
    anchor = torch.zeros(1)
    with host_reads(anchor) as seen:
        seeded_noise([3, 4], [0, 9], 300, anchor.device)
    assert list(seen) == []
    assert seen.uploads == [("to_device", 4)]  # two keys of two words


def sort_reference(probs: torch.Tensor, top_p: float) -> set[int]:
    """Rank by probability (ties together): a token stays while the mass strictly above it
    is below top_p; every token when top_p >= 1."""
    values = probs.double().tolist()
    if top_p >= 1.0:
        return set(range(len(values)))
    order = sorted(range(len(values)), key=lambda i: -values[i])
    kept: set[int] = set()
    mass_above, position = 0.0, 0
    while position < len(order):
        value = values[order[position]]
        run = [i for i in order[position:] if values[i] == value]
        if kept and mass_above >= top_p:
            break
        kept.update(run)
        mass_above += value * len(run)
        position += len(run)
    return kept


@pytest.mark.parametrize("round_to_bf16", [False, True])
def test_top_p_search_keeps_the_sorts_set(round_to_bf16: bool) -> None:
    """On random rows (bf16-rounded logits tie often), with -inf tokens, top_p from tiny to 1."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(48, 200, generator=generator) * torch.linspace(0.3, 6, 48)[:, None]
    if round_to_bf16:
        logits = logits.bfloat16().float()
    logits[::5, :40] = float("-inf")
    top_p = torch.rand(48, generator=generator)
    top_p[:4] = torch.tensor([1e-6, 1.0, 0.999999, 0.5])
    masked = apply_top_p(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    for row in range(48):
        got = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert got == sort_reference(probs[row], float(top_p[row])), row
    # and the candidates' ranking over the whole row gives the same threshold
    search = apply_top_p(logits, top_p)
    assert torch.equal(search, apply_top_p(logits, top_p, max_candidates=200))
    assert _top_p_candidates_threshold(probs, top_p, 200).shape == (48, 1)


def test_top_p_search_reads_nothing_back() -> None:
    logits = torch.randn(4, 300)
    with host_reads(logits) as seen:
        apply_top_p(logits, torch.full((4,), 0.9, device=logits.device))
    assert list(seen) == []
