"""A Llama-family decode step's layer loop in one compiled call (CPU), where it applies.

Walking a decoder's layers as nn.Modules costs Python time per layer (module calls, views,
argument checks): about 0.3 ms a layer on this project's 2-core machines, 2.5 ms of an 8-layer
step, which on a small model is more than its matmuls. On CUDA a captured graph removes that;
on CPU, kernels/csrc/decode_step.cpp runs the loop in C++, calling the very kernels the module
path calls (add_rms_norm, panel_linear or skinny_linear, rotary_neox_, write_kv_cache, the
paged decode attention, silu_and_mul; a bf16 checkpoint's panels on AMX from as many rows as
serve/parallel.linear sends there), in the same order on the same tensors: its hidden
states are bit-identical to the module path's (tests/serve/test_fused_decode.py compares them),
which stays the reference and the path for everything else. Where every product has panels
and the cache is fp32, the whole loop is one OpenMP region (a barrier between ops instead of a
region per op). The loop also applies the model's final norm and, in that region, the LM head:
CausalLM.compute_logits then takes the logits it computed (DecoderModel.take_decode_logits).
The loop is a C++ object (ops.DecodeLoop) made once over the weights and the rotary tables;
each step it reads only the lengths and block tables of the metadata, and derives each row's
position (its length - 1), KV slot and rotary rows itself.

It applies to a step when all of these hold, else the module path runs:
- PDSERVE_FUSED_DECODE is not 0 and the compiled CPU ops are built;
- the model is a dense Llama-family decoder (Llama, Mistral, Qwen2; not MoE, not MLA) with
  NeoX rotary, on one tensor-parallel rank, with the "cpu" attention backend and fp32 weights
  (panels may store them in bf16 or fp16, serve/parallel.panel_dtype);
- the step is decode-only, and nobody waits on a per-layer callback (a prefill's KV
  hand-off); where the weights are plain (no AVX-512 panels, serve/executor/parallel.py prepack),
  with
  at most serve/parallel.skinny_max_rows sequences (past that the matmuls take oneDNN's packed
  weights and Python's share of the step is small).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import nn

from pdserve import envs
from pdserve.serve.executor.attention import AttentionMetadata
from pdserve.serve.executor.layers import RMSNorm, cpu_kernels
from pdserve.serve.executor.parallel import amx_rows, skinny_max_rows

_NO_BIAS = torch.empty(0)  # the kernel's marker for an absent bias
WEIGHTS_PER_LAYER = 10
_HALF = (torch.bfloat16, torch.float16)


class FusedDecode:
    """The kernel's loop (ops.DecodeLoop) over every layer's weights, in its order."""

    def __init__(self, ops: ModuleType, weights: list[torch.Tensor], panels: bool, eps: float,
                 num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 scale: float, rotary_tables: tuple[torch.Tensor, torch.Tensor],
                 amx_rows: int = 0, final_norm: torch.Tensor | None = None,
                 head: torch.Tensor | None = None) -> None:
        """rotary_tables: the layers' cos and sin tables [positions, rotary_dim], from which
        the loop takes each row's (at its sequence's last position). amx_rows: from this many
        rows on, bf16 panels multiply on AMX, as serve/parallel.linear sends them (0: never).
        final_norm: the model's last RMSNorm weight (of the layers' eps), applied after the
        loop; head: the LM head's panels, whose logits the loop then computes where it can
        (see __call__)."""
        self._ops = ops
        self._final_norm = final_norm
        self._rest = (*rotary_tables, eps, num_heads, num_kv_heads, head_dim, rotary_dim, scale,
                      amx_rows, final_norm, head)
        self.weights = weights
        # plain weights go to the skinny product, which has an edge; panels take any batch
        self.max_rows = None if panels else skinny_max_rows(ops)
        self.phase_seconds: torch.Tensor | None = None
        """float64 [3], where set: each call adds its wall time in the products, the attention
        (with its KV write) and the rest (benchmarks/step_roofline.py's breakdown; the engine
        leaves it None)."""

    @property
    def weights(self) -> list[torch.Tensor]:
        """Every layer's 10 weights (kernels/csrc/decode_step.cpp's order); setting them
        builds the loop again (benchmarks/weight_pages.py swaps in copies)."""
        return self._weights

    @weights.setter
    def weights(self, weights: list[torch.Tensor]) -> None:
        self._weights = weights
        self._loop = self._ops.DecodeLoop(weights, len(weights) // WEIGHTS_PER_LAYER,
                                          *self._rest)

    @property
    def ends_normed(self) -> bool:
        """The loop applies the final norm (and returns the normed hidden states)."""
        return self._final_norm is not None

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (meta.is_decode_only and hidden.dim() == 2 and hidden.dtype == torch.float32
                and (self.max_rows is None or hidden.shape[0] <= self.max_rows))

    def __call__(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, hidden] (embedded) -> without a final norm, (hidden, residual) after
        the last layer, as the module path's loop returns them; with one, (the normed hidden
        states, their logits [T, vocab] or None where the loop left the LM head to the
        caller: no head given, or a step the one-region loop does not take). The loop reads
        only the lengths and block tables of the metadata: each row's position, slot and
        rotary rows follow from them."""
        first, second = self._loop.run(hidden, kv_caches, meta.seq_lens, meta.block_tables,
                                       self.phase_seconds)
        if not self.ends_normed:
            return first, second
        return first, second if second.numel() else None


def _matrix(linear: nn.Module) -> torch.Tensor:
    """The weight the module path's product reads: its panels where it has them, else W."""
    packed = linear.packed
    return packed if packed is not None and not packed.is_mkldnn else linear.weight


def build_llama_fused_decode(layers: Sequence[nn.Module], final_norm: nn.Module | None = None,
                             lm_head: nn.Module | None = None) -> FusedDecode | None:
    """The fused loop for these Llama-family layers, or None where it does not apply (see the
    module docstring); decided once, after the weights are loaded. With the model's final norm
    (an RMSNorm of the layers' eps) the loop applies it too, and with the LM head's panels
    (one rank, fp32 or half panels) it computes the logits."""
    from pdserve.serve.models.base import DecoderLayer, GatedMLP
    from pdserve.serve.models.llama import LlamaAttention

    ops = cpu_kernels()
    if not envs.fused_decode() or ops is None or not hasattr(ops, "DecodeLoop"):
        return None
    weights: list[torch.Tensor] = []
    eps: set[float] = set()
    shapes: set[tuple[int, int, int, int, float]] = set()
    kinds: set[int] = set()
    tables: set[tuple[int, int]] = set()  # the rotary tables: one pair for every layer
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None),
                 getattr(layer, "post_attention_layernorm", None))
        if (type(layer).forward is not DecoderLayer.forward or type(attn) is not LlamaAttention
                or type(mlp) is not GatedMLP or any(type(n) is not RMSNorm for n in norms)):
            return None
        rotary, qkv, o_proj = attn.rotary_emb, attn.qkv_proj, attn.o_proj
        gate_up, down = mlp._modules[mlp.gate_up_name], mlp._modules[mlp.down_name]
        if (attn.attn.backend.name != "cpu" or rotary.is_interleaved
                or any(p.tp.size != 1 for p in (qkv, o_proj, gate_up, down))):
            return None
        matrices = [_matrix(m) for m in (qkv, o_proj, gate_up, down)]
        layer_weights = [norms[0].weight, matrices[0], qkv.bias, matrices[1], o_proj.bias,
                         norms[1].weight, matrices[2], gate_up.bias, matrices[3], down.bias]
        kinds.update(w.dim() for w in matrices)  # 1: panels, 2: plain
        for w in layer_weights:
            # fp32 throughout, but for panels that store a half-precision checkpoint's
            # weights (serve/parallel.panel_dtype)
            panels = any(w is m for m in matrices) and w.dim() == 1
            if w is not None and not (w.device.type == "cpu" and w.is_contiguous() and (
                    w.dtype == torch.float32 or (panels and w.dtype in _HALF))):
                return None
        weights += [_NO_BIAS if w is None else w.detach() for w in layer_weights]
        eps.update(n.eps for n in norms)
        shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary.rotary_dim,
                    attn.attn.scale))
        tables.add((id(rotary.cos_cache), id(rotary.sin_cache)))
    if not layers or len(eps) != 1 or len(shapes) != 1 or len(kinds) != 1 or len(tables) != 1:
        return None
    if rotary.cos_cache.dtype != torch.float32 or rotary.cos_cache.device.type != "cpu":
        return None
    layer_eps = eps.pop()
    norm = final_norm.weight.detach() if (
        type(final_norm) is RMSNorm and final_norm.eps == layer_eps
        and final_norm.weight.dtype == torch.float32 and final_norm.weight.is_contiguous()
    ) else None
    # the LM head's panels, where the layers have theirs (the layers' checks above already
    # hold the one tensor-parallel rank the head shares with them)
    head = _matrix(lm_head) if lm_head is not None and norm is not None and kinds == {1} \
        else None
    if head is not None and head.dim() != 1:  # no panels: the module path's own product
        head = None
    amx_from = amx_rows(ops)
    return FusedDecode(ops, weights, kinds == {1}, layer_eps, *shapes.pop(),
                       (rotary.cos_cache, rotary.sin_cache),
                       amx_rows=0 if math.isinf(amx_from) else int(amx_from),
                       final_norm=norm, head=head)
