"""Engine configuration: one frozen dataclass per concern, every field documented and checked.

Values discovered at run time (the number of KV blocks that fit, the eos ids, the HF config)
live in separate objects (see loader.ModelSpec), never written back here. CLI flags take their
defaults from these dataclasses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # pdserve/serve/layers/fp8.py reads the same tuple


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """A local Hugging Face checkpoint directory (config.json, safetensors, tokenizer files)."""
    dtype: str = "auto"
    """Weights, activations and KV cache: auto (the checkpoint's torch_dtype, except a bf16 or
    fp16 checkpoint on a CPU without native arithmetic for it, which runs in float32: see
    pdserve/serve/loader.resolve_dtype), float32, bfloat16 or float16."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes max_position_embeddings."""
    seed: int = 0
    """Seed of the engine's default RNG (requests with their own seed use their own)."""
    served_model_name: str | None = None
    """The name clients use; None takes the checkpoint directory's base name."""
    enforce_eager: bool = False
    """Run every step eagerly, as vLLM's --enforce-eager: no CUDA graphs. By default a
    one-rank CUDA worker captures its decode steps at a few batch sizes after the KV pool is
    allocated and replays them (pdserve/serve/executor/cuda_graphs.py); this turns that off."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class CacheConfig:
    """How big the KV pool is; the numbers it comes to are a KVCachePlan
    (pdserve/serve/executor/kv_cache.py).

    The pool's size, first rule that applies (vLLM's rules):
      1. num_blocks, when set;
      2. kv_cache_memory_bytes, when set (on CPU it defaults to 512 MiB, vLLM CPU's
         VLLM_CPU_KVCACHE_SPACE): checked against the host's available memory on CPU;
      3. on CUDA: gpu_memory_utilization x device memory, less what the weights and a
         profiling forward of max_num_batched_tokens tokens took.
    """

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """KV blocks in the pool (per TP rank, the same on every rank); overrides both budgets."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV pool (summed over layers, per TP rank). None: on CUDA, sized from
    gpu_memory_utilization; on CPU, DEFAULT_CPU_KV_CACHE_MEMORY_BYTES."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the fraction of each device's memory this worker may use in all (weights,
    activations, KV pool), as vLLM's --gpu-memory-utilization. Ignored on CPU."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained block key matches (see pdserve/kvstore/block_key.py)."""
    kv_offload_bytes: int = 0
    """Host DRAM below the pool (pdserve/serve/engine/kv_tiers.py): full prefix blocks the pool
    evicts are kept there and copied back instead of recomputed. 0: none. Needs prefix
    caching and one process holding the whole pool."""
    kv_cache_dtype: str = "auto"
    """What the KV pool holds: auto (the model dtype) or fp8 / fp8_e4m3 (float8_e4m3fn, a
    fixed per-tensor scale of 1.0; half of bf16's bytes, in the pool, the store and every
    hand-off; see pdserve/serve/layers/fp8.py)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks a model is split over (Megatron column/row split); the engine starts them."""
    backend: str | None = None
    """torch.distributed backend; None picks nccl on CUDA and gloo on CPU."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of the worker's ranks: node 0's rank 0 hosts it (listening on every
    interface), the other nodes connect to it."""
    master_port: int | None = None
    """Rendezvous port of the TP group; None picks a free one."""
    device: str | None = None
    """cuda or cpu; None picks cuda when available. On cuda, rank r takes the r-th device
    this process sees (CUDA_VISIBLE_DEVICES applies)."""
    cpu_threads: int | None = None
    """torch threads per rank on CPU; None divides the machine's cores among the ranks.
    Several workers on one host (`pdserve up`) each get their share so none starves."""
    enable_expert_parallel: bool = False
    """MoE layers place whole experts on the ranks (E / tensor_parallel_size each; tokens go
    to their experts' ranks by all-to-all) instead of splitting every expert over all ranks."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split into (pdserve/serve/layers/pipeline.py): stage s holds layers
    [s*L/PP, (s+1)*L/PP) (the first L % PP stages one more) and tensor_parallel_size ranks;
    the worker runs PP x TP ranks."""
    context_parallel_size: int = 1
    """Ranks a prompt's tokens are split over (zig-zag), attention as ring attention; each
    rank holds the KV of its blocks in its own pool, so the pool the engine sees is CP times
    one rank's (pdserve/serve/executor/context_parallel.py). Not combined with TP or PP yet."""
    pipeline_micro_batches: int | None = None
    """Micro-batches a step is split into (by sequences) so the stages overlap; the bubble is
    (PP-1)/(M+PP-1) of a step. None: pipeline_parallel_size."""
    expert_capacity_factor: float | None = None
    """MoE layers: each expert takes at most ceil(factor x tokens x top_k / num_experts) of a
    step's (token, expert) assignments, first come (token order) first served; an
    assignment past it is dropped and the token's other gates renormalised (GShard, Switch),
    so a hot expert cannot stall its rank. None: no limit (exact)."""
    nnodes: int = 1
    """Hosts the worker's ranks are spread over, evenly (torchrun's --nnodes): node k holds
    ranks [k * ranks_per_node, (k + 1) * ranks_per_node). Node 0 runs the engine (rank 0)."""
    node_rank: int = 0
    """This host's index among the nnodes (torchrun's --node-rank). Node 0 runs the engine
    and hosts the rendezvous at master_addr:master_port; every other node runs only its ranks,
    which join it and serve rank 0's steps."""
    dist_timeout_s: float | None = None
    """Longest wait of any collective (a step, a heartbeat), and with nnodes > 1 of node 0 for
    the other nodes' ranks to join the rendezvous; None: the runner's default (300 s)."""
    dist_interface: str | None = None
    """Network interface the ranks' gloo / NCCL connections bind and advertise
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); None: the one the host name resolves to."""

    @property
    def world_size(self) -> int:
        """Every rank of the worker, over all nodes: TP x PP x CP."""
        return (self.tensor_parallel_size * self.pipeline_parallel_size
                * self.context_parallel_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node,
                     (self.node_rank + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def __post_init__(self) -> None:
        if self.nnodes <= 0 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank} of "
                             f"{self.nnodes}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks cannot spread evenly over "
                             f"{self.nnodes} nodes")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a worker over several nodes needs master_port (--master-port): "
                             "the other nodes' ranks join the rendezvous there")
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            raise ValueError("expert_capacity_factor must be positive (None: no limit), got "
                             f"{self.expert_capacity_factor}")
        if self.dist_timeout_s is not None and self.dist_timeout_s <= 0:
            raise ValueError("dist_timeout_s must be positive")
        if self.cpu_threads is not None and self.cpu_threads <= 0:
            raise ValueError("cpu_threads must be positive")
        if self.tensor_parallel_size <= 0:
            raise ValueError("tensor_parallel_size must be positive")
        if self.pipeline_parallel_size <= 0:
            raise ValueError("pipeline_parallel_size must be positive")
        if self.context_parallel_size <= 0:
            raise ValueError("context_parallel_size must be positive")
        if self.context_parallel_size > 1 and (self.tensor_parallel_size > 1
                                               or self.pipeline_parallel_size > 1):
            raise ValueError("context_parallel_size > 1 does not combine with tensor or "
                             "pipeline parallelism yet: use one of them")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches <= 0:
            raise ValueError("pipeline_micro_batches must be positive")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Requests running at once (decode batch size cap)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes first (one token each), then prefill chunks."""
    enable_chunked_prefill: bool = True
    """Split long prompts over steps to fit the budget (else a prompt waits for a whole step)."""
    max_prefills_per_step: int = 0
    """Prompts that get prefill tokens in one step (0: as many as the budget holds). Where a
    prefill is compute-bound (CPU), batching prompts buys no throughput, and one at a time
    gives the first its token a whole batch sooner: a prefill worker's lever on TTFT."""
    async_scheduling: bool | None = None
    """Schedule step N+1 and turn step N's tokens into text while step N runs
    (pdserve/serve/engine/overlap.py). None: on where the model runs on one CUDA device, off on CPU
    (measured 1.1-2.5x slower there: its step thread is a second OpenMP team on the cores;
    docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_prefills_per_step < 0:
            raise ValueError("max_prefills_per_step must be >= 0 (0: no limit)")


SPEC_METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 8
"""The most drafts a sequence verifies in one step (a verify chunk's rows are 1 + k)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, for the one method pdserve has."""

    method: str = "mtp"
    """mtp: the checkpoint's multi-token-prediction module drafts (DeepSeek-V3)."""
    num_speculative_tokens: int = 1
    """Drafts per sequence per step (k): each step verifies 1 + k tokens and keeps 1..k+1."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a dict (LLM's argument), a JSON object (the CLI flag) or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError("speculative config must be a JSON object such as "
                             '{"method": "mtp", "num_speculative_tokens": 1}')
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown} (method, "
                             "num_speculative_tokens)")
        if "method" not in value:
            raise ValueError('speculative config needs "method" (mtp)')
        return cls(method=value["method"],
                   num_speculative_tokens=value.get("num_speculative_tokens", 1))


ENGINES = ("torch", "sim")
"""torch: the model's forward on the device; sim: a wait of a latency profile's predicted time
(pdserve/serve/executor/sim_runner.py)."""
DEFAULT_SIM_KV_FRACTION = 1 / 16


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine (`--engine sim`, as Dynamo's mocker and llm-d's inference-sim): the
    worker runs everything but the forward pass, which becomes a wait of the profile's
    predicted step time divided by `speedup`; the model's weights are never loaded."""

    profile: str
    """A latency profile (docs/planner.md): a JSON file, or the name of one bundled in
    pdserve/planner/profiles/ (pdserve/planner/latency_profile.py load_profile)."""
    speedup: float = 1.0
    """Every step takes the profile's time divided by this (>= 1 runs a fleet faster than
    the hardware it simulates)."""
    kv_fraction: float = DEFAULT_SIM_KV_FRACTION
    """Real KV bytes per token, as a fraction of the profile's kv_bytes_per_token: the pool,
    the hand-off and the store move and index real buffers this much smaller than the
    simulated model's (the block count is the simulated device's)."""

    def __post_init__(self) -> None:
        if not self.profile:
            raise ValueError("the simulated engine needs a latency profile (--sim-profile)")
        if not (self.speedup > 0 and self.speedup < float("inf")):
            raise ValueError(f"sim speedup must be a positive number, got {self.speedup}")
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"sim KV fraction must be in (0, 1], got {self.kv_fraction}")
