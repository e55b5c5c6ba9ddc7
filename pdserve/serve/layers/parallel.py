"""Tensor parallelism after Megatron-LM: the only place that knows a model is split.

A model file builds its blocks from these layers with checkpoint parameter names; each layer
allocates just its rank's shard and its `weight_loader` cuts that shard out of the full
checkpoint tensor. Per decoder block there are exactly two all-reduces (after O and after down):

    x ─► QKV (column: heads split) ─► attention (local heads) ─► O (row) ─► all-reduce
      ─► gate|up (column) ─► silu*mul ─► down (row) ─► all-reduce

A mixture-of-experts block still has one: every expert (and the shared expert) is split the
same column/row way, its down projection skips the reduce (`reduce=False`), and the block
all-reduces the sum of their partial outputs once. Small projections every rank needs whole
(MLA's latent down-projections, the MoE router) are `ReplicatedLinear`.

With expert parallelism (`TPGroup.expert_parallel`, over the same ranks) a rank holds whole
experts instead, and MoE rows travel to them and back with `all_to_all` (see
pdserve/serve/models/moe.py SparseMoE); the block still ends in one all-reduce.

The TP group is a small value (`TPGroup`, pdserve/serve/layers/distributed.py, where the process
group is set up) handed to every layer, not a module global, so two engines in one process (tests)
cannot clash.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu_linear import pack_panels as pack_panels  # re-exported (tests)
from pdserve.kernels.cpu_linear import unpack as unpack  # re-exported (tests)
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.fp8 import dequantize_rows, fp8_linear, scale_shard
from pdserve.serve.layers.ops import kernel, prepacks, reads_packed


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size="
                         f"{denominator}")
    return numerator // denominator


class ShardSource(Protocol):
    """A checkpoint tensor as weight loaders see it: a torch.Tensor, or a lazy safetensors
    view that reads from disk only the rows/columns narrow() asks for (one rank's shard)."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def _copy_shard(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, refusing (with the shapes) what copy_ would broadcast or reject cryptically."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint shard {tuple(src.shape)} does not fit parameter shard "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def can_prepack(weight: torch.Tensor) -> bool:
    """A packed copy pays on CPU for fp32 weights (the prepack op, pdserve/serve/layers/ops.py).
    bf16 weights stay plain: oneDNN refuses a bf16 reorder where the CPU lacks bf16 support."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and prepacks() and torch.backends.mkldnn.is_available())


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in the layout this process's linear op multiplies by without
    reordering it (pdserve/kernels/cpu_linear.py: pdserve's panels, or oneDNN's blocked layout)."""
    return kernel("prepack")(weight)


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's packed copy for the CPU path in force; None where it stays plain."""
    return prepack(weight) if can_prepack(weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None, fp8_scale: torch.Tensor | None = None,
           fp8_block_k: int = 128) -> torch.Tensor:
    """x W^T + b by this process's linear op (pdserve/serve/layers/ops.py), reading `packed` where
    prepack made it; an FP8 W (with its per-row block scales, pdserve/serve/layers/fp8.py) goes to
    fp8_linear."""
    if fp8_scale is not None:
        return fp8_linear(x, weight, fp8_scale, bias, fp8_block_k)
    return kernel("linear")(x, weight, bias, packed)


class PrepackedLinear(nn.Module):
    """A linear layer that, once loaded, also keeps its weight packed for the CPU (`packed`,
    see `prepack`: pdserve's panels for every step on AVX-512, else oneDNN's layout for
    prefills while decode steps read the plain weight). Two copies of every weight on CPU:
    the plain one stays the parameter that loaders, tensor parallelism and tests read.

    An FP8 checkpoint's layer (pdserve/serve/layers/fp8.py convert_linears) holds an FP8 weight
    and its per-row block scales, `weight_scale_inv` [rows, ceil(columns / fp8_block_k)]."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    fp8_block_k: int = 128

    def __init__(self) -> None:
        super().__init__()
        # a registered (empty) slot, not a class attribute: nn.Module keeps parameters in
        # _parameters, which a class-level None would shadow
        self.register_parameter("weight_scale_inv", None)

    def process_weights_after_loading(self) -> None:
        """Loader hook (after every parent's hook, which may still read the plain weight)."""
        self.repack()

    def repack(self) -> None:
        """The packed copy for the CPU path in force (none where it keeps weights plain)."""
        self.packed = packed_copy(self.weight)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's weight [out, in] in `dtype`, dequantized when it is FP8."""
        if self.weight_scale_inv is None:
            return self.weight.detach().to(dtype)
        return dequantize_rows(self.weight.detach(), self.weight_scale_inv.detach(), dtype,
                               self.fp8_block_k)

    def scale_loader(self, param: nn.Parameter, loaded: ShardSource) -> None:
        """A replicated layer's FP8 scales: every row and column."""
        _copy_shard(param.data, _rows(param, loaded, 0, param.shape[0]))

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.weight, bias, packed_for(self.packed, x), self.weight_scale_inv,
                      self.fp8_block_k)


def packed_for(packed: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The packed copy a product of x's rows reads: None (the plain weight) for the few rows
    the CPU path keeps on it (ops.CpuPath.plain_rows)."""
    if packed is None or reads_packed(x.numel() // x.shape[-1]):
        return packed
    return None


def product_matrix(layer: PrepackedLinear | ParallelLMHead, plain: bool = False
                   ) -> torch.Tensor:
    """The weight a layer's product reads: its panels where it has them (unless `plain`),
    else W [out, in]."""
    packed = layer.packed
    return packed if packed is not None and not packed.is_mkldnn and not plain else layer.weight


def _rows(param: nn.Parameter, loaded: ShardSource, start: int, length: int) -> torch.Tensor:
    """Rows [start, start + length) of a checkpoint tensor; for an FP8 scale parameter, the
    per-row scales of those weight rows out of the checkpoint's block grid."""
    block = getattr(param, "fp8_block_size", None)
    if block is None:
        return loaded.narrow(0, start, length)
    num_cols = param.shape[1] * block[1]  # whole blocks: the last may be partial
    return scale_shard(loaded, start, length, 0, num_cols, block, "weight rows")


def _cols(param: nn.Parameter, loaded: ShardSource, start: int, length: int) -> torch.Tensor:
    """Columns [start, start + length) of a checkpoint weight; for an FP8 scale parameter,
    the per-row scales of those columns (refused unless the split falls on a block edge)."""
    block = getattr(param, "fp8_block_size", None)
    if block is None:
        return loaded.narrow(1, start, length)
    return scale_shard(loaded, 0, param.shape[0], start, length, block,
                       "row-parallel weight")


def fp8_linear_types() -> tuple[type, ...]:
    """The layer types whose forward runs an FP8 weight (their forward calls _linear)."""
    return (ReplicatedLinear, ColumnParallelLinear, MergedColumnParallelLinear,
            QKVParallelLinear, RowParallelLinear)


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by its weight_loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ReplicatedLinear(PrepackedLinear):
    """y = x W^T + b with the whole W on every rank (no communication); the loader's default
    copy (shape-checked) fills it."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = _new_param(output_size, input_size)
        self.bias = _new_param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(PrepackedLinear):
    """y = x W^T + b with W's output rows split across ranks; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.output_size_per_rank = _divide(output_size, tp.size, "output_size")
        self.weight = _new_param(self.output_size_per_rank, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _new_param(self.output_size_per_rank) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: ShardSource) -> None:
        shard = param.shape[0]
        _copy_shard(param.data, _rows(param, loaded, self.tp.rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate|up); each part split on its own.

        full:   [ gate (I) | up (I) ]         rank r holds [ gate_r | up_r ]
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup
                 ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, tp)
        self.output_sizes = output_sizes
        for size in output_sizes:
            _divide(size, tp.size, "merged output size")

    def weight_loader(self, param: nn.Parameter, loaded: ShardSource, shard_id: int = 0
                      ) -> None:
        part = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        _copy_shard(param.data.narrow(0, offset, part),
                    _rows(param, loaded, self.tp.rank * part, part))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (and caches): a split, or one replicated head past tp > heads."""
    if tp_size <= num_kv_heads:
        return _divide(num_kv_heads, tp_size, "num_key_value_heads")
    _divide(tp_size, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
    return 1


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections with attention heads split across ranks.

    Q heads split evenly. KV heads split evenly when tp <= num_kv_heads; past that each KV head
    is replicated on tp / num_kv_heads consecutive ranks (GQA groups stay rank-local):

        num_kv_heads=2, tp=4:  rank 0,1 -> kv head 0;  rank 2,3 -> kv head 1
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup) -> None:
        self.head_dim = head_dim
        self.num_heads_per_rank = _divide(num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads_per_rank = kv_heads_per_rank(num_kv_heads, tp.size)
        self.num_kv_replicas = max(1, tp.size // num_kv_heads)
        out_per_rank = (self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank) * head_dim
        super().__init__(hidden_size, out_per_rank * tp.size, bias, tp)
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: ShardSource, shard_id: str = "q"
                      ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            kv_shard = self.tp.rank // self.num_kv_replicas
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, kv_shard * self.kv_size
        _copy_shard(param.data.narrow(0, offset, size), _rows(param, loaded, start, size))


class RowParallelLinear(PrepackedLinear):
    """y = all_reduce(x_r W_r^T) + b, with W's input columns split; input arrives sharded.

    With reduce=False each rank returns its partial sum (rank 0's carrying the bias) and the
    caller all-reduces, so several row-parallel outputs added together cost one reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup,
                 reduce: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.input_size_per_rank = _divide(input_size, tp.size, "input_size")
        self.weight = _new_param(output_size, self.input_size_per_rank)
        self.weight.weight_loader = self.weight_loader
        self.bias = _new_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: ShardSource) -> None:
        if param.dim() == 1:  # bias: added once, after the reduce
            _copy_shard(param.data, loaded.narrow(0, 0, loaded.shape[0]))
            return
        shard = self.input_size_per_rank
        _copy_shard(param.data, _cols(param, loaded, self.tp.rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, None)
        if self.reduce:
            y = self.tp.all_reduce(y)
        elif self.tp.rank != 0:
            return y  # the bias joins once, on rank 0, before the caller's reduce
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; ids outside a rank's range read zeros.

    The vocabulary is padded up to a multiple of tp, so a vocab_size like 1001 splits as
    501 + 501 rows with the last (padding) row never indexed.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_per_rank
        self.weight = _new_param(self.vocab_per_rank, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: ShardSource) -> None:
        rows = max(0, min(self.vocab_per_rank, loaded.shape[0] - self.vocab_start))
        param.data.zero_()
        _copy_shard(param.data.narrow(0, 0, rows), loaded.narrow(0, self.vocab_start, rows))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary: each rank scores its vocabulary slice, rank 0 gathers.

    Only rank 0 samples, so the others return None (a gather, not an all-gather).
    """

    packed: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """A packed copy for the CPU matmul library (a tied head shares the embedding's plain
        rows and packs its own copy)."""
        self.repack()

    def repack(self) -> None:
        """The packed copy for the CPU path in force (none where it keeps weights plain)."""
        self.packed = packed_copy(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = linear(hidden, self.weight, None, packed_for(self.packed, hidden))
        if self.tp.size == 1:
            return logits[:, : self.vocab_size]
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.tp.size)] if self.tp.rank == 0 \
            else None
        dist.gather(logits, parts, group=self.tp.group, group_dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
