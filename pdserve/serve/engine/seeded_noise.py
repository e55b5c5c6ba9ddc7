"""Counter-based Exponential(1) noise for seeded rows: a pure function of (seed, output index,
token id), computed on any device with integer tensor ops, the same bits on CPU and GPU.

A seeded request must give the same tokens on every worker that samples it (a decode worker
continues from (seed, i) where the prefill worker stopped; a migrated request continues on
another host), so its noise cannot come from a device's generator: CPU generators (Mersenne
Twister) and CUDA ones (Philox) give different streams, and a generator per row per step is a
launch and a seed each. Here each element's noise is a hash of its coordinates:

    host, per row:   key = blake2b(f"{seed}:{i}") -> two 32-bit words (a, b)
    device, [R, V]:  h = mix(mix(v * 0x9E3779B9 ^ a) ^ b)        v = token id, 32-bit words
                     u = (h >> 8 + 0.5) / 2^24                    in (0, 1), exact in float64
                     E = -log(u)  (float64, then float32)         Exponential(1), never 0

`mix` is a 32-bit avalanche (xor-shift-multiply, Wellons' lowbias32 constants). The words are
held in int64 and every 32-bit product is split in two 16-bit halves, so no step overflows:
the integer part is exact on every device. The log runs in float64, where devices agree to
an ulp that the cast to float32 rounds away but on an exact float32 midpoint.
"""

from __future__ import annotations

import hashlib

import torch

from pdserve.serve.layers.uploads import to_device

WORD = 0xFFFF_FFFF
GOLDEN = 0x9E37_79B9  # 2^32 / golden ratio: spreads consecutive token ids over the words
MIX_1, MIX_2 = 0x7FEB_352D, 0x846C_A68B
UNIFORM_BITS = 24  # float32's mantissa: u is exact in float32 too


def token_key(seed: int, output_index: int) -> tuple[int, int]:
    """The two 32-bit words that key output token `output_index` of a request seeded `seed`."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), with no int64 product past 2^48."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & WORD


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_2)
    return x ^ (x >> 16)


def keyed_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [R, 2] int64 (token_key's words, on the device) -> [R, V] float32 Exponential(1)
    noise on the keys' device."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    spread = _mul32(token_ids, GOLDEN).unsqueeze(0)  # [1, V]
    hashed = _mix(_mix(spread ^ keys[:, :1]) ^ keys[:, 1:])  # [R, V] in [0, 2^32)
    uniform = ((hashed >> (32 - UNIFORM_BITS)).double() + 0.5) / (1 << UNIFORM_BITS)
    return (-torch.log(uniform)).float()


def seeded_noise(seeds: list[int], output_indices: list[int], vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Each seeded row's noise, [R, V] float32 on `device`: the keys go down in one small
    copy that the host does not wait for; the noise is made there."""
    keys = torch.tensor([token_key(seed, index) for seed, index
                         in zip(seeds, output_indices, strict=True)], dtype=torch.int64)
    return keyed_noise(to_device(keys.view(-1, 2), torch.device(device)), vocab_size)
