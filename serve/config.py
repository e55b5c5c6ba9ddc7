"""Engine configuration: one frozen dataclass per concern, every field documented and checked.

Values discovered at run time (the number of KV blocks that fit, the eos ids, the HF config)
live in separate objects (see loader.ModelSpec), never written back here. CLI flags take their
defaults from these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """A local Hugging Face checkpoint directory (config.json, safetensors, tokenizer files)."""
    dtype: str = "auto"
    """Weights, activations and KV cache: auto (the checkpoint's torch_dtype, except a bf16 or
    fp16 checkpoint on a CPU without native arithmetic for it, which runs in float32: see
    serve/loader.resolve_dtype), float32, bfloat16 or float16."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes max_position_embeddings."""
    seed: int = 0
    """Seed of the engine's default RNG (requests with their own seed use their own)."""
    served_model_name: str | None = None
    """The name clients use; None takes the checkpoint directory's base name."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class CacheConfig:
    """How big the KV pool is; the numbers it comes to are a KVCachePlan (serve/kv_cache.py).

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
    """Reuse full blocks whose chained block key matches (see kvstore/block_key.py)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
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
    """Rendezvous address of the TP group."""
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

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads <= 0:
            raise ValueError("cpu_threads must be positive")
        if self.tensor_parallel_size <= 0:
            raise ValueError("tensor_parallel_size must be positive")
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

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
