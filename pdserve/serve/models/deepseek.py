"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and a mixture of experts.

Parameter names are the checkpoint's. Attention compresses each token's K/V into one latent
row and caches only that; queries go through their own low-rank pair when q_lora_rank is set:

    q:       x ─► q_a_proj ─► q_a_layernorm ─► q_b_proj ─► [H, nope | rope]   (or q_proj)
    latent:  x ─► kv_a_proj_with_mqa ─► [c_kv (R) | k_pe (P)]
                  c_kv ─► kv_a_layernorm;  k_pe ─► rope (one key head, shared by all heads)
    kv_b_proj [H * (nope + v), R] = per head [W_UK (nope x R) ; W_UV (v x R)]

Decode runs MLA absorbed: W_UK folds into the query and W_UV is applied after attention,
so every head attends over the cached latent rows directly and no per-head K/V is built:

    q_latent[h] = q_nope[h] W_UK[h]                                      [T, H, R]
    score[h, j] = scale (q_latent[h] . c_kv[j] + q_rope[h] . k_rope[j])
    out[h]      = (sum_j softmax(score[h])_j c_kv[j]) W_UV[h]^T          [T, H, v]

Prefill goes to the backend's mla_prefill_attention: on CPU it up-projects each sequence's
context to per-head K/V (attention nope + rope wide, cheaper with many query rows); the
Triton backend runs the absorbed form through the paged prefill kernel.

The MLP of layer i is dense below first_k_dense_replace and a MoE block above: a router picks
num_experts_per_tok routed experts per token (V2: softmax scores, greedy or group-limited;
V3: sigmoid scores plus e_score_correction_bias to choose, group-limited), and shared experts
see every token (pdserve/serve/models/moe.py). Checkpoints store every expert as its own
gate/up/down (`experts.N.*`).

Tensor parallelism splits heads (q_b_proj / q_proj / kv_b_proj by columns, o_proj by rows)
and every expert's intermediate size (or, with expert parallelism, places whole experts); the
latent projections, the router and the latent cache are whole on every rank.

The loader skips V3's multi-token-prediction layer (model.layers.{num_hidden_layers}.*), as
HF does (skips_checkpoint_tensor), unless MTP speculative decoding asks for it: build_mtp
adds DeepseekMTPLayer and pdserve/serve/executor/loader.py load_mtp_weights loads it. FP8
checkpoints as released (block-scaled weights) load as they are (pdserve/serve/layers/fp8.py);
W_UK and W_UV are dequantized once, after loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from pdserve.serve.layers.attention import AttentionMetadata
from pdserve.serve.layers.common import RMSNorm, RotaryEmbedding, rope_parameters, yarn_mscale
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
)
from pdserve.serve.models.base import (
    GATE_UP_PACKED,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    PackedMapping,
    dense_mlp,
    require_divisible,
)
from pdserve.serve.models.moe import DeepseekMoE, is_other_ranks_expert, local_experts

# Hugging Face builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not
# rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(hf_config: Mapping[str, Any]) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when the context
    is stretched: a longer context flattens attention, and DeepSeek sharpens the softmax back
    by that temperature (cos/sin carry only the ratio mscale / mscale_all_dim)."""
    head_dim = int(hf_config["qk_nope_head_dim"]) + int(hf_config["qk_rope_head_dim"])
    scale = head_dim**-0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(float(params["factor"]), float(mscale_all_dim)) ** 2
    return scale


class MLAAttention(nn.Module):
    """Writes this step's latent rows into the layer's cache, then attends over the cache.

        kv_cache      [1, num_blocks, block_size, 1, R + P]    (the runner's MLA layout)
        latent_cache  kv_cache[0, :, :, 0] -> [num_blocks, block_size, R + P]

    Decode-only steps run absorbed: q_nope W_UK is the query of the MLA decode kernel, which
    reads each latent row once for all heads, and W_UV applies after. Prefill and mixed steps
    go to the backend's mla_prefill_attention (torch: K/V up-projected per sequence, narrow
    attention; Triton: absorbed through the paged prefill kernel).
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 backend_name: str) -> None:
        super().__init__()
        from pdserve.kernels import get_attention_backend  # lazy: Triton only when chosen

        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.scale = scale
        self.backend: Any = get_attention_backend(backend_name)

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                w_uk: torch.Tensor, w_uv: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, N], q_rope [T, H, P], latent [T, R + P], w_uk [H, N, R],
        w_uv [H, V, R] -> [T, H, V]."""
        if meta.context_parallel is not None:  # ring attention over the CP ranks
            return meta.context_parallel.mla_attention(q_nope, q_rope, latent, w_uk, w_uv,
                                                       kv_cache, self.scale, self.backend)
        latent_cache = kv_cache[0, :, :, 0]
        self.backend.write_latent_cache(latent, latent_cache, meta.slot_mapping)
        if meta.is_decode_only or meta.token_seq_lens is not None:
            # a verify step (speculative decoding): each token is its own decode query row
            seq_lens, block_tables = ((meta.seq_lens, meta.block_tables) if meta.is_decode_only
                                      else (meta.token_seq_lens, meta.token_block_tables))
            q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
            o_latent = self.backend.mla_decode_attention(
                q_latent, q_rope, latent_cache, seq_lens, block_tables, self.scale)
            return torch.einsum("thr,hvr->thv", o_latent, w_uv)
        return self.backend.mla_prefill_attention(
            q_nope, q_rope, latent_cache, w_uk, w_uv, meta.cu_seqlens_q, meta.seq_lens,
            meta.block_tables, self.scale, meta.max_query_len)


class DeepseekAttention(nn.Module):
    def __init__(self, hf_config: Mapping[str, Any], rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend_name: str) -> None:
        super().__init__()
        require_divisible(hf_config, "num_attention_heads", tp)
        hidden = hf_config["hidden_size"]
        num_heads = hf_config["num_attention_heads"]
        self.q_lora_rank: int | None = hf_config.get("q_lora_rank")
        self.kv_lora_rank = int(hf_config["kv_lora_rank"])
        self.nope_dim = int(hf_config["qk_nope_head_dim"])
        self.rope_dim = int(hf_config["qk_rope_head_dim"])
        self.v_head_dim = int(hf_config["v_head_dim"])
        self.num_heads = num_heads // tp.size  # this rank's heads
        bias = bool(hf_config.get("attention_bias", False))
        qk_head_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * qk_head_dim, False, tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * qk_head_dim,
                                                 False, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim,
                                                   bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, num_heads * (self.nope_dim + self.v_head_dim), False, tp)
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden, bias, tp)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by every layer
        self.w_uk: torch.Tensor | None = None  # process_weights_after_loading
        self.w_uv: torch.Tensor | None = None
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.rope_dim,
                                 softmax_scale(hf_config), backend_name)

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj once into contiguous per-head W_UK [H, N, R] and W_UV [H, V, R]
        (kv_b_proj's rows per head are [W_UK ; W_UV], each over R): the absorbed attention
        multiplies by them every step, and a strided view would be copied each time."""
        w_kv_b = self.kv_b_proj.dense_weight(self.kv_a_layernorm.weight.dtype).view(
            self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk = w_kv_b[:, :self.nope_dim].contiguous()
        self.w_uv = w_kv_b[:, self.nope_dim:].contiguous()

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv, _ = self.kv_a_layernorm(c_kv)
        q_rope, k_rope = self.rotary_emb(cos_sin, q_rope, k_rope.unsqueeze(1))
        latent = torch.cat([c_kv, k_rope.squeeze(1)], dim=-1)  # [T, R + P]

        if self.w_uk is None:  # built without the loader (which splits once after loading)
            self.process_weights_after_loading()
        out = self.attn(q_nope, q_rope, latent, self.w_uk, self.w_uv, kv_cache, meta)  # [T,H,v]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, hf_config: Mapping[str, Any], layer_id: int, rotary_emb: RotaryEmbedding,
                 scoring_func: str, tp: TPGroup, backend_name: str) -> None:
        super().__init__()
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        hidden = hf_config["hidden_size"]
        self.self_attn = DeepseekAttention(hf_config, rotary_emb, tp, backend_name)
        self.mlp = (DeepseekMoE(hf_config, scoring_func, tp) if is_moe_layer(hf_config, layer_id)
                    else dense_mlp(hf_config, tp))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


class SharedHead(nn.Module):
    """The MTP module's output: its own final norm and LM head (checkpoint: shared_head)."""

    def __init__(self, hf_config: Mapping[str, Any], tp: TPGroup) -> None:
        super().__init__()
        hidden = hf_config["hidden_size"]
        self.norm = RMSNorm(hidden, float(hf_config.get("rms_norm_eps", 1e-6)))
        self.head = ParallelLMHead(hf_config["vocab_size"], hidden, tp)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (checkpoint layer num_hidden_layers), used
    as the drafter of speculative decoding (pdserve/serve/engine/spec_decode.py). Row i pairs the
    main model's final hidden state h_i with the embedding of the token after position i:

        x = eh_proj([enorm(embed(t_(i+1))) ; hnorm(h_i)])     [T, 2H] -> [T, H]
        h' = decoder block(x) (its own MLA layer and KV cache, MoE or dense as layer i is)
        logits of t_(i+2) = shared_head.head(shared_head.norm(h'))

    The embedding is the main model's (the checkpoint's copy is the same tensor)."""

    def __init__(self, hf_config: Mapping[str, Any], layer_id: int, rotary_emb: RotaryEmbedding,
                 scoring_func: str, tp: TPGroup, backend_name: str) -> None:
        super().__init__(hf_config, layer_id, rotary_emb, scoring_func, tp, backend_name)
        hidden = hf_config["hidden_size"]
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        self.layer_id = layer_id
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, False)
        self.shared_head = SharedHead(hf_config, tp)

    def propose(self, embeds: torch.Tensor, previous_hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """embeds, previous_hidden [T, H] -> the block's output h' [T, H] (before the head's
        norm: what a chained draft takes as its previous hidden state)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds)[0], self.hnorm(previous_hidden)[0]],
                                   dim=-1))
        hidden, residual = super().forward(x, None, kv_cache, meta, cos_sin)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.shared_head.head(self.shared_head.norm(hidden)[0])


def is_moe_layer(hf_config: Mapping[str, Any], layer_id: int) -> bool:
    """Dense below first_k_dense_replace, then MoE on every moe_layer_freq-th layer (1 in
    every released checkpoint; Hugging Face reads only first_k_dense_replace)."""
    return (bool(hf_config.get("n_routed_experts"))
            and layer_id >= int(hf_config.get("first_k_dense_replace") or 0)
            and layer_id % int(hf_config.get("moe_layer_freq") or 1) == 0)


class DeepseekModel(DecoderModel):
    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, scoring_func: str,
                 tp: TPGroup, backend_name: str) -> None:
        # V2 configs carry no rope_interleave: Hugging Face's V2 always rotates pairs.
        rotary_emb = RotaryEmbedding(int(hf_config["qk_rope_head_dim"]), max_positions,
                                     hf_config, bool(hf_config.get("rope_interleave", True)))
        super().__init__(hf_config, tp, rotary_emb, lambda i: DeepseekDecoderLayer(
            hf_config, i, rotary_emb, scoring_func, tp, backend_name))


class DeepseekV2ForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[PackedMapping] = GATE_UP_PACKED
    scoring_func: ClassVar[str] = "softmax"

    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, tp: TPGroup,
                 backend_name: str) -> None:
        super().__init__()
        self.model = DeepseekModel(hf_config, max_positions, self.scoring_func, tp,
                                   backend_name)
        self.add_lm_head(hf_config, tp)
        self._hf_config = hf_config
        self._tp = tp
        self._backend_name = backend_name
        self._num_layers = int(hf_config["num_hidden_layers"])
        self.mtp: DeepseekMTPLayer | None = None
        """The multi-token-prediction module, built only for speculative decoding
        (build_mtp; pdserve/serve/executor/loader.py load_mtp_weights fills it)."""
        self._local_experts = local_experts(int(hf_config.get("n_routed_experts") or 0), tp)

    def build_mtp(self) -> DeepseekMTPLayer:
        """Add the MTP module (checkpoint layer num_hidden_layers); ValueError when the
        config declares none (num_nextn_predict_layers, as DeepSeek-V3's release has it)."""
        if int(self._hf_config.get("num_nextn_predict_layers") or 0) < 1:
            raise ValueError("this model has no multi-token-prediction layer "
                             "(num_nextn_predict_layers is 0 or missing in config.json): MTP "
                             "speculative decoding needs a DeepSeek-V3 checkpoint with one")
        self.mtp = DeepseekMTPLayer(self._hf_config, self._num_layers, self.model.rotary_emb,
                                    self.scoring_func, self._tp, self._backend_name)
        return self.mtp

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """What the loader skips: the multi-token-prediction layer V3 checkpoints append
        (model.layers.{num_hidden_layers}.*: for training and speculative decoding, not
        generation; HF skips it too), and routed experts other ranks hold."""
        parts = name.split(".", 3)
        if parts[:2] == ["model", "layers"] and parts[2].isdigit():
            if int(parts[2]) >= self._num_layers:
                return True
        return is_other_ranks_expert(name, "mlp", self._local_experts)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 is V2's architecture with sigmoid routing steered by e_score_correction_bias."""

    scoring_func: ClassVar[str] = "sigmoid"
