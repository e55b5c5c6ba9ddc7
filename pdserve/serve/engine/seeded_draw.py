"""Seeded rows' draws: one uniform per row, a pure function of (seed, output index) made on the
host, and the token it picks from the row's cumulative distribution on the device.

A seeded request must give the same tokens on every worker that samples it (a decode worker
continues from (seed, i) where the prefill worker stopped; a migrated request continues on
another host), so its randomness cannot come from a device's generator: CPU generators
(Mersenne Twister) and CUDA ones (Philox) give different streams. Nor need it be vocabulary
sized: inverse-CDF sampling takes one number per row.

    host:    u = top 53 bits of blake2b(f"{seed}:{i}") / 2^53      in [0, 1), exact in float64
    device:  cdf = cumsum(probs) in float64                           [R, V]
             token = the first t with cdf[t] > u * cdf[-1]            (probs[t] > 0 there)

The only thing that differs between devices is the cumulative sum's rounding (float64: a
token changes only where u * cdf[-1] falls within ~1e-16 of a boundary), so a seed gives the
same tokens on CPU and GPU, as far as the two compute the same probabilities.
"""

from __future__ import annotations

import hashlib

import torch

from pdserve.serve.layers.uploads import to_device

UNIFORM_BITS = 53  # float64's mantissa: every u is exact, and u < 1


def seeded_uniform(seed: int, output_index: int) -> float:
    """The uniform in [0, 1) that picks output token `output_index` of a request seeded
    `seed`."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> (64 - UNIFORM_BITS)) / (1 << UNIFORM_BITS)


def inverse_cdf_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows need not be normalised; each has some mass), uniforms [R] float64
    on their device -> [R] long: per row the first token whose cumulative mass passes
    u x the row's mass, never a token of probability 0.

        probs  0    .5   0    .3   .2   0         u = .6: threshold .6
        cdf    0    .5   .5   .8   1.0  1.0       first cdf > .6: token 3
    """
    cdf = probs.double().cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]
    past = (cdf <= uniforms.unsqueeze(1) * total).sum(dim=-1)
    # u * total may round up to total: stop at the last token with mass (the first whose cdf
    # reaches total)
    last = (cdf < total).sum(dim=-1)
    return torch.minimum(past, last)


def seeded_tokens(probs: torch.Tensor, seeds: list[int], output_indices: list[int]
                  ) -> torch.Tensor:
    """Each seeded row's token, [R] long on probs' device: the uniforms go down in one small
    copy that the host does not wait for."""
    uniforms = torch.tensor([seeded_uniform(seed, index) for seed, index
                             in zip(seeds, output_indices, strict=True)], dtype=torch.float64)
    return inverse_cdf_tokens(probs, to_device(uniforms, probs.device))
