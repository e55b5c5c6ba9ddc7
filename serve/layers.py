"""Small layers every decoder block uses: RMSNorm, SiLU-and-multiply, rotary embedding.

Each one reproduces Hugging Face's arithmetic order (and its float32 upcasts) so the engine's
logits match transformers to float32 rounding, not just "approximately".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
        if residual is not None:
            x = x + residual
        residual = x
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype), residual


class SiluAndMul(nn.Module):
    """[.., 2 * d] (gate | up) -> [.., d] = silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


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


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin table.

    The table holds cos(pos * inv_freq) in float32 for every position up to max_positions;
    a step gathers rows by each token's absolute position, so ragged batches need no padding.
    """

    def __init__(self, head_dim: int, max_positions: int, hf_config: Mapping[str, Any]) -> None:
        super().__init__()
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        partial = float(params.get("partial_rotary_factor",
                                   hf_config.get("partial_rotary_factor", 1.0)))
        self.rotary_dim = int(head_dim * partial)
        base = float(params["rope_theta"])
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        inv_freq = 1.0 / (base**exponent)
        max_pos_cfg = int(hf_config.get("max_position_embeddings", max_positions))
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params, max_pos_cfg)
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for positions [T]: gathered once per step, not per layer."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, Hkv, D] -> rotated (query, key)."""
        cos, sin = cos_sin
        return (_apply_rotary(query, cos, sin, self.rotary_dim),
                _apply_rotary(key, cos, sin, self.rotary_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
                  ) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
