"""Pipeline parallelism: a worker's layers split into stages, micro-batches flowing through them.

The world is PP x TP ranks; global rank g = stage * TP + tp_rank. Rank 0 (the engine
process) is stage 0's TP rank 0: it broadcasts every step to every rank (the control group,
pdserve/serve/executor/model_runner.py) and gets the step's logits back from the last stage.

    stage 0 (ranks 0..TP-1)       stage 1                 ...   stage PP-1
    embed_tokens                  layers [L1, L2)               layers [L_{PP-1}, L)
    layers [0, L1)                                              norm, lm_head
       │ hidden, residual ──send──►  │ ──send──► ... ──────────►  │ logits (last TP rank 0)
       ▲                                                          │
       └──────────────────────────── send (float32) ──────────────┘  to rank 0

Stage s holds layers [s*L/PP, (s+1)*L/PP) when PP divides L; otherwise the first L % PP
stages hold one layer more (the last stage also runs the LM head, so it is the one to spare).
Each stage builds, loads and allocates KV for its layers only: the others are
`MissingLayer` placeholders (parameter names stay the checkpoint's, `model.layers.N.*` with
the global N), the loader skips their checkpoint tensors, and the stage's KV pool has one
tensor per layer it holds. TP rank t of stage s sends to TP rank t of stage s+1 (every TP
rank holds the whole activation after its row-parallel all-reduce), over the world group:
gloo on CPU, NCCL on GPU. A stage's TP collectives run in its own subgroup.

Micro-batches (GPipe's fill and drain, within one engine step): every rank splits the step
the same way into M micro-batches of whole sequences (`split_micro_batches`, balanced by
tokens), and stage s works on micro-batch m while stage s+1 works on m-1:

    time ─►     t0    t1    t2    t3    t4
    stage 0     m0    m1    m2    m3    ·      · = idle (the bubble)
    stage 1     ·     m0    m1    m2    m3

With equal stages a step takes M + PP - 1 slots, of which each stage is busy M: the bubble
is (PP - 1) / (M + PP - 1) of the step (`bubble_fraction`). M defaults to PP (bubble
(PP-1)/(2PP-1), a third at PP 2) and is capped by the step's number of sequences: a single
decode sequence cannot be split, so that step runs without overlap. The engine's contract
is unchanged: one step in, its logits out, in chunk order.

The KV hand-off is per layer: read_kv_blocks gathers each stage's layers (and each TP rank's
heads) into whole-model blocks, write_kv_blocks lets every rank keep its layers and heads,
so a prefill and a decode worker of different PP/TP shapes exchange blocks unchanged
(`assemble_kv_blocks`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pdserve.protocol.tp import StepInput
from pdserve.serve.layers.distributed import TPGroup

LOGITS_TAG = 1 << 20  # p2p tag of the logits message (activations use the micro-batch index)


def stage_layer_range(num_layers: int, num_stages: int, stage: int) -> range:
    """Layers of `stage`: an even split, the first num_layers % num_stages stages one more.

        10 layers, 4 stages:  [0, 3)  [3, 6)  [6, 8)  [8, 10)
    """
    if num_stages <= 0:
        raise ValueError("pipeline_parallel_size must be positive")
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's "
                         f"{num_layers} layers: every stage needs at least one layer")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages}")
    per_stage, extra = divmod(num_layers, num_stages)
    start = stage * per_stage + min(stage, extra)
    return range(start, start + per_stage + (1 if stage < extra else 0))


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of a GPipe step with equal stages: (PP - 1) / (M + PP - 1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


@dataclass(frozen=True)
class PipelineStage:
    """Which part of the model one stage holds."""

    index: int = 0
    num_stages: int = 1
    num_layers: int = 1
    """The whole model's decoder layers."""
    tie_word_embeddings: bool = False
    """A tied LM head reads the embedding: the last stage then holds the embedding too."""

    def __post_init__(self) -> None:
        stage_layer_range(self.num_layers, self.num_stages, self.index)  # validates

    @property
    def layers(self) -> range:
        return stage_layer_range(self.num_layers, self.num_stages, self.index)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def is_whole(self) -> bool:
        return self.num_stages == 1

    @property
    def holds_embedding(self) -> bool:
        return self.is_first or (self.is_last and self.tie_word_embeddings)

    def holds_layer(self, layer: int) -> bool:
        return layer in self.layers

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors of other stages: their layers, the embedding off the first
        stage (unless a tied head needs it), the final norm and LM head off the last."""
        if self.is_whole:
            return False
        parts = name.split(".", 3)
        if parts[:2] == ["model", "layers"] and parts[2].isdigit():
            return not self.holds_layer(int(parts[2]))
        if name.startswith("model.embed_tokens."):
            return not self.holds_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return not self.is_last
        return False


class MissingLayer(nn.Module):
    """The place of a layer another stage holds: no parameters, never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("a layer of another pipeline stage was called")


_BUILDING: contextvars.ContextVar[PipelineStage | None] = contextvars.ContextVar(
    "pdserve_pipeline_stage", default=None)


@contextlib.contextmanager
def building(stage: PipelineStage | None) -> Iterator[None]:
    """Models constructed inside build only `stage`'s part (as torch.device(...) sets where
    their parameters go); None: the whole model."""
    token = _BUILDING.set(stage)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def current_stage(num_layers: int, tie_word_embeddings: bool) -> PipelineStage:
    """The stage a model under construction builds (the whole model outside `building`)."""
    stage = _BUILDING.get()
    if stage is None:
        return PipelineStage(0, 1, num_layers, tie_word_embeddings)
    if stage.num_layers != num_layers:
        raise ValueError(f"pipeline stage of a {stage.num_layers}-layer model, building "
                         f"{num_layers} layers")
    return stage


# ---- the process group -------------------------------------------------------------------


@dataclass(frozen=True)
class PPGroup:
    """This process's place in the pipeline: its stage and TP rank, the ranks either side."""

    stage: PipelineStage = field(default_factory=PipelineStage)
    tp_rank: int = 0
    tp_size: int = 1
    num_micro_batches: int = 1
    timeout_s: float = 300.0
    """The longest wait for a send to a neighbouring stage (the process groups' timeout)."""

    @property
    def size(self) -> int:
        return self.stage.num_stages

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    @property
    def rank(self) -> int:
        return self.global_rank(self.stage.index, self.tp_rank)

    @property
    def prev_rank(self) -> int:
        return self.global_rank(self.stage.index - 1, self.tp_rank)

    @property
    def next_rank(self) -> int:
        return self.global_rank(self.stage.index + 1, self.tp_rank)

    @property
    def logits_rank(self) -> int:
        """The rank that holds a step's logits: the last stage's TP rank 0."""
        return self.global_rank(self.size - 1, 0)

    def layer_ranges(self) -> list[range]:
        s = self.stage
        return [stage_layer_range(s.num_layers, s.num_stages, i) for i in range(s.num_stages)]


def split_stages(world: TPGroup, tp_size: int, pp_size: int, timeout_s: float
                 ) -> tuple[TPGroup, int]:
    """The world's ranks as PP stages of TP ranks: (this rank's TPGroup within its stage,
    over a subgroup of its own, and its stage index). Every rank makes every stage's group,
    in the same order, as torch.distributed requires."""
    if pp_size == 1:
        return world, 0
    if world.size != tp_size * pp_size:
        raise ValueError(f"{world.size} ranks are not {pp_size} stages x {tp_size} TP ranks")
    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
        if world.rank in ranks:
            mine = group
    return TPGroup(rank=world.rank % tp_size, size=tp_size, group=mine), world.rank // tp_size


# ---- one step through the stages ---------------------------------------------------------


def split_micro_batches(step: StepInput, num_micro_batches: int) -> list[StepInput]:
    """At most num_micro_batches micro-batches of consecutive whole chunks, cut where the
    running token count passes each 1/M of the step (every micro-batch gets a chunk).
    Deterministic: every rank cuts a step alike."""
    chunks = step.chunks
    count = min(num_micro_batches, len(chunks))
    if count <= 1:
        return [step]
    total = step.num_tokens
    groups: list[list[Any]] = [[]]
    done = 0
    for i, chunk in enumerate(chunks):
        groups[-1].append(chunk)
        done += len(chunk.token_ids)
        to_open = count - len(groups)
        if to_open and (len(chunks) - i - 1 == to_open or done * count >= total * len(groups)):
            groups.append([])
    return [StepInput(group) for group in groups]


class StageRank(Protocol):
    """What the pipeline needs of a rank (pdserve/serve/executor/rank.py's Rank)."""

    pp: PPGroup
    device: torch.device

    def run_model(self, step: StepInput, kv_caches: list[torch.Tensor],
                  layer_done: Any = None,
                  carried: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """A pdserve/serve/models/base.py ModelOutput."""

    def compute_logits(self, hidden: torch.Tensor, step: StepInput) -> torch.Tensor | None: ...


@dataclass
class PipelineTimes:
    """Rank 0's time in pipelined steps: busy (its stage's forwards) against the whole
    step (until the logits arrived). 1 - busy/step is its measured bubble."""

    num_steps: int = 0
    busy_s: float = 0.0
    step_s: float = 0.0
    num_micro_batches: int = 0

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_s / self.step_s if self.step_s else 0.0


def run_pipelined_step(rank: StageRank, step: StepInput, kv_caches: list[torch.Tensor],
                       hidden_size: int, dtype: torch.dtype, num_logit_rows: int,
                       vocab_size: int, times: PipelineTimes | None = None
                       ) -> torch.Tensor | None:
    """This rank's part of one step: its stage's layers over every micro-batch, passing
    activations on as each finishes. Rank 0 returns the step's logits [rows, vocab] (float32,
    on its device; None without rows), every other rank None."""
    pp, device = rank.pp, rank.device
    start_s = time.perf_counter()
    busy_s = 0.0
    micro_batches = split_micro_batches(step, pp.num_micro_batches)
    sends: list[tuple[Any, torch.Tensor]] = []  # keep each sent tensor alive until done
    finals: list[torch.Tensor] = []
    for m, micro in enumerate(micro_batches):
        carried = None
        if not pp.stage.is_first:
            # [2, T, hidden]: hidden and residual in one message
            incoming = torch.empty(2, micro.num_tokens, hidden_size, dtype=dtype, device=device)
            dist.recv(incoming, src=pp.prev_rank, tag=m)
            carried = (incoming[0], incoming[1])
        busy_start_s = time.perf_counter()
        out = rank.run_model(micro, kv_caches, carried=carried)
        if pp.stage.is_last:
            finals.append(out.hidden)
        else:
            hidden, residual = out.carried
            outgoing = torch.stack([hidden, residual]).contiguous()
            sends.append((dist.isend(outgoing, dst=pp.next_rank, tag=m), outgoing))
        busy_s += time.perf_counter() - busy_start_s
    for work, _ in sends:
        work.wait(timeout=datetime.timedelta(seconds=pp.timeout_s))
    logits = None
    if pp.stage.is_last:
        busy_start_s = time.perf_counter()
        hidden = finals[0] if len(finals) == 1 else torch.cat(finals)
        logits = rank.compute_logits(hidden, step)
        busy_s += time.perf_counter() - busy_start_s
    if num_logit_rows:
        if pp.rank == pp.logits_rank:
            assert logits is not None
            dist.send(logits.to(device=device, dtype=torch.float32).contiguous(), dst=0,
                      tag=LOGITS_TAG)
            logits = None
        elif pp.rank == 0:
            logits = torch.empty(num_logit_rows, vocab_size, dtype=torch.float32,
                                 device=device)
            dist.recv(logits, src=pp.logits_rank, tag=LOGITS_TAG)
    if pp.rank != 0:
        return None
    if times is not None:
        times.num_steps += 1
        times.busy_s += busy_s
        times.step_s += time.perf_counter() - start_s
        times.num_micro_batches += len(micro_batches)
    return logits


# ---- the KV hand-off ---------------------------------------------------------------------


def assemble_kv_blocks(parts: list[torch.Tensor], pp: PPGroup, is_mla: bool
                       ) -> list[torch.Tensor]:
    """Whole-model blocks from every rank's [max stage layers, P, n, bs, local heads, D]
    (rank order; each stage's first rows are its layers): per layer
    [P, n, bs, all heads, D]. An MLA latent is whole on every TP rank: TP rank 0's is taken."""
    layers: list[torch.Tensor] = []
    for stage, layer_range in enumerate(pp.layer_ranges()):
        ranks = [pp.global_rank(stage, 0)] if is_mla else [
            pp.global_rank(stage, t) for t in range(pp.tp_size)]
        stage_blocks = torch.cat([parts[r][:len(layer_range)] for r in ranks], dim=4)
        layers.extend(stage_blocks.unbind(0))
    return layers


def pad_layers(blocks: torch.Tensor, num_layers: int) -> torch.Tensor:
    """[L, ...] zero-padded to [num_layers, ...]: a gather needs one shape from every rank."""
    if blocks.shape[0] == num_layers:
        return blocks
    padded = blocks.new_zeros((num_layers, *blocks.shape[1:]))
    padded[:blocks.shape[0]] = blocks
    return padded
