"""SimRunner: the model runner of `--engine sim`: a latency profile's wait instead of a forward.

    Engine ──► SimRunner.execute(step)
                 1. time the step by the profile (StepTimes.predict), divided by the speed-up
                 2. fold each chunk's tokens into its sequences' states, write them in the KV
                 3. wait out the step's time (layer by layer when the hand-off follows them)
                 4. logits: a few seeded candidates per sampled row, drawn from its state

Everything else of the worker is the real code: the scheduler and its token budget, the block
manager and prefix caching, the tiers, preemption, the request gateway, the hand-off, the
store, migration, metrics and traces (Dynamo's mocker and llm-d's inference-sim do the same for
their planners and routers). The checkpoint gives the vocabulary, the layer count and the
context length; its weights are never read, and no model code is imported.

Tokens come from the KV cache itself. Each position's 64-bit state is
mix(previous position's state, token), written into the first 8 bytes of that position's
slot in every layer (xor a per-layer salt); a step reads the state before its chunk from every
layer, so a token depends on every byte the hand-off, the store or a migration moved: the
same prompt gives the same tokens on any worker, and a block that arrived wrong (or not at
all) changes them. A state whose layers disagree is counted (`kv_mismatches`). A row's logits
are -20 everywhere but NUM_CANDIDATES tokens drawn from its state, with scores in [0, 4):
greedy is the top candidate, a seeded sampler picks among them as usual, and stop strings,
max_tokens, ignore_eos and logprobs work unchanged.

The KV pool is real memory with the checkpoint's layer count and one head per layer whose
width makes a token `SimConfig.kv_fraction` of the profile's kv_bytes_per_token; its block
count is the simulated device's, by the CPU rules of pdserve/serve/executor/kv_cache.py with
the profile's bytes per block (--kv-cache-memory-gb is the simulated device's KV budget).

Step times (t = the profile's models at the profile's entry for --tensor-parallel-size):

    prefill only     prefill.intercept + per_token · tokens + per_attention · Σ q_len·k_len
    decode only      decode.intercept + per_context_token · context + per_sequence · seqs
    mixed            max(both intercepts) + every marginal term above

A chunk is a decode when it is one token past position 0 that samples; any other is prefill
(a prompt's last token after a cached prefix is timed as a decode: the same work).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdserve.planner.goodput_model import LinearLatency
from pdserve.planner.latency_profile import LatencyProfile, ProfileError, load_profile
from pdserve.protocol.tp import StepInput
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig, SimConfig
from pdserve.serve.executor.kv_cache import (
    KVCachePlan,
    KVCachePool,
    available_host_memory_bytes,
    check_fits_host_memory,
    plan_kv_cache,
)
from pdserve.serve.executor.loader import ModelSpec, load_model_spec
from pdserve.serve.executor.logit_rows import logit_rows

logger = logging.getLogger(__name__)

NUM_CANDIDATES = 4
"""Tokens a row's logits favour; every other token's logit is OTHER_LOGIT."""
OTHER_LOGIT = -20.0
CANDIDATE_SCALE = 4.0
"""Candidate logits lie in [0, CANDIDATE_SCALE)."""
_MASK = (1 << 64) - 1
ROOT_STATE = 0x243F6A8885A308D3
"""The state before a sequence's first token (the same on every worker)."""


def mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit bijection whose outputs look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def next_state(state: int, token: int) -> int:
    return mix(state ^ ((token + 1) * 0xD6E8FEB86659FD93 & _MASK))


def layer_salt(layer: int) -> int:
    return mix(0x5EED ^ layer)


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _unsigned(x: int) -> int:
    return x & _MASK


def candidates(state: int, vocab_size: int) -> list[tuple[int, float]]:
    """The (token, logit) pairs a row of this state favours."""
    out = []
    for i in range(NUM_CANDIDATES):
        h = mix(state ^ (i + 1) * 0x9E3779B97F4A7C15 & _MASK)
        out.append((h % vocab_size, (h >> 40) / (1 << 24) * CANDIDATE_SCALE))
    return out


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """A step's work as the profile's models count it (the engine's StepSample's fields)."""

    prefill_tokens: int = 0
    query_keys: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    @classmethod
    def of(cls, step: StepInput) -> StepFeatures:
        prefill_tokens = query_keys = decode_seqs = decode_context = 0
        for chunk in step.chunks:
            num_tokens = len(chunk.token_ids)
            end = chunk.start_pos + num_tokens
            if num_tokens == 1 and chunk.start_pos > 0 and chunk.need_logits:
                decode_seqs += 1
                decode_context += end
            else:
                prefill_tokens += num_tokens
                query_keys += num_tokens * end
        return cls(prefill_tokens, query_keys, decode_seqs, decode_context)


class StepTimes:
    """The profile's step time for a step's work, at one TP entry."""

    def __init__(self, profile: LatencyProfile, tensor_parallel_size: int = 1) -> None:
        if tensor_parallel_size not in profile.prefill or tensor_parallel_size not in \
                profile.decode:
            raise ProfileError(
                f"profile {profile.model!r} has prefill TP {sorted(profile.prefill)} and "
                f"decode TP {sorted(profile.decode)}; the simulated worker asked for TP "
                f"{tensor_parallel_size} (--tensor-parallel-size)")
        self.prefill: LinearLatency = profile.prefill[tensor_parallel_size]
        self.decode: LinearLatency = profile.decode[tensor_parallel_size]

    def predict(self, features: StepFeatures) -> float:
        """Seconds, as the module docstring's table says."""
        seconds = 0.0
        intercepts = []
        if features.prefill_tokens:
            intercepts.append(self.prefill.intercept)
            per_token, per_attention = self.prefill.coefs
            seconds += per_token * features.prefill_tokens + per_attention * features.query_keys
        if features.decode_seqs:
            intercepts.append(self.decode.intercept)
            per_context, per_sequence = self.decode.coefs
            seconds += (per_context * features.decode_context
                        + per_sequence * features.decode_seqs)
        return seconds + max(intercepts, default=0.0)


def sim_spec(spec: ModelSpec, profile: LatencyProfile, kv_fraction: float) -> ModelSpec:
    """The checkpoint's spec with a KV row of one head whose width makes a token about
    kv_fraction x the profile's bytes (at least 8 bytes a plane: the state's)."""
    num_planes = 1 if spec.kv_kind == "mla" else 2
    item = spec.kv_torch_dtype.itemsize
    per_row = kv_fraction * profile.kv_bytes_per_token / (num_planes * spec.num_layers)
    width = max(8, int(per_row) // 8 * 8)  # bytes: a whole int64 state and aligned
    return dataclasses.replace(spec, num_kv_heads=1, head_dim=width // item)


class SimRunner:
    """The ModelRunner's interface (what the engine, the tiers and the hand-off call) over a
    simulated forward; one process, every layer and head in it."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel_config: ParallelConfig | None, sim_config: SimConfig) -> None:
        parallel_config = parallel_config or ParallelConfig()
        if parallel_config.pipeline_parallel_size > 1 or \
                parallel_config.context_parallel_size > 1 or parallel_config.nnodes > 1:
            raise ValueError("the simulated engine runs one process: pipeline and context "
                             "parallel sizes and --nnodes must be 1 (--tensor-parallel-size "
                             "picks the profile's entry)")
        self.profile = load_profile(sim_config.profile)
        self.sim_config = sim_config
        self._tp_size = parallel_config.tensor_parallel_size
        self.times = StepTimes(self.profile, self._tp_size)
        self.speedup = sim_config.speedup
        self.device = torch.device("cpu")
        spec = load_model_spec(model_config, "cpu")
        self.spec: ModelSpec = sim_spec(spec, self.profile, sim_config.kv_fraction)
        self.block_size = cache_config.block_size
        num_planes = 1 if self.spec.kv_kind == "mla" else 2
        simulated_block_bytes = self.profile.kv_bytes_per_token * self.block_size
        simulated = plan_kv_cache(cache_config, simulated_block_bytes, spec.max_model_len)
        real_block_bytes = (num_planes * self.spec.num_layers * self.block_size
                            * self.spec.head_dim * self.spec.kv_torch_dtype.itemsize)
        self.plan = KVCachePlan(simulated.num_blocks, self.block_size, real_block_bytes,
                                simulated.model_max_len, simulated.source)
        check_fits_host_memory(self.plan, 1, available_host_memory_bytes())
        self.spec = dataclasses.replace(self.spec, max_model_len=self.plan.max_model_len)
        self.num_blocks = self.plan.num_blocks
        self.kv_pool = KVCachePool(self.spec.num_layers, self.num_blocks, self.block_size, 1,
                                   self.spec.head_dim, self.spec.kv_torch_dtype, self.device,
                                   num_planes)
        self.kv_caches: list[torch.Tensor] = self.kv_pool.kv_caches
        self._states = [_state_view(cache) for cache in self.kv_caches]
        self._salts = torch.tensor([_signed(layer_salt(layer))
                                    for layer in range(self.spec.num_layers)])
        self.cpu_tuning = None
        self.num_steps = 0
        self.kv_mismatches = 0
        """States whose layers disagreed: KV that arrived wrong or not at all."""
        self.overrun_steps = 0
        """Steps whose own work took longer than the profile's time (the host is the limit)."""
        self.simulated_s = 0.0
        self.prefill_tokens = 0
        """Tokens computed by prefill chunks (a worker's prompt load)."""
        self.decode_tokens = 0
        self._closed = False
        logger.info("simulated engine: profile %r (%s), TP %d entry, speed-up %g; KV %s, "
                    "%d bytes a token (%.4g of the profile's %d)", self.profile.model,
                    self.profile.hardware, self._tp_size, self.speedup, self.plan.describe(),
                    real_block_bytes // self.block_size,
                    real_block_bytes / self.block_size / max(1, self.profile.kv_bytes_per_token),
                    self.profile.kv_bytes_per_token)

    # ---- what the engine and the worker read -------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        """The simulated TP degree (the profile's entry); every rank's pool is in this
        process, so per-layer callbacks see whole heads at any degree."""
        return self._tp_size

    layer_callbacks_see_whole_heads = True
    pipeline_parallel_size = 1
    context_parallel_size = 1
    holds_whole_pool = True
    can_write_kv_layers = True

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    def moe_load(self) -> None:
        return None

    def fused_decode(self, num_rows: int | None = None) -> None:
        return None

    def call_before_each_layer(self, hook: Callable[[], None]) -> None:
        raise ValueError("the simulated engine has no layers to share cores around "
                         "(--borrow-idle-cores is for the torch engine)")

    def propose_drafts(self, chunks: list[Any]) -> list[list[int]]:
        raise ValueError("the simulated engine has no draft model")

    # ---- the step ---------------------------------------------------------------------------
    def execute(self, step: StepInput, layer_done: Callable[[int], None] | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As ModelRunner.execute: float32 logits for the step's sampling rows, then its
        prompt-logprob rows; it returns once the step's simulated time has passed."""
        start = time.perf_counter()
        if input_ids is not None:
            raise ValueError("the simulated engine reads the step's own token ids")
        self._check_usable()
        self._validate(step)
        vocab = self.spec.vocab_size
        if not step.chunks:
            return torch.empty(0, vocab, dtype=torch.float32)
        features = StepFeatures.of(step)
        seconds = self.times.predict(features) / self.speedup
        self.prefill_tokens += features.prefill_tokens
        self.decode_tokens += features.decode_seqs
        slots, states = self._fold(step)
        num_layers = len(self.kv_caches)
        if layer_done is None:
            for layer in range(num_layers):
                self._states[layer][slots] = states ^ self._salts[layer]
        else:  # pace the layers: the hand-off sends each as the "forward" passes it
            for layer in range(num_layers):
                self._states[layer][slots] = states ^ self._salts[layer]
                _wait_until(start + seconds * (layer + 1) / num_layers)
                layer_done(layer)
        rows = logit_rows(step)
        logits = torch.full((len(rows), vocab), OTHER_LOGIT, dtype=torch.float32)
        for row, state in enumerate(states[torch.from_numpy(rows)].tolist()):
            for token, score in candidates(_unsigned(state), vocab):
                logits[row, token] = max(float(logits[row, token]), score)
        self.num_steps += 1
        self.simulated_s += seconds
        if time.perf_counter() - start > seconds:
            self.overrun_steps += 1
        _wait_until(start + seconds)
        return logits

    def _fold(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's pool slot and state (int64 [num_tokens] each, in step order)."""
        bs = self.block_size
        slots: list[int] = []
        firsts: list[int] = []  # slot of the position before each chunk (-1: none)
        for chunk in step.chunks:
            table = chunk.block_table
            pos = chunk.start_pos
            firsts.append(table[(pos - 1) // bs] * bs + (pos - 1) % bs if pos > 0 else -1)
            slots.extend(table[p // bs] * bs + p % bs
                         for p in range(pos, pos + len(chunk.token_ids)))
        before = self._read_states(firsts)
        states: list[int] = []
        for chunk, state in zip(step.chunks, before, strict=True):
            for token in chunk.token_ids:
                state = next_state(state, token)
                states.append(_signed(state))
        return torch.tensor(slots, dtype=torch.int64), torch.tensor(states, dtype=torch.int64)

    def _read_states(self, slots: Sequence[int]) -> list[int]:
        """The state at each slot, read from every layer (ROOT_STATE for -1); a slot whose
        layers disagree counts as a mismatch and yields their mix (tokens change)."""
        present = [s for s in slots if s >= 0]
        by_slot: dict[int, int] = {}
        if present:
            index = torch.tensor(present, dtype=torch.int64)
            per_layer = torch.stack([view[index] ^ salt for view, salt in
                                     zip(self._states, self._salts, strict=True)])
            agree = (per_layer == per_layer[0]).all(dim=0)
            first = per_layer[0].tolist()
            if not bool(agree.all()):
                for i in torch.nonzero(~agree).flatten().tolist():
                    self.kv_mismatches += 1
                    folded = 0
                    for value in per_layer[:, i].tolist():
                        folded = mix(folded ^ _unsigned(value))
                    first[i] = _signed(folded)
            by_slot = dict(zip(present, (_unsigned(v) for v in first), strict=True))
        return [ROOT_STATE if s < 0 else by_slot[s] for s in slots]

    def _validate(self, step: StepInput) -> None:
        for c in step.chunks:
            if not c.token_ids:
                raise ValueError(f"request {c.request_id}: empty chunk")
            if c.num_draft_tokens:
                raise ValueError("the simulated engine verifies no drafts")
            end = c.start_pos + len(c.token_ids)
            if c.start_pos < 0 or end > self.spec.max_model_len:
                raise ValueError(f"request {c.request_id}: positions up to {end} exceed "
                                 f"max_model_len={self.spec.max_model_len}")
            if min(c.token_ids) < 0 or max(c.token_ids) >= self.spec.vocab_size:
                raise ValueError(f"request {c.request_id}: token id out of vocabulary")
            if len(c.block_table) < -(-end // self.block_size):
                raise ValueError(f"request {c.request_id}: block_table too short")
            if min(c.block_table) < 0 or max(c.block_table) >= self.num_blocks:
                raise ValueError(f"request {c.request_id}: block id out of "
                                 f"[0, {self.num_blocks})")

    # ---- the KV the hand-off and the tiers move -------------------------------------------
    def read_kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        return self.kv_pool.read_blocks(list(block_ids))

    def write_kv_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        self.kv_pool.write_blocks(list(block_ids), blocks)

    def write_kv_layer(self, layer: int, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.kv_pool.write_layer_blocks(layer, list(block_ids), blocks)

    # ---- lifetime -------------------------------------------------------------------------
    def sim_stats(self) -> dict[str, Any]:
        """For the worker's /status: what is simulated and how it went."""
        return {"profile": self.profile.model, "hardware": self.profile.hardware,
                "tensor_parallel_size": self._tp_size, "speedup": self.speedup,
                "kv_fraction": self.sim_config.kv_fraction, "steps": self.num_steps,
                "simulated_s": round(self.simulated_s, 3),
                "overrun_steps": self.overrun_steps, "kv_mismatches": self.kv_mismatches,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens}

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the simulated engine was shut down")

    def shutdown(self) -> None:
        self._closed = True

    def __enter__(self) -> SimRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _state_view(cache: torch.Tensor) -> torch.Tensor:
    """The int64 state of every token slot of one layer [num_blocks * block_size]: the first
    8 bytes of plane 0, head 0 of each slot, as a view into the pool."""
    planes, num_blocks, block_size = cache.shape[:3]
    raw = cache.view(torch.uint8).view(planes, num_blocks * block_size, -1)
    return raw[0, :, :8].view(torch.int64).view(num_blocks * block_size)


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
