"""Llama attention with a mixture-of-experts MLP: Mixtral and Qwen2-MoE.

Attention is Llama's (pdserve/serve/models/llama.py; Qwen2-MoE adds a Q/K/V bias), the MLP the
SparseMoE block of pdserve/serve/models/moe.py with each model's router, expert names and shared
expert. Parameter names are the checkpoint's:

    Mixtral    layers.L.block_sparse_moe.gate             softmax, top-k, renormalised
               layers.L.block_sparse_moe.experts.N.w1|w3  gate | up  ->  w13 (shard 0, 1)
               layers.L.block_sparse_moe.experts.N.w2     down
    Qwen2-MoE  layers.L.mlp.gate                          softmax, top-k, renormalised only
                                                          if norm_topk_prob
               layers.L.mlp.experts.N.{gate,up,down}_proj
               layers.L.mlp.shared_expert.*               every token, scaled per token by
               layers.L.mlp.shared_expert_gate            sigmoid(x W_sg)
               layers.L.mlp.{gate,up,down}_proj           dense layers: those in
                                                          mlp_only_layers or off the
                                                          decoder_sparse_step

Hugging Face fuses the experts in memory (experts.gate_up_proj), but save_pretrained writes
them per expert as above, and released checkpoints are stored the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from pdserve.serve.layers.common import RotaryEmbedding
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.parallel import ReplicatedLinear
from pdserve.serve.models.base import (
    GATE_UP_PACKED,
    QKV_PACKED,
    CausalLM,
    DecoderModel,
    GatedMLP,
    PackedMapping,
    dense_mlp,
    require_divisible,
)
from pdserve.serve.models.llama import LlamaDecoderLayer, head_dim_of
from pdserve.serve.models.moe import (
    SparseMoE,
    TopKRouter,
    is_other_ranks_expert,
    local_experts,
)


def softmax_router(hf_config: Mapping[str, Any], num_experts_key: str,
                   norm_topk_prob: bool) -> TopKRouter:
    """Softmax over all experts, top-k; the router logits in the model dtype, as Hugging
    Face computes them for both models."""
    return TopKRouter(hf_config["hidden_size"], int(hf_config[num_experts_key]),
                      int(hf_config["num_experts_per_tok"]), norm_topk_prob=norm_topk_prob,
                      is_float32_logits=False)


class MixtralExpert(GatedMLP):
    """Mixtral names an expert's projections w1 (gate), w3 (up) and w2 (down)."""

    gate_up_name: ClassVar[str] = "w13"
    down_name: ClassVar[str] = "w2"


class MixtralMoE(SparseMoE):
    def __init__(self, hf_config: Mapping[str, Any], tp: TPGroup) -> None:
        # Mixtral's intermediate_size is each expert's: it has no dense MLP.
        super().__init__(hf_config, softmax_router(hf_config, "num_local_experts", True), tp,
                         "intermediate_size", "num_local_experts", MixtralExpert)


class Qwen2MoeSparseMoE(SparseMoE):
    """Routed experts plus one shared expert that every token passes through, scaled per
    token by sigmoid(shared_expert_gate(x)).

    The shared expert is TP-split (with expert parallelism too) and its one-output gate is
    replicated: each rank scales its partial sum by the same per-token factor, so the
    block's single all-reduce still completes it.
    """

    def __init__(self, hf_config: Mapping[str, Any], tp: TPGroup) -> None:
        norm_topk_prob = bool(hf_config.get("norm_topk_prob", False))
        super().__init__(hf_config, softmax_router(hf_config, "num_experts", norm_topk_prob), tp,
                         "moe_intermediate_size", "num_experts")
        hidden = hf_config["hidden_size"]
        require_divisible(hf_config, "shared_expert_intermediate_size", tp)
        self.shared_expert = GatedMLP(hidden, int(hf_config["shared_expert_intermediate_size"]),
                                      False, tp, reduce=False)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config: Mapping[str, Any], layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPGroup, backend_name: str) -> None:
        super().__init__(hf_config, rotary_emb, False, tp, backend_name, layer_id)

    def build_mlp(self, hf_config: Mapping[str, Any], layer_id: int, tp: TPGroup) -> None:
        self.block_sparse_moe = MixtralMoE(hf_config, tp)

    @property
    def mlp(self) -> nn.Module:  # type: ignore[override]
        """DecoderLayer calls its MLP `mlp`; Mixtral's checkpoint calls it block_sparse_moe."""
        return self.block_sparse_moe


def is_qwen2_moe_sparse_layer(hf_config: Mapping[str, Any], layer_id: int) -> bool:
    """MoE unless listed in mlp_only_layers, on every decoder_sparse_step-th layer counting
    from 1 (so with step 2: layers 1, 3, 5, ...)."""
    return (layer_id not in (hf_config.get("mlp_only_layers") or ())
            and int(hf_config.get("num_experts") or 0) > 0
            and (layer_id + 1) % int(hf_config.get("decoder_sparse_step") or 1) == 0)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config: Mapping[str, Any], layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPGroup, backend_name: str) -> None:
        # Qwen1.5-MoE configs predate the qkv_bias key; their Q/K/V have biases.
        super().__init__(hf_config, rotary_emb, bool(hf_config.get("qkv_bias", True)), tp,
                         backend_name, layer_id)

    def build_mlp(self, hf_config: Mapping[str, Any], layer_id: int, tp: TPGroup) -> None:
        self.mlp = (Qwen2MoeSparseMoE(hf_config, tp)
                    if is_qwen2_moe_sparse_layer(hf_config, layer_id) else dense_mlp(hf_config, tp))


class MoEDecoderModel(DecoderModel):
    def __init__(self, hf_config: Mapping[str, Any], max_positions: int,
                 layer_cls: type[MixtralDecoderLayer | Qwen2MoeDecoderLayer], tp: TPGroup,
                 backend_name: str) -> None:
        rotary_emb = RotaryEmbedding(head_dim_of(hf_config), max_positions, hf_config)
        super().__init__(hf_config, tp, rotary_emb, lambda i: layer_cls(
            hf_config, i, rotary_emb, tp, backend_name))


class MoECausalLM(CausalLM):
    """The model, its LM head, and which checkpoint tensors this rank skips."""

    layer_cls: ClassVar[type[MixtralDecoderLayer | Qwen2MoeDecoderLayer]]
    moe_block_name: ClassVar[str]  # the MoE block's name in a layer's checkpoint tensors
    num_experts_key: ClassVar[str]

    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, tp: TPGroup,
                 backend_name: str) -> None:
        super().__init__()
        self.model = MoEDecoderModel(hf_config, max_positions, self.layer_cls, tp, backend_name)
        self.add_lm_head(hf_config, tp)
        num_experts = int(hf_config.get(self.num_experts_key) or 0)
        self._local_experts = local_experts(num_experts, tp, self.num_experts_key)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Routed experts held by other ranks (expert parallelism): the loader skips them."""
        return is_other_ranks_expert(name, self.moe_block_name, self._local_experts)


class MixtralForCausalLM(MoECausalLM):
    packed_modules_mapping: ClassVar[PackedMapping] = {
        **QKV_PACKED, "w1": ("w13", 0), "w3": ("w13", 1)}
    layer_cls = MixtralDecoderLayer
    moe_block_name = "block_sparse_moe"
    num_experts_key = "num_local_experts"


class Qwen2MoeForCausalLM(MoECausalLM):
    packed_modules_mapping: ClassVar[PackedMapping] = {**QKV_PACKED, **GATE_UP_PACKED}
    layer_cls = Qwen2MoeDecoderLayer
    moe_block_name = "mlp"
    num_experts_key = "num_experts"
