"""Seeded rows' draws (pdserve/serve/engine/seeded_draw.py): a fixed uniform for a (seed,
index), the same tokens on CPU and GPU, the sampling distribution's frequencies, never a token
of probability 0. Top-p's threshold search keeps exactly the sort's set."""

from __future__ import annotations

import pytest
import torch
from helpers.host_reads import host_reads

from pdserve.serve.engine.sampler import _top_p_candidates_threshold, apply_top_p
from pdserve.serve.engine.seeded_draw import inverse_cdf_tokens, seeded_tokens, seeded_uniform

KNOWN_1234_5, KNOWN_0_0 = "0x1.9a084868f0394p-2", "0x1.8b41a59dfa71ap-2"


def test_a_seed_and_index_fix_the_uniform() -> None:
    """Every worker must compute these (a worker continues a seeded request from them)."""
    assert seeded_uniform(1234, 5).hex() == KNOWN_1234_5
    assert seeded_uniform(0, 0).hex() == KNOWN_0_0
    uniforms = [seeded_uniform(seed, index) for seed in range(50) for index in range(50)]
    assert all(0.0 <= u < 1.0 for u in uniforms) and len(set(uniforms)) == len(uniforms)


def test_inverse_cdf_picks_where_the_uniform_falls() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 6)
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.6, 0.99, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert inverse_cdf_tokens(probs, uniforms).tolist() == [1, 1, 3, 3, 4, 4]
    # unnormalised rows (a total that rounds u * total up to it) still end on a token with mass
    scaled = probs * 3.0000001
    assert inverse_cdf_tokens(scaled, uniforms).tolist() == [1, 1, 3, 3, 4, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_seed_gives_the_same_tokens_on_cpu_and_gpu() -> None:
    probs = torch.softmax(torch.randn(64, 50_000, generator=torch.Generator().manual_seed(0))
                          * 3, dim=-1)
    seeds, indices = list(range(64)), [s * 3 for s in range(64)]
    assert torch.equal(seeded_tokens(probs, seeds, indices),
                       seeded_tokens(probs.cuda(), seeds, indices).cpu())


def test_seeded_draws_follow_the_distribution() -> None:
    """Over 20000 seeds, token t is picked with frequency p_t (within 4 sigma)."""
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.07, 0.03])
    num_draws = 20_000
    tokens = seeded_tokens(probs.expand(num_draws, -1), list(range(num_draws)), [7] * num_draws)
    counts = torch.bincount(tokens, minlength=6).double() / num_draws
    sigma = (probs.double() * (1 - probs.double()) / num_draws).sqrt()
    assert counts[2] == 0
    assert ((counts - probs.double()).abs() <= 4 * sigma).all(), counts


def test_a_seeded_draw_reads_nothing_back_and_sends_one_number_a_row() -> None:
    probs = torch.softmax(torch.randn(2, 300), dim=-1)
    with host_reads(probs) as seen:
        seeded_tokens(probs, [3, 4], [0, 9])
    assert list(seen) == []
    assert seen.uploads == [("to_device", 2)]


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
    masked = apply_top_p(logits, top_p, search=True)
    probs = torch.softmax(logits, dim=-1)
    for row in range(48):
        got = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert got == sort_reference(probs[row], float(top_p[row])), row
    # and the candidates' ranking over the whole row gives the same threshold
    search = apply_top_p(logits, top_p, search=True)
    assert torch.equal(search, apply_top_p(logits, top_p, max_candidates=200))
    assert torch.equal(search, apply_top_p(logits, top_p))  # the CPU's default: the ranking
    assert _top_p_candidates_threshold(probs, top_p, 200).shape == (48, 1)


def test_top_p_search_reads_nothing_back() -> None:
    logits = torch.randn(4, 300)
    with host_reads(logits) as seen:
        apply_top_p(logits, torch.full((4,), 0.9, device=logits.device), search=True)
    assert list(seen) == []
