"""Small layers every decoder block uses: RMSNorm, SiLU-and-multiply, rotary embedding.

A layer holds its parameters (and the rotary tables); the arithmetic is a kernel op chosen
for this process (pdserve/serve/layers/ops.py), whose reference (pdserve/kernels/reference.py)
reproduces Hugging Face's arithmetic order and float32 upcasts, so the engine's logits match
transformers to float32 rounding, not just "approximately".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pdserve.serve.layers.ops import cpu_kernels as cpu_kernels  # re-exported (benchmarks)
from pdserve.serve.layers.ops import kernel


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), computed in float32 and cast back (as HF does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual); with a residual, normalises x + residual.

        The pre-norm block reads `h = h + f(norm(h))`: fusing the add here saves one pass and
        hands the sum on as the next residual.
        """
        return kernel("rms_norm")(x, residual, self.weight, self.eps)


class SiluAndMul(nn.Module):
    """[.., 2 * d] (gate | up) -> [.., d] = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel("silu_and_mul")(x)


def rope_parameters(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """One dict with rope_type and rope_theta from any of the config forms seen in the wild.

    transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...}); older checkpoints
    write `rope_theta` and an optional `rope_scaling` ({type|rope_type, factor, ...}).
    """
    params: dict[str, Any] = {}
    if isinstance(hf_config.get("rope_scaling"), Mapping):
        params.update(hf_config["rope_scaling"])
    if isinstance(hf_config.get("rope_parameters"), Mapping):
        params.update(hf_config["rope_parameters"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any],
                     max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between.

        wavelen:  short (< high_wl)  |  medium (ramp)  |  long (> low_wl)
        inv_freq: unchanged          |  blend          |  inv_freq / factor
    """
    factor = float(params["factor"])
    low_freq_factor = float(params.get("low_freq_factor", 1.0))
    high_freq_factor = float(params.get("high_freq_factor", 4.0))
    old_len = float(params.get("original_max_position_embeddings", max_position_embeddings))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor`: 0.1 mscale ln(factor) + 1
    (1 when not stretched). It rescales cos/sin here and, in DeepSeek, the softmax scale."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any],
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts"): fast-rotating pairs keep their frequency, slow ones are
    interpolated by `factor`, a linear ramp between; returns (inv_freq, attention_factor).

        pair i:    0 ...... low ...... high ...... rotary_dim / 2
        inv_freq:  base^(-2i/d)  | ramp |  base^(-2i/d) / factor

    low/high are the pairs that turn beta_fast / beta_slow times over the original context.
    """
    old_len = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    factor = float(factor) if factor else max_position_embeddings / old_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def pair_turning(num_rotations: float) -> float:
        """The (fractional) pair index that makes num_rotations turns over old_len positions."""
        return (rotary_dim * math.log(old_len / (num_rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotary embedding with a precomputed cos/sin table.

    The table holds cos(pos * inv_freq) in float32 for every position up to max_positions;
    a step gathers rows by each token's absolute position, so ragged batches need no padding.
    Frequency i rotates one pair of dimensions:

        neox (rotate-half):  (x[i], x[i + d/2])      Llama, Qwen2, Mistral
        interleaved:         (x[2i], x[2i + 1])      DeepSeek-V2/V3

    Interleaved outputs come back in rotate-half order ([rotated evens | rotated odds]), as
    Hugging Face's DeepSeek-V3 does: one fixed permutation for query and key alike, so every
    q.k product is unchanged and no de-interleaving copy is made.
    """

    def __init__(self, head_dim: int, max_positions: int, hf_config: Mapping[str, Any],
                 is_interleaved: bool = False) -> None:
        super().__init__()
        self.is_interleaved = is_interleaved
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        partial = float(params.get("partial_rotary_factor",
                                   hf_config.get("partial_rotary_factor", 1.0)))
        self.rotary_dim = int(head_dim * partial)
        base = float(params["rope_theta"])
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        inv_freq = 1.0 / (base**exponent)
        max_pos_cfg = int(hf_config.get("max_position_embeddings", max_positions))
        # YaRN scales cos/sin (so q.k of the rotated dims) by attention_factor; the others don't.
        attention_factor = 1.0
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params, max_pos_cfg)
        elif rope_type == "yarn":
            if hf_config.get("original_max_position_embeddings"):  # wins, as in HF (Phi-3)
                params["original_max_position_embeddings"] = hf_config[
                    "original_max_position_embeddings"]
            inv_freq, attention_factor = _yarn_inv_freq(self.rotary_dim, base, params,
                                                        max_pos_cfg)
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3, "
                             "yarn)")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        self.register_buffer("cos_cache", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for positions [T]: gathered once per step, not per layer."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, Hkv, D] -> rotated (query, key) (pdserve/kernels/reference.py
        rotary); the CPU kernel rotates in place, in the caller's tensors."""
        return kernel("rotary")(query, key, cos_sin, self.rotary_dim, self.is_interleaved)
