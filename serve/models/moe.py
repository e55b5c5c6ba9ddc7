"""DeepSeek's mixture-of-experts block: the router, the experts and how tokens reach them.

    x ─► router (replicated linear, fp32) ─► top-k experts and weights per token
      ─► routed experts: sum_k weight_k * expert_k(x)      + shared experts(x)  ─► all-reduce

V2 scores with a softmax (greedy or group-limited top-k), V3 with a sigmoid steered by
e_score_correction_bias (group-limited); checkpoints store each expert as its own gate/up/down
(`experts.N.*`). Experts are TP-split by default, or placed whole on ranks with expert
parallelism (DeepseekMoE's docstring draws the all-to-all).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.serve.layers import SiluAndMul
from pdserve.serve.parallel import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)


def require_divisible(hf_config: Mapping[str, Any], key: str, tp: TPGroup) -> None:
    value = int(hf_config[key])
    if value % tp.size:
        raise ValueError(f"DeepSeek needs {key}={value} divisible by tensor_parallel_size="
                         f"{tp.size}")


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
            require_divisible(hf_config, "moe_intermediate_size", tp)
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
