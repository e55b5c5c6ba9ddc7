"""A Llama-family decode step's layer loop in one compiled call (CPU), where it applies.

Walking a decoder's layers as nn.Modules costs Python time per layer (module calls, views,
argument checks), which on a small model is more than its matmuls. On CUDA a captured graph
removes that (pdserve/serve/executor/cuda_graphs.py); on CPU, pdserve/kernels/csrc/decode_step.cpp
runs the loop in C++, calling the very kernels the module path calls (add_rms_norm, panel_linear or
skinny_linear, rotary_neox_, write_kv_cache, the paged decode attention, silu_and_mul; a bf16
checkpoint's panels on AMX from as many rows as the "amx" linear op sends there,
pdserve/kernels/cpu_linear.py), in the same order on the same tensors: its hidden states are
bit-identical to the module path's (tests/serve/test_fused_decode.py compares them), which stays
the reference and the path for everything else. Where every product has panels and the cache is
fp32, the whole loop is one OpenMP region (a barrier between ops instead of a region per op).
The loop also applies the model's final norm and, in that region, the LM head: the model's
forward then returns those logits with its hidden states (pdserve/serve/models/base.py ModelOutput).

The model declares what the loop reads (a model family's fused_decode_weights returns
FusedDecodeWeights, or None where its structure does not fit); this module checks only the
tensors. The loop is a C++ object (ops.DecodeLoop) made once over the weights and the rotary
tables; each step it reads only the lengths and block tables of the metadata, and derives
each row's position (its length - 1), KV slot and rotary rows itself.

It applies to a step when all of these hold, else the module path runs:
- PDSERVE_FUSED_DECODE is not 0 and the compiled CPU ops are built;
- the model declares its weights: a dense Llama-family decoder (Llama, Mistral, Qwen2; not
  MoE, not MLA) with NeoX rotary, on one tensor-parallel rank and one pipeline stage, with
  the "cpu" attention backend;
- the weights are fp32 (panels may store them in bf16 or fp16, pdserve/kernels/cpu_linear.py
  panel_dtype), on the CPU and contiguous;
- the step is decode-only, and nobody waits on a per-layer callback (a prefill's KV
  hand-off); where the weights are plain (no AVX-512 panels), with at most
  pdserve/kernels/cpu_linear.py skinny_max_rows sequences (past that the matmuls take oneDNN's
  packed weights and Python's share of the step is small).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from pdserve.kernels import cpu_linear
from pdserve.serve.layers.attention import AttentionMetadata
from pdserve.serve.layers.ops import chosen, cpu_kernels, path

_NO_BIAS = torch.empty(0)  # the kernel's marker for an absent bias
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FusedLayerWeights:
    """One decoder layer's tensors as the loop reads them. A product's matrix is the weight
    the module path multiplies by: its panels (1-D) where it has them, else W [out, in]."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    @property
    def matrices(self) -> tuple[torch.Tensor, ...]:
        return (self.qkv, self.o_proj, self.gate_up, self.down)

    def in_loop_order(self) -> list[torch.Tensor | None]:
        """pdserve/kernels/csrc/decode_step.cpp's order of a layer's 10 tensors."""
        return [self.input_norm, self.qkv, self.qkv_bias, self.o_proj, self.o_bias,
                self.post_norm, self.gate_up, self.gate_up_bias, self.down, self.down_bias]


WEIGHTS_PER_LAYER = len(dataclasses.fields(FusedLayerWeights))


@dataclass(frozen=True)
class FusedDecodeWeights:
    """What a model hands the fused loop: every layer's weights and the shapes they share."""

    layers: list[FusedLayerWeights]
    eps: float  # every RMSNorm's, the final one's too
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    scale: float  # the attention's softmax scale
    rotary_tables: tuple[torch.Tensor, torch.Tensor]  # cos, sin [positions, rotary_dim]
    final_norm: torch.Tensor | None = None  # the model's last RMSNorm weight
    head: torch.Tensor | None = None  # the LM head's matrix (the logits over the vocabulary)


class FusedDecode:
    """The kernel's loop (ops.DecodeLoop) over every layer's weights, in its order."""

    def __init__(self, ops: ModuleType, weights: list[torch.Tensor], panels: bool, eps: float,
                 num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 scale: float, rotary_tables: tuple[torch.Tensor, torch.Tensor],
                 amx_rows: int = 0, final_norm: torch.Tensor | None = None,
                 head: torch.Tensor | None = None) -> None:
        """rotary_tables: the layers' cos and sin tables [positions, rotary_dim], from which
        the loop takes each row's (at its sequence's last position). amx_rows: from this many
        rows on, bf16 panels multiply on AMX, as the "amx" linear op sends them (0: never).
        final_norm: the model's last RMSNorm weight (of the layers' eps), applied after the
        loop; head: the LM head's panels, whose logits the loop then computes where it can
        (see __call__)."""
        self._ops = ops
        self._final_norm = final_norm
        self._rest = (*rotary_tables, eps, num_heads, num_kv_heads, head_dim, rotary_dim, scale,
                      amx_rows, final_norm, head)
        self.weights = weights
        # plain weights go to the skinny product, which has an edge; panels take any batch
        self.max_rows = None if panels else cpu_linear.skinny_max_rows()
        self.phase_seconds: torch.Tensor | None = None
        """float64 [3], where set: each call adds its wall time in the products, the attention
        (with its KV write) and the rest (benchmarks/step_roofline.py's breakdown;
        the engine leaves it None)."""

    @property
    def weights(self) -> list[torch.Tensor]:
        """Every layer's 10 weights (pdserve/kernels/csrc/decode_step.cpp's order); setting them
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


def build_fused_decode(declared: FusedDecodeWeights | None) -> FusedDecode | None:
    """The fused loop over a model's declared weights, or None where it does not apply (see
    the module docstring); decided once, after the weights are loaded. With the model's final
    norm the loop applies it too, and with the LM head's panels (where the layers have
    theirs) it computes the logits."""
    ops = cpu_kernels()
    if (not path().fused_decode or declared is None or not declared.layers or ops is None
            or not hasattr(ops, "DecodeLoop")):
        return None
    kinds = {m.dim() for layer in declared.layers for m in layer.matrices}  # 1: panels
    if len(kinds) != 1 or not all(_loop_reads(layer) for layer in declared.layers):
        return None
    if not all(t.dtype == torch.float32 and t.device.type == "cpu"
               for t in declared.rotary_tables):
        return None
    norm = declared.final_norm
    if norm is not None and not (norm.dtype == torch.float32 and norm.is_contiguous()):
        norm = None
    head = declared.head if norm is not None and kinds == {1} else None
    if head is not None and head.dim() != 1:  # no panels: the module path's own product
        head = None
    weights = [_NO_BIAS if w is None else w.detach()
               for layer in declared.layers for w in layer.in_loop_order()]
    amx_from = cpu_linear.amx_min_rows() if chosen("linear") == "amx" else math.inf
    return FusedDecode(ops, weights, kinds == {1}, declared.eps, declared.num_heads,
                       declared.num_kv_heads, declared.head_dim, declared.rotary_dim,
                       declared.scale, declared.rotary_tables,
                       amx_rows=0 if math.isinf(amx_from) else int(amx_from),
                       final_norm=None if norm is None else norm.detach(), head=head)


def _loop_reads(layer: FusedLayerWeights) -> bool:
    """Every tensor on the CPU, contiguous, fp32, but for panels that store a half-precision
    checkpoint's weights (pdserve/kernels/cpu_linear.py panel_dtype)."""
    for w in layer.in_loop_order():
        panels = any(w is m for m in layer.matrices) and w.dim() == 1
        if w is not None and not (w.device.type == "cpu" and w.is_contiguous() and (
                w.dtype == torch.float32 or (panels and w.dtype in _HALF))):
            return False
    return True
