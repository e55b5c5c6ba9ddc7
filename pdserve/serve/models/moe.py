"""Mixture-of-experts: the router, the experts and how tokens reach them.

    x ─► router (replicated linear) ─► top-k experts and weights per token
      ─► routed experts: sum_k weight_k * expert_k(x)      + shared expert(s)(x)  ─► all-reduce

One block, SparseMoE, serves every MoE model; the models differ in the router's scoring and
in the shared expert (SparseMoE.shared_output):

    DeepSeek-V2   softmax, greedy or group-limited top-k, * routed_scaling_factor; shared
                  experts summed in (DeepseekMoE, here)
    DeepSeek-V3   sigmoid + e_score_correction_bias to choose, group-limited, renormalised
    Mixtral       softmax, top-k, renormalised; no shared expert (pdserve/serve/models/llama_moe.py)
    Qwen2-MoE     softmax, top-k, renormalised iff norm_topk_prob; one shared expert scaled
                  per token by sigmoid(shared_expert_gate(x)) (pdserve/serve/models/llama_moe.py)

Checkpoints store each expert as its own gate/up/down (`experts.N.*`). Experts are TP-split
by default, or placed whole on ranks with expert parallelism (SparseMoE's docstring draws
the all-to-all).

Capacity (tp.expert_capacity_factor, ParallelConfig): with a factor f, each expert takes at
most C = ceil(f x T x top_k / num_experts) of a step's T x top_k (token, expert) assignments,
first come first served in token order (GShard, Switch); an assignment past C is dropped
(never sent, never computed) and the token's remaining gates are renormalised to their
original sum (a token with every slot dropped keeps only the shared expert and the
residual). Every rank routes every token alike, so all ranks drop the same assignments and
EP and TP give the same result. None: no limit, Hugging Face's exact routing. Routed and
dropped assignments are counted per expert (SparseMoE.load) for /metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.parallel import ReplicatedLinear
from pdserve.serve.models.base import GatedMLP, require_divisible, require_silu


class TopKRouter(ReplicatedLinear):
    """Scores every routed expert per token and keeps top_k of them.

        softmax:  s = softmax(x W_g);  top-k of s, within the topk_groups best groups by
                  their best expert when group-limited;  w = s (the masked s)
        sigmoid:  s = sigmoid(x W_g);  c = s + e_score_correction_bias chooses: groups
                  ranked by the sum of their two best c, top-k of c within topk_groups
                  groups;  w = s (not c)
        then:     w renormalised over the k if norm_topk_prob;  w * routed_scaling_factor

    The choice is group-limited when topk_groups < num_groups. Scores are float32 whatever
    the model dtype; is_float32_logits says whether x W_g is too (DeepSeek in Hugging Face) or
    runs in the model dtype and is upcast after (Mixtral, Qwen2-MoE), so that bf16 models pick
    the experts Hugging Face picks.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 scoring_func: str = "softmax", norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0, num_groups: int = 1,
                 topk_groups: int | None = None, is_float32_logits: bool = True) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {scoring_func!r} (softmax, sigmoid)")
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.num_groups = num_groups
        self.topk_groups = topk_groups or num_groups
        self.is_group_limited = self.topk_groups < num_groups
        self.is_float32_logits = is_float32_logits
        if scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(  # float32, as HF keeps it
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        """Kept plain: the router's small matmul may run in float32 over a bf16 weight."""

    def forward(self, hidden: torch.Tensor  # type: ignore[override]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        if self.is_float32_logits:
            logits = F.linear(hidden.float(), self.weight.float())  # [T, E]
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.is_group_limited:
            choice = self._mask_other_groups(choice)
            if self.scoring_func == "softmax":
                scores = choice  # DeepSeek-V2 weighs by the masked scores
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids

    def _mask_other_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Experts outside each token's topk_groups best groups drop out of the choice."""
        # [T, G, E / G]; E / G spelled out, as a CP rank may hold no tokens in a step
        grouped = choice.view(choice.shape[0], self.num_groups,
                              choice.shape[1] // self.num_groups)
        if self.scoring_func == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            dropped = float("-inf")
        else:
            group_scores = grouped.amax(dim=-1)
            dropped = 0.0
        best = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices  # [T, g]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), dropped).view_as(choice)


def local_experts(num_experts: int, tp: TPGroup, num_experts_key: str = "n_routed_experts"
                  ) -> range:
    """The routed experts this rank holds: all of them (each TP-split), or with expert
    parallelism an even, contiguous share of whole experts. num_experts_key names the count
    in the model's config, for the error."""
    if not (tp.expert_parallel and tp.size > 1):
        return range(num_experts)
    if num_experts % tp.size:
        raise ValueError(f"expert parallelism needs {num_experts_key}={num_experts} divisible "
                         f"by tensor_parallel_size={tp.size}")
    per_rank = num_experts // tp.size
    return range(tp.rank * per_rank, (tp.rank + 1) * per_rank)


def is_other_ranks_expert(name: str, block_name: str, mine: range) -> bool:
    """Whether a checkpoint tensor is a routed expert outside `mine` (this rank's experts):
    "model.layers.L.<block_name>.experts.N.*" with N not in mine. The loader skips those."""
    parts = name.split(".")
    if (len(parts) < 7 or parts[:2] != ["model", "layers"] or not parts[2].isdigit()
            or parts[3:5] != [block_name, "experts"] or not parts[5].isdigit()):
        return False
    return int(parts[5]) not in mine


class SparseMoE(nn.Module):
    """Routed experts: each token to its router's top-k, weighted; subclasses add a shared
    expert through shared_output().

    Tensor parallel (default): every expert is TP-split like a dense MLP and sees every token
    it was routed; partial outputs are summed and all-reduced once. Expert parallel
    (tp.expert_parallel): each rank holds E / size whole experts, and tokens travel to them:

        every rank has all T tokens (attention all-reduced them); rank r routes its share
        [r T / size, (r + 1) T / size) ── all-to-all ──► each (token, expert) row to the
        expert's rank ── experts ── all-to-all ──► back, weighted into rank r's rows
        (a first, small all-to-all tells every rank how many rows per expert to expect)

    A shared expert stays TP-split; one all-reduce completes both (each routed row comes
    from one rank, the shared partial sums from all). On CPU the experts run one after
    another over just their rows; on CUDA every expert's MLP is two launches of one grouped
    GEMM over the rows sorted by expert (pdserve/kernels/moe_gemm.py), reading the experts' weights
    stacked in one tensor each (`use_fused_kernel` forces either way, for tests).

    intermediate_key and num_experts_key name the expert width and count in hf_config;
    expert_cls builds each expert (its parameter names are the checkpoint's).
    """

    def __init__(self, hf_config: Mapping[str, Any], gate: TopKRouter, tp: TPGroup,
                 intermediate_key: str, num_experts_key: str,
                 expert_cls: type[GatedMLP] = GatedMLP) -> None:
        super().__init__()
        require_silu(hf_config)
        self.tp = tp
        hidden = hf_config["hidden_size"]
        inter = int(hf_config[intermediate_key])
        self.gate = gate
        self.local_experts = local_experts(gate.num_experts, tp, num_experts_key)
        self.is_expert_parallel = len(self.local_experts) < gate.num_experts
        if not self.is_expert_parallel:
            require_divisible(hf_config, intermediate_key, tp)
        expert_tp = TPGroup() if self.is_expert_parallel else tp  # whole or split experts
        # Keyed by global expert id, so parameter names stay the checkpoint's (experts.N.*).
        self.experts = nn.ModuleDict({
            str(e): expert_cls(hidden, inter, False, expert_tp, reduce=False)
            for e in self.local_experts
        })
        self.capacity_factor = tp.expert_capacity_factor
        self.load = ExpertLoad(gate.num_experts)
        self.use_fused_kernel: bool | None = None
        """The grouped-GEMM kernel for the experts: None on CUDA only."""
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Every token's shared-expert output, this rank's partial sum ([T, hidden], not yet
        all-reduced); None without a shared expert."""
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden)  # [T, k] each
        kept = None  # [T, k] bool: the assignments within capacity (None: all)
        if self.capacity_factor is not None:
            weights, kept = apply_capacity(weights, expert_ids, self.gate.num_experts,
                                           self.capacity_factor)
        self.load.add(expert_ids, kept)
        if self.is_expert_parallel:
            out = self._dispatch_and_combine(hidden, weights, expert_ids, kept)
        else:
            top_k = expert_ids.shape[1]
            tokens = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k)
            ids, flat_weights = expert_ids.flatten(), weights.flatten()
            outputs = None
            if kept is not None:  # dropped: expert id num_experts, which no expert computes
                flat_kept = kept.flatten()
                ids = ids.masked_fill(~flat_kept, self.gate.num_experts)
                outputs = self._apply_experts(hidden, ids, tokens).masked_fill(
                    ~flat_kept.unsqueeze(1), 0.0)  # their rows were never written
            else:
                outputs = self._apply_experts(hidden, ids, tokens)
            out = self._weighted_sum(hidden, tokens, outputs, flat_weights)
        shared = self.shared_output(hidden)
        if shared is not None:
            out = out + shared
        return self.tp.all_reduce(out)

    def _dispatch_and_combine(self, hidden: torch.Tensor, weights: torch.Tensor,
                              expert_ids: torch.Tensor, kept: torch.Tensor | None = None
                              ) -> torch.Tensor:
        """Three all-to-alls: rows per expert, the rows (sorted by expert id, so by rank as
        experts are laid out rank by rank), and the expert outputs back. Dropped
        assignments (kept False) are never sent."""
        num_tokens, top_k = expert_ids.shape
        size, rank, per_rank = self.tp.size, self.tp.rank, len(self.local_experts)
        start, end = rank * num_tokens // size, (rank + 1) * num_tokens // size
        ids = expert_ids[start:end].flatten()
        tokens = torch.arange(start, end, device=hidden.device).repeat_interleave(top_k)
        my_weights = weights[start:end].flatten()
        if kept is not None:
            mask = kept[start:end].flatten()
            ids, tokens, my_weights = ids[mask], tokens[mask], my_weights[mask]
        order = ids.argsort(stable=True)
        tokens = tokens[order]
        send = torch.bincount(ids, minlength=self.gate.num_experts).view(size, per_rank)
        # [source rank, my expert]: the rows coming here (row r of send goes to rank r)
        recv = self.tp.all_to_all(send, [1] * size, [1] * size)
        send_counts, recv_counts = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = self.tp.all_to_all(hidden.index_select(0, tokens), send_counts, recv_counts)
        # Each source's rows arrive sorted by expert: recover every row's expert id.
        mine = torch.arange(rank * per_rank, (rank + 1) * per_rank, device=hidden.device)
        row_experts = mine.repeat(size).repeat_interleave(recv.flatten())
        outputs = self._apply_experts(rows, row_experts)
        returned = self.tp.all_to_all(outputs, recv_counts, send_counts)
        return self._weighted_sum(hidden, tokens, returned, my_weights[order])

    @staticmethod
    def _weighted_sum(hidden: torch.Tensor, tokens: torch.Tensor, outputs: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """out[t] = sum over rows i of token t of weights[i] * outputs[i] ([T, hidden])."""
        out = torch.zeros_like(hidden)
        return out.index_add_(0, tokens, (outputs * weights[:, None]).to(hidden.dtype))

    def _apply_experts(self, rows: torch.Tensor, expert_ids: torch.Tensor,
                       row_of: torch.Tensor | None = None) -> torch.Tensor:
        """y[i] = expert expert_ids[i] (rows[row_of[i]]) (row_of: i itself when None), expert
        by expert over just its rows, each row gathered once; every id is one of this rank's
        experts, or one past the last (a dropped assignment: its row y[i] is left unwritten).

            pairs sorted by expert:  e0: i3 i7 | e1: (none) | e2: i0 i4 i9 ...

        The fused kernel (CUDA) lays the rows out on the device and reads nothing back; the
        loop (CPU) reads each expert's count to slice its rows."""
        stacked = self._fused_weights(rows)
        if stacked is not None:
            from pdserve.kernels.moe_gemm import fused_experts

            local_ids = expert_ids - self.local_experts.start
            return fused_experts(rows, local_ids, *stacked, row_of)
        order = expert_ids.argsort(stable=True)
        counts = expert_counts(expert_ids, self.gate.num_experts + 1)[:-1].tolist()
        out = rows.new_empty((expert_ids.shape[0], rows.shape[1]))
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            index = order[start : start + count]
            source = index if row_of is None else row_of.index_select(0, index)
            out.index_copy_(0, index, self.experts[str(expert)](rows.index_select(0, source)))
            start += count
        return out


    def _fused_weights(self, rows: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every local expert's gate_up [E, 2I, H] and down [E, H, I] weights, each in one
        tensor whose slices the experts' own parameters then are (no second copy); None
        where the loop runs: off CUDA (unless forced), FP8 or biased experts."""
        wanted = rows.is_cuda if self.use_fused_kernel is None else self.use_fused_kernel
        if not wanted:
            return None
        if self._stacked is None:
            experts = [self.experts[str(e)] for e in self.local_experts]
            gate_ups = [e._modules[e.gate_up_name] for e in experts]
            downs = [e._modules[e.down_name] for e in experts]
            if any(m.bias is not None or getattr(m, "weight_scale_inv", None) is not None
                   for m in gate_ups + downs):
                self.use_fused_kernel = False
                return None
            self._stacked = (_stack_into_views(gate_ups), _stack_into_views(downs))
        return self._stacked


def _stack_into_views(layers: list[nn.Module]) -> torch.Tensor:
    """The layers' weights stacked [E, out, in], each layer's weight then a view of it."""
    stacked = torch.stack([layer.weight.detach() for layer in layers])
    for i, layer in enumerate(layers):
        layer.weight.data = stacked[i]
    return stacked


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts] int64: how many of expert_ids name each expert, on their device. Not
    `bincount`, which sizes its output from the data (a read of its max) on CUDA."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    return counts.index_add_(0, expert_ids, torch.ones_like(expert_ids, dtype=torch.int64))


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert takes per step: ceil(factor x tokens x top_k / experts)."""
    return math.ceil(factor * num_tokens * top_k / num_experts)


def apply_capacity(weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                   factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights renormalised over the kept assignments, kept [T, k] bool).

    An assignment's place in its expert's queue is its rank among that expert's
    assignments in (token, slot) order; those at place >= capacity are dropped:

        expert ids (T=4, k=2)   [[0 1] [0 2] [0 1] [3 0]]     capacity 2
        place in the queue      [[0 0] [1 0] [2 1] [0 3]]
        kept                    [[T T] [T T] [F T] [T F]]
    """
    num_tokens, top_k = expert_ids.shape
    capacity = expert_capacity(num_tokens, top_k, num_experts, factor)
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)  # by expert, then token order
    counts = expert_counts(flat, num_experts)
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    place = torch.empty_like(flat).scatter_(
        0, order, torch.arange(flat.numel(), device=flat.device) - first[flat[order]])
    kept = (place < capacity).view(num_tokens, top_k)
    kept_weights = weights * kept
    total, kept_total = weights.sum(-1, keepdim=True), kept_weights.sum(-1, keepdim=True)
    scale = torch.where(kept_total > 0, total / kept_total.clamp_min(1e-20),
                        torch.zeros_like(total))
    return kept_weights * scale, kept


class ExpertLoad:
    """Per-expert counts of one MoE layer since start: assignments routed to (and computed
    by) each expert, and assignments dropped past capacity. Kept on the device (no sync per
    step); read with totals()."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._routed: torch.Tensor | None = None  # [E] int64
        self._dropped: torch.Tensor | None = None  # [] int64

    def add(self, expert_ids: torch.Tensor, kept: torch.Tensor | None) -> None:
        ids = expert_ids.flatten()
        if kept is None:
            routed = expert_counts(ids, self.num_experts)
            dropped = routed.new_zeros(())
        else:  # a dropped assignment counts for expert num_experts, cut off
            routed = expert_counts(ids.masked_fill(~kept.flatten(), self.num_experts),
                                   self.num_experts + 1)[:-1]
            dropped = ids.numel() - routed.sum()
        if self._routed is None or self._dropped is None:
            self._routed, self._dropped = routed, dropped
        else:
            self._routed += routed
            self._dropped += dropped

    def totals(self) -> tuple[list[int], int]:
        """(assignments per expert, dropped assignments) since start."""
        if self._routed is None or self._dropped is None:
            return [0] * self.num_experts, 0
        return self._routed.tolist(), int(self._dropped.item())


def moe_load(model: nn.Module) -> tuple[list[int], int] | None:
    """Every MoE layer's ExpertLoad summed by expert id: (assignments per expert, dropped);
    None for a model without MoE layers."""
    layers = [m.load for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return None
    num_experts = max(layer.num_experts for layer in layers)
    routed, dropped = [0] * num_experts, 0
    for layer in layers:
        counts, num_dropped = layer.totals()
        for e, count in enumerate(counts):
            routed[e] += count
        dropped += num_dropped
    return routed, dropped


def deepseek_router(hf_config: Mapping[str, Any], scoring_func: str) -> TopKRouter:
    """DeepSeek-V2 (softmax; greedy or group_limited_greedy) or V3 (sigmoid, group-limited,
    norm_topk_prob) routing from the checkpoint's config."""
    num_experts = int(hf_config["n_routed_experts"])
    num_groups = int(hf_config.get("n_group") or 1)
    topk_groups = int(hf_config.get("topk_group") or num_groups)
    if scoring_func == "sigmoid":
        norm_topk_prob = bool(hf_config.get("norm_topk_prob", True))
    else:
        topk_method = hf_config.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported DeepSeek-V2 topk_method {topk_method!r} "
                             "(greedy, group_limited_greedy)")
        if topk_method == "greedy":
            num_groups = topk_groups = 1
        # Hugging Face ignores V2's norm_topk_prob (False in every V2 checkpoint).
        norm_topk_prob = False
    if num_experts % num_groups:
        raise ValueError(f"n_routed_experts={num_experts} is not a multiple of "
                         f"n_group={num_groups}")
    return TopKRouter(hf_config["hidden_size"], num_experts,
                      int(hf_config["num_experts_per_tok"]), scoring_func=scoring_func,
                      norm_topk_prob=norm_topk_prob,
                      routed_scaling_factor=float(hf_config.get("routed_scaling_factor", 1.0)),
                      num_groups=num_groups, topk_groups=topk_groups)


class DeepseekMoE(SparseMoE):
    """DeepSeek's routed experts (deepseek_router) plus n_shared_experts, which every token
    passes through, held as one MLP n_shared_experts times as wide."""

    def __init__(self, hf_config: Mapping[str, Any], scoring_func: str, tp: TPGroup) -> None:
        super().__init__(hf_config, deepseek_router(hf_config, scoring_func), tp,
                         "moe_intermediate_size", "n_routed_experts")
        inter = int(hf_config["moe_intermediate_size"])
        num_shared = int(hf_config.get("n_shared_experts") or 0)
        self.shared_experts = (
            GatedMLP(hf_config["hidden_size"], inter * num_shared,
                     bool(hf_config.get("mlp_bias", False)), self.tp, reduce=False)
            if num_shared else None
        )

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(hidden)
