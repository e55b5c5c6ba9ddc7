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
see every token. Checkpoints store every expert as its own gate/up/down (`experts.N.*`).

Tensor parallelism splits heads (q_b_proj / q_proj / kv_b_proj by columns, o_proj by rows)
and every expert's intermediate size; the latent projections, the router and the latent
cache are whole on every rank.

The loader skips V3's multi-token-prediction layer (model.layers.{num_hidden_layers}.*), as
HF does; FP8 checkpoints (block-scaled weights) are refused with a clear error: serve a bf16
conversion.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.serve.attention import AttentionMetadata
from pdserve.serve.layers import RMSNorm, RotaryEmbedding, SiluAndMul, rope_parameters, yarn_mscale
from pdserve.serve.models.base import CausalLM, DecoderLayer, DecoderModel
from pdserve.serve.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

# Hugging Face builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not
# rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _require_divisible(hf_config: Mapping[str, Any], key: str, tp: TPGroup) -> None:
    value = int(hf_config[key])
    if value % tp.size:
        raise ValueError(f"DeepSeek needs {key}={value} divisible by tensor_parallel_size="
                         f"{tp.size}")


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
        latent_cache = kv_cache[0, :, :, 0]
        self.backend.write_latent_cache(latent, latent_cache, meta.slot_mapping)
        if meta.is_decode_only:
            q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
            o_latent = self.backend.mla_decode_attention(
                q_latent, q_rope, latent_cache, meta.seq_lens, meta.block_tables, self.scale)
            return torch.einsum("thr,hvr->thv", o_latent, w_uv)
        return self.backend.mla_prefill_attention(
            q_nope, q_rope, latent_cache, w_uk, w_uv, meta.cu_seqlens_q, meta.seq_lens,
            meta.block_tables, self.scale, meta.max_query_len)


class DeepseekAttention(nn.Module):
    def __init__(self, hf_config: Mapping[str, Any], rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend_name: str) -> None:
        super().__init__()
        _require_divisible(hf_config, "num_attention_heads", tp)
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
        w_kv_b = self.kv_b_proj.weight.detach().view(
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


class DeepseekMLP(nn.Module):
    """silu(x W_gate) * (x W_up) W_down: the dense layers, each expert and the shared experts.

    reduce=False leaves the all-reduce to the MoE block that sums several of these."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup,
                 reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, reduce)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class TopKRouter(ReplicatedLinear):
    """Scores every routed expert per token and keeps num_experts_per_tok of them.

        V2 (softmax):  s = softmax(x W_g);  top-k of s, optionally within the top topk_group
                       groups by their best expert ("group_limited_greedy");  w = s * scale
        V3 (sigmoid):  s = sigmoid(x W_g);  c = s + e_score_correction_bias chooses: groups
                       ranked by the sum of their two best c, top-k of c within topk_group
                       groups;  w = s (not c), renormalised if norm_topk_prob, * scale

    Computed in float32 whatever the model dtype, as Hugging Face does.
    """

    def __init__(self, hf_config: Mapping[str, Any], scoring_func: str) -> None:
        num_experts = int(hf_config["n_routed_experts"])
        super().__init__(hf_config["hidden_size"], num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = int(hf_config["num_experts_per_tok"])
        self.scoring_func = scoring_func
        self.routed_scaling_factor = float(hf_config.get("routed_scaling_factor", 1.0))
        self.num_groups = int(hf_config.get("n_group") or 1)
        self.topk_groups = int(hf_config.get("topk_group") or self.num_groups)
        if scoring_func == "sigmoid":
            self.is_group_limited = True
            self.norm_topk_prob = bool(hf_config.get("norm_topk_prob", True))
            self.e_score_correction_bias = nn.Parameter(  # float32, as HF keeps it
                torch.empty(self.num_experts, dtype=torch.float32), requires_grad=False)
        else:
            topk_method = hf_config.get("topk_method") or "greedy"
            if topk_method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"unsupported DeepSeek-V2 topk_method {topk_method!r} "
                                 "(greedy, group_limited_greedy)")
            self.is_group_limited = topk_method == "group_limited_greedy"
            # Hugging Face ignores V2's norm_topk_prob (False in every V2 checkpoint).
            self.norm_topk_prob = False
        if self.is_group_limited and self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts={self.num_experts} is not a multiple of "
                             f"n_group={self.num_groups}")

    def forward(self, hidden: torch.Tensor  # type: ignore[override]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = F.linear(hidden.float(), self.weight.float())  # [T, E]
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.is_group_limited:
            choice = self._mask_other_groups(choice)
            if self.scoring_func == "softmax":
                scores = choice  # V2 weighs by the masked scores
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids

    def _mask_other_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Experts outside each token's topk_groups best groups drop out of the choice."""
        grouped = choice.view(choice.shape[0], self.num_groups, -1)  # [T, G, E / G]
        if self.scoring_func == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            dropped = float("-inf")
        else:
            group_scores = grouped.amax(dim=-1)
            dropped = 0.0
        best = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices  # [T, g]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), dropped).view_as(choice)


def local_experts(num_experts: int, tp: TPGroup) -> range:
    """The routed experts this rank holds: all of them (each TP-split), or with expert
    parallelism an even, contiguous share of whole experts."""
    if not (tp.expert_parallel and tp.size > 1):
        return range(num_experts)
    if num_experts % tp.size:
        raise ValueError(f"expert parallelism needs n_routed_experts={num_experts} divisible "
                         f"by tensor_parallel_size={tp.size}")
    per_rank = num_experts // tp.size
    return range(tp.rank * per_rank, (tp.rank + 1) * per_rank)


class DeepseekMoE(nn.Module):
    """Routed experts (each token to its top-k, weighted) plus shared experts (every token).

    Tensor parallel (default): every expert is TP-split like a dense MLP and sees every token
    it was routed; partial outputs are summed and all-reduced once. Expert parallel
    (tp.expert_parallel): each rank holds E / size whole experts, and tokens travel to them:

        every rank has all T tokens (attention all-reduced them); rank r routes its share
        [r T / size, (r + 1) T / size) ── all-to-all ──► each (token, expert) row to the
        expert's rank ── experts ── all-to-all ──► back, weighted into rank r's rows
        (a first, small all-to-all tells every rank how many rows per expert to expect)

    The shared experts stay TP-split; one all-reduce completes both (each routed row comes
    from one rank, the shared partial sums from all). On CPU the experts run one after
    another over just their rows.
    """

    def __init__(self, hf_config: Mapping[str, Any], scoring_func: str, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        hidden = hf_config["hidden_size"]
        inter = int(hf_config["moe_intermediate_size"])
        self.gate = TopKRouter(hf_config, scoring_func)
        self.local_experts = local_experts(self.gate.num_experts, tp)
        self.is_expert_parallel = len(self.local_experts) < self.gate.num_experts
        if not self.is_expert_parallel:
            _require_divisible(hf_config, "moe_intermediate_size", tp)
        expert_tp = TPGroup() if self.is_expert_parallel else tp  # whole or split experts
        # Keyed by global expert id, so parameter names stay the checkpoint's (experts.N.*).
        self.experts = nn.ModuleDict({
            str(e): DeepseekMLP(hidden, inter, False, expert_tp, reduce=False)
            for e in self.local_experts
        })
        num_shared = int(hf_config.get("n_shared_experts") or 0)
        self.shared_experts = (
            DeepseekMLP(hidden, inter * num_shared, bool(hf_config.get("mlp_bias", False)), tp,
                        reduce=False)
            if num_shared else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden)  # [T, k] each
        if self.is_expert_parallel:
            out = self._dispatch_and_combine(hidden, weights, expert_ids)
        else:
            top_k = expert_ids.shape[1]
            tokens = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k)
            out = self._weighted_sum(hidden, tokens, self._apply_experts(
                hidden.index_select(0, tokens), expert_ids.flatten()), weights.flatten())
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return self.tp.all_reduce(out)

    def _dispatch_and_combine(self, hidden: torch.Tensor, weights: torch.Tensor,
                              expert_ids: torch.Tensor) -> torch.Tensor:
        """Three all-to-alls: rows per expert, the rows (sorted by expert id, so by rank as
        experts are laid out rank by rank), and the expert outputs back."""
        num_tokens, top_k = expert_ids.shape
        size, rank, per_rank = self.tp.size, self.tp.rank, len(self.local_experts)
        start, end = rank * num_tokens // size, (rank + 1) * num_tokens // size
        ids = expert_ids[start:end].flatten()
        order = ids.argsort(stable=True)
        tokens = torch.arange(start, end, device=hidden.device).repeat_interleave(top_k)[order]
        send = torch.bincount(ids, minlength=self.gate.num_experts).view(size, per_rank)
        recv = self.tp.exchange_counts(send)  # [source rank, my expert]: rows coming here
        send_counts, recv_counts = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = self.tp.all_to_all(hidden.index_select(0, tokens), send_counts, recv_counts)
        # Each source's rows arrive sorted by expert: recover every row's expert id.
        mine = torch.arange(rank * per_rank, (rank + 1) * per_rank, device=hidden.device)
        row_experts = mine.repeat(size).repeat_interleave(recv.flatten())
        outputs = self._apply_experts(rows, row_experts)
        returned = self.tp.all_to_all(outputs, recv_counts, send_counts)
        return self._weighted_sum(hidden, tokens, returned, weights[start:end].flatten()[order])

    @staticmethod
    def _weighted_sum(hidden: torch.Tensor, tokens: torch.Tensor, outputs: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """out[t] = sum over rows i of token t of weights[i] * outputs[i] ([T, hidden])."""
        out = torch.zeros_like(hidden)
        return out.index_add_(0, tokens, (outputs * weights[:, None]).to(hidden.dtype))

    def _apply_experts(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """y[i] = expert expert_ids[i] (rows[i]), expert by expert over just its rows; every id
        is one of this rank's experts.

            rows sorted by expert:  e0: r3 r7 | e1: (none) | e2: r0 r4 r9 ...
        """
        order = expert_ids.argsort(stable=True)
        counts = torch.bincount(expert_ids, minlength=self.gate.num_experts).tolist()
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            index = order[start : start + count]
            out.index_copy_(0, index, self.experts[str(expert)](rows.index_select(0, index)))
            start += count
        return out


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, hf_config: Mapping[str, Any], layer_id: int, rotary_emb: RotaryEmbedding,
                 scoring_func: str, tp: TPGroup, backend_name: str) -> None:
        super().__init__()
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        hidden = hf_config["hidden_size"]
        act = hf_config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (silu)")
        self.self_attn = DeepseekAttention(hf_config, rotary_emb, tp, backend_name)
        self.mlp: nn.Module
        if is_moe_layer(hf_config, layer_id):
            self.mlp = DeepseekMoE(hf_config, scoring_func, tp)
        else:
            _require_divisible(hf_config, "intermediate_size", tp)
            self.mlp = DeepseekMLP(hidden, int(hf_config["intermediate_size"]),
                                   bool(hf_config.get("mlp_bias", False)), tp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


def is_moe_layer(hf_config: Mapping[str, Any], layer_id: int) -> bool:
    """Dense below first_k_dense_replace, then MoE on every moe_layer_freq-th layer (1 in
    every released checkpoint; Hugging Face reads only first_k_dense_replace)."""
    return (bool(hf_config.get("n_routed_experts"))
            and layer_id >= int(hf_config.get("first_k_dense_replace") or 0)
            and layer_id % int(hf_config.get("moe_layer_freq") or 1) == 0)


class DeepseekModel(DecoderModel):
    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, scoring_func: str,
                 tp: TPGroup, backend_name: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config["vocab_size"],
                                                   hf_config["hidden_size"], tp)
        # V2 configs carry no rope_interleave: Hugging Face's V2 always rotates pairs.
        rotary_emb = RotaryEmbedding(int(hf_config["qk_rope_head_dim"]), max_positions,
                                     hf_config, bool(hf_config.get("rope_interleave", True)))
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(hf_config, i, rotary_emb, scoring_func, tp, backend_name)
            for i in range(hf_config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hf_config["hidden_size"], float(hf_config.get("rms_norm_eps", 1e-6)))


class DeepseekV2ForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    scoring_func: ClassVar[str] = "softmax"

    def __init__(self, hf_config: Mapping[str, Any], max_positions: int, tp: TPGroup,
                 backend_name: str) -> None:
        super().__init__()
        self.model = DeepseekModel(hf_config, max_positions, self.scoring_func, tp,
                                   backend_name)
        self.add_lm_head(hf_config, tp)
        self._hf_config = hf_config
        self._local_experts = local_experts(int(hf_config.get("n_routed_experts") or 0), tp)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Routed experts held by other ranks (expert parallelism): the loader skips them."""
        parts = name.split(".")  # model.layers.L.mlp.experts.N.*
        if len(parts) < 6 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp",
                                                                                "experts"]:
            return False
        if not (parts[2].isdigit() and parts[5].isdigit()):
            return False
        return (is_moe_layer(self._hf_config, int(parts[2]))
                and int(parts[5]) not in self._local_experts)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 is V2's architecture with sigmoid routing steered by e_score_correction_bias."""

    scoring_func: ClassVar[str] = "sigmoid"
