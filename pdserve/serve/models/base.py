"""What every decoder-only model here shares: the layer loop with its per-layer KV callback,
and the LM head (tied to the embedding or not). A model file only builds its layers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pdserve.serve.layers.attention import AttentionMetadata
from pdserve.serve.layers.common import RMSNorm, RotaryEmbedding, SiluAndMul
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.fused_decode import FusedDecode, FusedDecodeWeights, build_fused_decode
from pdserve.serve.layers.ops import reads_packed
from pdserve.serve.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.serve.layers.pipeline import MissingLayer, PipelineStage, current_stage

LayerDone = Callable[[int], None]
Carried = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) between pipeline stages
# checkpoint part -> (fused parameter, shard id): the loader routes a checkpoint tensor whose
# name holds ".q_proj." into shard "q" of the model's qkv_proj (see
# pdserve/serve/executor/loader.py)
PackedMapping = dict[str, tuple[str, str | int]]
QKV_PACKED: PackedMapping = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
}
GATE_UP_PACKED: PackedMapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class ModelOutput:
    """What a forward pass returns."""

    hidden: torch.Tensor
    """[T, hidden]: the final (normed) hidden states; on a pipeline stage before the last,
    its last layer's output."""
    residual: torch.Tensor | None = None
    """On a pipeline stage before the last: the residual that travels on with `hidden`."""
    logits: torch.Tensor | None = None
    """[T, vocab] for every row of `hidden`, where the fused decode loop computed them with
    the hidden states (pdserve/serve/layers/fused_decode.py); None otherwise (compute_logits makes
    them)."""

    @property
    def carried(self) -> Carried:
        """(hidden, residual) for the next pipeline stage."""
        assert self.residual is not None, "only a stage before the last carries a residual"
        return self.hidden, self.residual


def require_divisible(hf_config: Mapping[str, Any], key: str, tp: TPGroup) -> None:
    value = int(hf_config[key])
    if value % tp.size:
        raise ValueError(f"tensor parallelism needs {key}={value} divisible by "
                         f"tensor_parallel_size={tp.size}")


def require_silu(hf_config: Mapping[str, Any]) -> None:
    """Every MLP here (dense, expert, shared expert) is silu-gated."""
    act = hf_config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (silu)")


class GatedMLP(nn.Module):
    """silu(x W_gate) * (x W_up) W_down: dense layers, each expert and the shared experts.

    The two projections are registered under the checkpoint's names: gate_up_proj (gate and
    up fused) and down_proj, or a subclass's (Mixtral's experts: w13 and w2).
    reduce=False leaves the all-reduce to the MoE block that sums several of these.
    """

    gate_up_name: ClassVar[str] = "gate_up_proj"
    down_name: ClassVar[str] = "down_proj"

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup,
                 reduce: bool = True) -> None:
        super().__init__()
        self.add_module(self.gate_up_name, MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, tp))
        self.add_module(self.down_name,
                        RowParallelLinear(intermediate_size, hidden_size, bias, tp, reduce))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._modules[self.gate_up_name], self._modules[self.down_name]
        return down(self.act_fn(gate_up(x)))  # type: ignore[misc]


def dense_mlp(hf_config: Mapping[str, Any], tp: TPGroup) -> GatedMLP:
    """A layer's dense MLP: intermediate_size wide, TP-split, biases if mlp_bias."""
    require_silu(hf_config)
    require_divisible(hf_config, "intermediate_size", tp)
    return GatedMLP(hf_config["hidden_size"], int(hf_config["intermediate_size"]),
                    bool(hf_config.get("mlp_bias", False)), tp)


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then MLP, each after an RMSNorm that also adds the residual.
    Subclasses set input_layernorm, self_attn, post_attention_layernorm and mlp."""

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, meta, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm, with one rotary table shared by every layer.

    Each layer is called as layer(hidden, residual, kv_cache, meta, cos_sin) and returns
    (hidden, residual); layer_done(i) runs as soon as layer i has written its KV, so the KV
    hand-off saves layer by layer from there.

    Under pipeline parallelism (pdserve/serve/layers/pipeline.py) the model is one stage's part:
    the layers
    of other stages are MissingLayer placeholders (names keep the global layer index), the
    embedding lives on the first stage, the norm on the last; kv_caches holds this stage's
    layers only, and a stage other than the last returns (hidden, residual) for the next.
    """

    def __init__(self, hf_config: Mapping[str, Any], tp: TPGroup, rotary_emb: RotaryEmbedding,
                 make_layer: Callable[[int], nn.Module]) -> None:
        """make_layer(i) builds decoder layer i (the model file's own layer class)."""
        super().__init__()
        self.stage = current_stage(int(hf_config["num_hidden_layers"]),
                                   bool(hf_config.get("tie_word_embeddings", False)))
        self.embed_tokens = (VocabParallelEmbedding(hf_config["vocab_size"],
                                                    hf_config["hidden_size"], tp)
                             if self.stage.holds_embedding else None)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            make_layer(i) if self.stage.holds_layer(i) else MissingLayer()
            for i in range(hf_config["num_hidden_layers"]))
        self.norm = (RMSNorm(hf_config["hidden_size"], float(hf_config.get("rms_norm_eps", 1e-6)))
                     if self.stage.is_last else None)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, layer_done: LayerDone | None = None,
                carried: Carried | None = None, fused: FusedDecode | None = None
                ) -> ModelOutput:
        """carried: what the previous pipeline stage returned (None on the first); fused: the
        model's fused decode loop, which runs the layers of a step it applies to."""
        residual: torch.Tensor | None = None
        if carried is None:
            hidden = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            hidden, residual = carried
        # (the fused loop reads and writes a model-dtype cache: an FP8 one takes the layers)
        if (fused is not None and fused.applies(hidden, meta)
                and kv_caches[0].dtype == hidden.dtype):
            hidden, second = fused(hidden, kv_caches, meta)  # its own rotary rows
            if fused.ends_normed:  # the final norm ran too, and perhaps the LM head
                return ModelOutput(hidden, logits=second)
            residual = second
        else:
            cos_sin = self.rotary_emb.cos_sin(meta.positions, hidden.dtype)
            for i, kv_cache in zip(self.stage.layers, kv_caches, strict=True):
                hidden, residual = self.layers[i](hidden, residual, kv_cache, meta, cos_sin)
                if layer_done is not None:
                    layer_done(i)
        if not self.stage.is_last:
            return ModelOutput(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return ModelOutput(hidden)

    def fused_decode_weights(self, lm_head: nn.Module | None, plain: bool = False
                             ) -> FusedDecodeWeights | None:
        """What the fused decode loop reads (pdserve/serve/layers/fused_decode.py), declared by a
        model family that has one, from its loaded weights; None here: the layers run as
        modules."""
        return None


class CausalLM(nn.Module):
    """A DecoderModel (`self.model`) and its LM head; subclasses build `self.model` first,
    then call add_lm_head."""

    model: DecoderModel

    def __init__(self) -> None:
        super().__init__()
        self._fused_decodes: dict[bool, FusedDecode | None] = {}  # plain weights? -> loop

    def add_lm_head(self, hf_config: Mapping[str, Any], tp: TPGroup) -> None:
        """The LM head, on the last pipeline stage only."""
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        if not self.model.stage.is_last:
            self.lm_head = None
            return
        self.lm_head = ParallelLMHead(hf_config["vocab_size"], hf_config["hidden_size"], tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def pipeline_stage(self) -> PipelineStage:
        """The part of the model built here (the loader skips the others' tensors)."""
        return self.model.stage

    def forward(self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, layer_done: LayerDone | None = None,
                carried: Carried | None = None) -> ModelOutput:
        """input_ids [T] -> the final hidden states [T, hidden] (and, from a fused decode
        step, their logits); layer_done(i) runs as soon as layer i has written its KV (the KV
        hand-off saves layer by layer from there, so such a step runs the layers as modules).
        A pipeline stage other than the last returns (hidden, residual) for the next."""
        fused = (self.fused_decode(input_ids.shape[0])
                 if layer_done is None and self.model.stage.is_whole else None)
        return self.model(input_ids, kv_caches, meta, layer_done, carried, fused)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0 (None on other ranks)."""
        return self.lm_head(hidden)

    def fused_decode(self, num_rows: int | None = None) -> FusedDecode | None:
        """The layer loop of a decode step as one compiled call
        (pdserve/serve/layers/fused_decode.py), built on first use from the loaded weights the
        model declares; None where it has none. A step of `num_rows` rows that the CPU path keeps
        on the plain weights (ops.CpuPath.plain_rows) gets the loop over those; any other the
        loop over the packed copies (None: that one)."""
        plain = num_rows is not None and not reads_packed(num_rows)
        if plain not in self._fused_decodes:
            self._fused_decodes[plain] = build_fused_decode(
                self.model.fused_decode_weights(self.lm_head, plain))
        return self._fused_decodes[plain]

    def rebuild_fused_decode(self) -> None:
        """Forget the fused loops: the next decode step builds its loop for the CPU path in
        force (pdserve/serve/executor/cpu_tuning.py apply, after the weights were packed again)."""
        self._fused_decodes.clear()
