"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened ragged batch.

Parameter names are the checkpoint's (model.layers.N.self_attn.o_proj.weight, ...). Two
projections are fused for speed; `packed_modules_mapping` tells the loader where the
checkpoint's separate tensors go:

    q_proj | k_proj | v_proj  ->  qkv_proj   (shard "q", "k", "v")
    gate_proj | up_proj       ->  gate_up_proj (shard 0, 1)

The model holds no parallelism code beyond choosing parallel layers; their weight_loaders
cut each rank's shard. Activations are [num_tokens, hidden]: every chunk of a step goes
through one forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from pdserve.serve.layers.attention import Attention, AttentionMetadata
from pdserve.serve.layers.common import RMSNorm, RotaryEmbedding
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.fused_decode import FusedDecodeWeights, FusedLayerWeights
from pdserve.serve.layers.parallel import (
    QKVParallelLinear,
    RowParallelLinear,
    product_matrix,
)
from pdserve.serve.models.base import (
    GATE_UP_PACKED,
    QKV_PACKED,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    PackedMapping,
    dense_mlp,
)


def head_dim_of(hf_config: Mapping[str, Any]) -> int:
    return int(hf_config.get("head_dim")
               or hf_config["hidden_size"] // hf_config["num_attention_heads"])


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Mapping[str, Any], rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, tp: TPGroup, backend_name: str) -> None:
        super().__init__()
        hidden = hf_config["hidden_size"]
        num_heads = hf_config["num_attention_heads"]
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        head_dim = head_dim_of(hf_config)
        o_bias = bool(hf_config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads,
                                          qkv_bias, tp)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, o_bias, tp)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by every layer
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5,
                              backend_name)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) * D] for this rank's heads
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(cos_sin, q, k)
        out = self.attn(q, k, v.contiguous(), kv_cache, meta)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(DecoderLayer):
    """Llama attention and the two RMSNorms around an MLP: dense here; Mixtral's and
    Qwen2-MoE's layers (llama_moe.py) override build_mlp."""

    def __init__(self, hf_config: Mapping[str, Any], rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, tp: TPGroup, backend_name: str, layer_id: int = 0) -> None:
        super().__init__()
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(hf_config, rotary_emb, qkv_bias, tp, backend_name)
        self.input_layernorm = RMSNorm(hf_config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(hf_config["hidden_size"], eps)
        self.build_mlp(hf_config, layer_id, tp)

    def build_mlp(self, hf_config: Mapping[str, Any], layer_id: int, tp: TPGroup) -> None:
        self.mlp = dense_mlp(hf_config, tp)

    def fused_weights(self, plain: bool = False) -> FusedLayerWeights:
        """This (dense) layer's tensors for the fused decode loop (`plain`: the plain weights
        even where packed copies exist)."""
        attn, mlp = self.self_attn, self.mlp
        gate_up, down = mlp._modules[mlp.gate_up_name], mlp._modules[mlp.down_name]
        return FusedLayerWeights(
            input_norm=self.input_layernorm.weight,
            qkv=product_matrix(attn.qkv_proj, plain), qkv_bias=attn.qkv_proj.bias,
            o_proj=product_matrix(attn.o_proj, plain), o_bias=attn.o_proj.bias,
            post_norm=self.post_attention_layernorm.weight,
            gate_up=product_matrix(gate_up, plain), gate_up_bias=gate_up.bias,
            down=product_matrix(down, plain), down_bias=down.bias)


class LlamaModel(DecoderModel):
    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, qkv_bias: bool,
                 tp: TPGroup, backend_name: str) -> None:
        rotary_emb = RotaryEmbedding(head_dim_of(hf_config), max_positions, hf_config)
        super().__init__(hf_config, tp, rotary_emb, lambda _: LlamaDecoderLayer(
            hf_config, rotary_emb, qkv_bias, tp, backend_name))

    def fused_decode_weights(self, lm_head: nn.Module | None, plain: bool = False
                             ) -> FusedDecodeWeights | None:
        """Every layer is a dense LlamaDecoderLayer of one NeoX rotary table and one eps: the
        fused loop can run them where this is one tensor-parallel rank, one pipeline stage,
        and the "cpu" attention backend reads the cache."""
        attn = self.layers[0].self_attn
        if (not self.stage.is_whole or attn.attn.backend.name != "cpu"
                or attn.qkv_proj.tp.size != 1 or self.rotary_emb.is_interleaved):
            return None
        return FusedDecodeWeights(
            layers=[layer.fused_weights(plain) for layer in self.layers],
            eps=self.norm.eps, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, rotary_dim=self.rotary_emb.rotary_dim,
            scale=attn.attn.scale,
            rotary_tables=(self.rotary_emb.cos_cache, self.rotary_emb.sin_cache),
            final_norm=self.norm.weight,
            head=None if lm_head is None else product_matrix(lm_head, plain))


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[PackedMapping] = {**QKV_PACKED, **GATE_UP_PACKED}
    qkv_bias: ClassVar[bool] = False

    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, tp: TPGroup,
                 backend_name: str) -> None:
        super().__init__()
        qkv_bias = self.qkv_bias or bool(hf_config.get("attention_bias", False))
        self.model = LlamaModel(hf_config, max_positions, qkv_bias, tp, backend_name)
        self.add_lm_head(hf_config, tp)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with a bias on Q, K and V (and usually tied embeddings)."""

    qkv_bias: ClassVar[bool] = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's weights and math are Llama's (sliding window aside: see the loader)."""
