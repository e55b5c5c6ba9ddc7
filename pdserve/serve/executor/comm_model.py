"""The whiteboard in numbers: bytes each collective moves per step, for a model and a layout.

For a model's shape (from its config.json) and a parallel layout (TP, PP, CP, EP, tokens in a
step), what every collective the engine runs carries, as this code base runs them:

    TP all-reduce      2 per layer (attention O, MLP/MoE down: pdserve/serve/layers/parallel.py
                       RowParallelLinear, pdserve/serve/models/moe.py), + 1 for the vocab-split
                       embedding; payload [T, hidden]. A ring all-reduce sends (and receives)
                       2 (n - 1) / n x payload per rank: reduce-scatter then all-gather, each
                       n - 1 hops of payload / n.
    EP all-to-all      per MoE layer: dispatch, then combine, of the rank's even share of the
                       tokens (T / ep rows) x top_k rows of [hidden]; under uniform routing
                       (ep - 1) / ep of them cross to another rank (plus a tiny
                       [ep, experts per rank] int64 count exchange).
    PP send            per stage boundary per micro-batch: [2, T / m, hidden] (hidden and
                       residual, pdserve/serve/layers/pipeline.py), one rank to the next stage's.
    CP ring rotation   per layer, cp - 1 hops: each rank passes its T / cp tokens' KV rows
                       (MHA/GQA: K and V of the rank's KV heads; MLA: the latent
                       [c_kv | k_rope] row, pdserve/serve/executor/context_parallel.py).
    KV hand-off        per request of P prompt tokens: layers x P x the KV row of all heads
                       (what a stored block holds, pdserve/kvstore/block_key.py's layouts).

Every row says what it counts (`formula`), so a benchmark table reads like the derivation.
Payload is the tensor one call is handed; `bytes_per_rank` is what one rank sends per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """What communication depends on, read from a Hugging Face config.json."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    kv_lora_rank: int | None = None
    """MLA (DeepSeek-V2/V3): the latent's width; None for MHA/GQA."""
    qk_rope_head_dim: int = 0
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    num_experts_per_tok: int = 0
    moe_layers: tuple[int, ...] = ()
    """Indices of the MoE layers (DeepSeek's first_k_dense_replace layers are dense)."""
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads,
               self.head_dim, self.dtype_bytes) <= 0:
            raise ValueError(f"{self.name}: sizes must be positive")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: top-k must be in [1, num_experts]")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def kv_row_numbers(self, tp: int = 1) -> int:
        """Numbers per token per layer in one rank's KV cache: MHA 2 x its KV heads x
        head_dim; MLA the latent row, whole on every rank."""
        if self.is_mla:
            return int(self.kv_lora_rank or 0) + self.qk_rope_head_dim
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None,
                       dtype_bytes: int | None = None) -> ModelShape:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        experts = int(config.get("n_routed_experts") or config.get("num_local_experts")
                      or config.get("num_experts") or 0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            first_dense = int(config.get("first_k_dense_replace") or 0)
            dense = set(config.get("mlp_only_layers") or []) | set(range(first_dense))
            every = int(config.get("moe_layer_freq") or 1)
            moe_layers = tuple(i for i in range(layers) if i not in dense and i % every == 0)
        if dtype_bytes is None:
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
            dtype_bytes = DTYPE_BYTES.get(dtype, 2)
        kv_lora = config.get("kv_lora_rank")
        return cls(
            name=name or str(config.get("model_type", "model")),
            hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            dtype_bytes=dtype_bytes,
            kv_lora_rank=None if kv_lora is None else int(kv_lora),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0) if kv_lora else 0,
            num_experts=experts, num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_layers=moe_layers, vocab_size=int(config.get("vocab_size") or 0),
        )


@dataclass(frozen=True)
class Layout:
    """How a worker is split, and the step measured."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel degree (in pdserve the experts spread over the TP ranks: ep = tp)."""
    num_tokens: int = 1024
    """Tokens in the step (a prefill chunk's, or one per sequence for decode)."""
    num_micro_batches: int = 1
    """PP: micro-batches a step is cut into."""
    prompt_len: int = 1024
    """Prompt tokens of the request whose KV the hand-off moves."""

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.cp, self.ep, self.num_tokens,
               self.num_micro_batches, self.prompt_len) <= 0:
            raise ValueError("every layout number must be positive")


@dataclass(frozen=True)
class Collective:
    """One kind of transfer in a step."""

    name: str
    calls_per_step: int
    """On one rank (of the busiest stage)."""
    payload_bytes: int
    """The tensor one call is handed."""
    bytes_per_rank: int
    """What one rank sends over the whole step (all calls)."""
    formula: str


def ring_all_reduce_bytes(payload_bytes: int, n: int) -> int:
    """What each of n ranks sends in a ring all-reduce of payload_bytes: 2 (n - 1) / n x."""
    return 2 * (n - 1) * payload_bytes // n


def kv_handoff_bytes(shape: ModelShape, prompt_len: int) -> int:
    """Bytes a prefill -> decode hand-off moves for one request (all layers, all heads)."""
    return shape.num_layers * prompt_len * shape.kv_row_numbers(1) * shape.dtype_bytes


def comm_table(shape: ModelShape, layout: Layout) -> list[Collective]:
    """Every collective of one step under `layout`; rows with nothing to move are left out
    (a degree of 1), but for the hand-off, which every disaggregated request pays."""
    b, hidden, lay = shape.dtype_bytes, shape.hidden_size, layout
    layers_per_stage = -(-shape.num_layers // lay.pp)  # stage s: [s * that, (s + 1) * that)
    moe_per_stage = max(sum(1 for i in shape.moe_layers if i // layers_per_stage == s)
                        for s in range(lay.pp)) if shape.num_experts else 0
    tokens = lay.num_tokens // lay.cp  # each CP rank computes its share
    rows: list[Collective] = []
    if lay.tp > 1:
        payload = tokens * hidden * b
        calls = 2 * layers_per_stage
        rows.append(Collective(
            "tp_all_reduce", calls, payload, calls * ring_all_reduce_bytes(payload, lay.tp),
            f"2 x {layers_per_stage} layers x [{tokens} x {hidden}] x {b} B, ring "
            f"2({lay.tp}-1)/{lay.tp}"))
        rows.append(Collective(
            "tp_embedding_all_reduce", 1, payload, ring_all_reduce_bytes(payload, lay.tp),
            f"vocab-split embedding: [{tokens} x {hidden}] x {b} B, ring 2({lay.tp}-1)/{lay.tp}"))
    if lay.ep > 1 and moe_per_stage:
        share = tokens // lay.ep
        k = shape.num_experts_per_tok
        payload = share * k * hidden * b
        crossing = payload * (lay.ep - 1) // lay.ep
        counts = lay.ep * (shape.num_experts // lay.ep) * 8
        rows.append(Collective(
            "ep_all_to_all", 3 * moe_per_stage, payload,
            moe_per_stage * (2 * crossing + counts * (lay.ep - 1) // lay.ep),
            f"{moe_per_stage} MoE layers x (dispatch + combine of [{share} x {k} x {hidden}] "
            f"x {b} B, ({lay.ep}-1)/{lay.ep} off-rank) + counts"))
    if lay.pp > 1:
        micro = tokens // lay.num_micro_batches
        payload = 2 * micro * hidden * b
        rows.append(Collective(
            "pp_send", lay.num_micro_batches, payload, lay.num_micro_batches * payload,
            f"{lay.num_micro_batches} micro-batches x [2 x {micro} x {hidden}] x {b} B per "
            f"stage boundary ({lay.pp - 1} boundaries)"))
    if lay.cp > 1:
        row = shape.kv_row_numbers(lay.tp)
        payload = tokens * row * b
        calls = (lay.cp - 1) * shape.num_layers
        what = "latent" if shape.is_mla else "K+V"
        rows.append(Collective(
            "cp_ring_rotation", calls, payload, calls * payload,
            f"{shape.num_layers} layers x ({lay.cp}-1) hops x [{tokens} tokens x {row} "
            f"{what}] x {b} B"))
    handoff = kv_handoff_bytes(shape, lay.prompt_len)
    row = shape.kv_row_numbers(1)
    rows.append(Collective(
        "kv_handoff_per_request", 1, handoff, handoff,
        f"{shape.num_layers} layers x {lay.prompt_len} tokens x {row} "
        f"({'MLA latent' if shape.is_mla else 'K+V of every KV head'}) x {b} B"))
    return rows


def table_as_dicts(rows: list[Collective]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
