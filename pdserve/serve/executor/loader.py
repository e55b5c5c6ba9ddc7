"""Read a local Hugging Face checkpoint: its config into a ModelSpec, its weights into a model.

Weights come only from safetensors (never torch.load / pickle): a single model.safetensors,
or shards listed in model.safetensors.index.json. Each checkpoint tensor goes to the
parameter of the same name through that parameter's `weight_loader`, which cuts this TP
rank's shard; tensors the model fuses (q/k/v, gate/up) are routed by the model class's
`packed_modules_mapping`.

FP8 checkpoints as DeepSeek released them (`quantization_config` quant_method fp8, 128x128
block scales in `weight_scale_inv`) load as they are: the linear layers the checkpoint
quantized become FP8 layers before loading (pdserve/serve/layers/fp8.py), the rest load as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pdserve.kvstore.block_key import KVLayout
from pdserve.serve.config import ModelConfig
from pdserve.serve.cpu.huge_pages import rehome_weights
from pdserve.serve.layers.distributed import TPGroup
from pdserve.serve.layers.fp8 import Fp8WeightConfig, convert_linears, quantized_module_names
from pdserve.serve.layers.parallel import ShardSource
from pdserve.serve.layers.pipeline import PipelineStage, building
from pdserve.serve.models import get_model_class, is_supported

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Older configs without `architectures` still name their model_type.
MODEL_TYPES: dict[str | None, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Checkpoints this large (or sharded) get a progress bar while loading.
PROGRESS_MIN_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the engine needs to know about the loaded model (discovered, not set)."""

    architecture: str
    model_id: str  # the served name
    model_dir: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # KV-cache heads: num_key_value_heads, or 1 for an MLA latent
    head_dim: int  # KV-cache row width: per head, or kv_lora_rank + qk_rope_head_dim (MLA)
    hidden_size: int
    dtype: str  # "float32" | "bfloat16" | "float16": weights, activations (and KV cache)
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    hf_config: Mapping[str, Any] = field(compare=False, repr=False)
    kv_kind: str = "mha"  # "mha" (K and V per KV head) or "mla" (one latent row per token)
    quantization: Fp8WeightConfig | None = None
    """FP8 block-scaled weights (the checkpoint's quantization_config), or None."""
    kv_cache_dtype: str = ""
    """The KV pool's torch dtype name ("float8_e4m3fn" with kv_cache_dtype fp8); "": dtype."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """What the paged KV pool (and every block moved or stored) holds."""
        return getattr(torch, self.kv_cache_dtype or self.dtype)

    def kv_layout(self, block_size: int) -> KVLayout:
        return KVLayout(dtype=self.kv_cache_dtype or self.dtype, block_size=block_size,
                        num_layers=self.num_layers,
                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        kind=self.kv_kind)


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _as_ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def cpu_has_native(dtype: str) -> bool:
    """Whether this CPU computes in `dtype` natively: bf16 with AVX512-BF16 or AMX, fp16 with
    AMX-FP16. Elsewhere torch emulates half-precision matmuls through float32 conversions."""
    cpu = torch.cpu
    if dtype == "bfloat16":
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    if dtype == "float16":
        return bool(cpu._is_amx_fp16_supported())
    return True


def cpu_reads_half_panels() -> bool:
    """Whether pdserve's CPU kernels here read half-precision weights in their panel layout
    (built for AVX-512, where ATen dispatches AVX512 too; pdserve/kernels/cpu_linear.py
    panel_dtype)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def resolve_dtype(requested: str, checkpoint_dtype: str, device_type: str | None) -> str:
    """dtype "auto" is the checkpoint's, except that a half-precision checkpoint on a CPU runs
    in float32, which converting its weights keeps exact:
    - where the CPU has no native arithmetic for it (AVX2), half-precision math is emulated
      and slower than float32;
    - where the kernels read half-precision panels (AVX-512): the products read the
      checkpoint's own 2-byte weights and multiply in fp32 (pdserve/kernels/cpu_linear.py
      panel_dtype), a prefill's on AMX where the CPU has it (pdserve/kernels/csrc/amx_gemm.cpp);
      attention then runs in float32, so for prefill-only work `--dtype bfloat16` may be
      the faster (docs/benchmarks.md has the numbers)."""
    if requested != "auto":
        return requested
    if device_type == "cpu" and checkpoint_dtype in ("bfloat16", "float16"):
        native = cpu_has_native(checkpoint_dtype)
        if not native or cpu_reads_half_panels():
            logger.info("running the %s checkpoint in float32 on this CPU (%s; exact for its "
                        "weights); --dtype %s keeps it", checkpoint_dtype,
                        "its products read the 2-byte weights" if native
                        else f"no native {checkpoint_dtype} arithmetic", checkpoint_dtype)
            return "float32"
    return checkpoint_dtype


def load_model_spec(model_config: ModelConfig, device_type: str | None = None) -> ModelSpec:
    """Validate the checkpoint directory and read its config (no weights are touched).
    `device_type` (cpu | cuda) resolves dtype "auto" (resolve_dtype); None keeps the
    checkpoint's."""
    model_dir = Path(model_config.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has no config.json: not a Hugging Face "
                                "checkpoint directory")
    hf = _read_json(config_path)
    architectures = hf.get("architectures") or []
    architecture = architectures[0] if architectures else MODEL_TYPES.get(hf.get("model_type"))
    if architecture is None:
        raise ValueError(f"{config_path} names no architecture ('architectures' is empty and "
                         f"model_type {hf.get('model_type')!r} is not one pdserve knows)")
    if not is_supported(architecture):
        get_model_class(architecture)  # raises the ValueError listing what is supported

    quantization = hf.get("quantization_config")
    fp8 = Fp8WeightConfig.from_hf(quantization, str(config_path)) if quantization else None
    checkpoint_dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    dtype = resolve_dtype(model_config.dtype, checkpoint_dtype, device_type)
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)")

    num_heads = int(hf["num_attention_heads"])
    max_positions = int(hf.get("max_position_embeddings", 2048))
    max_model_len = model_config.max_model_len or max_positions
    if max_model_len > max_positions:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={max_positions}")
    window = hf.get("sliding_window")
    if window and (architecture in ("MistralForCausalLM", "MixtralForCausalLM")
                   or hf.get("use_sliding_window")):
        # The attention kernels see the whole context; up to the window that is exact.
        if model_config.max_model_len and model_config.max_model_len > window:
            raise ValueError(f"max_model_len={max_model_len} exceeds sliding_window={window},"
                             " which pdserve's attention does not implement")
        if max_model_len > window:
            logger.warning("capping max_model_len at the sliding window (%d)", window)
            max_model_len = int(window)

    if hf.get("kv_lora_rank"):  # MLA: the cache holds [c_kv | k_rope] once per token
        kv_kind, num_kv_heads = "mla", 1
        head_dim = int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])
    else:
        kv_kind, num_kv_heads = "mha", int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)

    eos = _as_ids(hf.get("eos_token_id"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos += [i for i in _as_ids(_read_json(generation_path).get("eos_token_id"))
                if i not in eos]
    return ModelSpec(
        architecture=architecture,
        model_id=model_config.served_model_name or model_dir.resolve().name,
        model_dir=str(model_dir),
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=int(hf["hidden_size"]),
        dtype=dtype,
        max_model_len=int(max_model_len),
        eos_token_ids=tuple(eos),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf_config=hf,
        kv_kind=kv_kind,
        quantization=fp8,
    )


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in shard order."""
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r} (pickled "
                                ".bin checkpoints are not loaded, for safety)")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {str(path)!r} is missing")
    return files


@contextlib.contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


class _LazyCheckpointTensor:
    """One safetensors entry, read on narrow(): a TP rank reads its shard, not the tensor."""

    def __init__(self, safe_file: Any, name: str) -> None:
        self._slice = safe_file.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]


def _default_weight_loader(param: nn.Parameter, loaded: ShardSource) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded.narrow(0, 0, loaded.shape[0]))


def load_weights(model: nn.Module, model_dir: str | Path, show_progress: bool = True) -> None:
    """Copy every checkpoint tensor into its (sharded) parameter; fail on gaps or extras."""
    files = checkpoint_files(model_dir)
    packed: Mapping[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    # What the model does not use on this rank (DeepSeek-V3's multi-token-prediction layer,
    # other ranks' experts under expert parallelism, other pipeline stages' layers).
    skips = _skips(model)
    expected_shards: dict[str, int] = {}
    for target, _ in packed.values():
        expected_shards[target] = expected_shards.get(target, 0) + 1
    loaded_shards: dict[str, set[object]] = {}

    total_bytes = sum(path.stat().st_size for path in files)
    num_tensors = 0
    for path in files:  # headers only: sizes the progress bar
        with safe_open(str(path), framework="pt", device="cpu") as f:
            num_tensors += len(list(f.keys()))
    from tqdm.auto import tqdm

    progress = tqdm(total=num_tensors, unit="tensor", desc="loading weights",
                    disable=not show_progress or (len(files) == 1
                                                  and total_bytes < PROGRESS_MIN_BYTES))
    with progress:
        for path in files:
            progress.set_postfix_str(path.name)
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    progress.update(1)
                    if name.endswith("rotary_emb.inv_freq") or (
                        tied and name == "lm_head.weight"
                    ) or skips(name):
                        continue  # recomputed / shared with the embedding / not used here
                    _load_one(params, packed, loaded_shards, name,
                              _LazyCheckpointTensor(f, name))

    # A fused parameter is complete once every one of its checkpoint parts arrived.
    missing = sorted(
        name for name in params
        if len(loaded_shards.get(name, ())) < expected_shards.get(name.split(".")[-2], 1)
    )
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks tensors for: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _load_one(params: Mapping[str, nn.Parameter], packed: Mapping[str, tuple[str, str | int]],
              loaded_shards: dict[str, set[object]], name: str, tensor: ShardSource) -> None:
    for checkpoint_part, (fused_part, shard_id) in packed.items():
        if f".{checkpoint_part}." in name:
            target = name.replace(f".{checkpoint_part}.", f".{fused_part}.")
            param = params.get(target)
            if param is None:
                break
            param.weight_loader(param, tensor, shard_id)
            loaded_shards.setdefault(target, set()).add(shard_id)
            return
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
    getattr(param, "weight_loader", _default_weight_loader)(param, tensor)
    loaded_shards.setdefault(name, set()).add(None)


def _skips(model: nn.Module) -> Callable[[str], bool]:
    """Which checkpoint tensors this rank does not load: the model's skips_checkpoint_tensor
    and, under pipeline parallelism, every tensor of another stage
    (pdserve/serve/layers/pipeline.py)."""
    own = getattr(model, "skips_checkpoint_tensor", lambda name: False)
    stage = getattr(model, "pipeline_stage", None)
    if stage is None or stage.is_whole:
        return own
    return lambda name: stage.skips_checkpoint_tensor(name) or own(name)


def load_model(spec: ModelSpec, tp: TPGroup, device: torch.device, backend_name: str,
               show_progress: bool = True, stage: PipelineStage | None = None) -> nn.Module:
    """Build the spec's architecture for this TP rank on `device` and load its weights;
    with a pipeline `stage`, only that stage's part."""
    model_cls = get_model_class(spec.architecture)
    with _default_dtype_and_device(spec.torch_dtype, device), building(stage):
        model = model_cls(spec.hf_config, spec.max_model_len, tp, backend_name)
    if spec.quantization is not None:
        names = []
        for path in checkpoint_files(spec.model_dir):  # headers only
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names += list(f.keys())
        packed = getattr(model, "packed_modules_mapping", {})
        num_fp8 = convert_linears(model, quantized_module_names(names, packed),
                                  spec.quantization,
                                  _skips(model))
        logger.info("FP8 weights: %d linear layers with %dx%d block scales", num_fp8,
                    *spec.quantization.block_size)
    load_weights(model, spec.model_dir, show_progress=show_progress)
    for module in model.modules():  # layouts derived from loaded weights (vLLM's hook name)
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    rehome_weights(model)  # onto huge pages, now that every layout is final
    return model.eval()


# ---- the MTP layer (speculative decoding, pdserve/serve/engine/spec_decode.py) -----------


def load_mtp_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Load model.layers.{num_hidden_layers}.* into model.mtp (built by build_mtp); its
    embed_tokens copy is skipped: the MTP module uses the main model's embedding."""
    mtp: nn.Module = model.mtp
    prefix = f"model.layers.{mtp.layer_id}."
    params = dict(mtp.named_parameters())
    packed: Mapping[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    expected_shards: dict[str, int] = {}
    for target, _ in packed.values():
        expected_shards[target] = expected_shards.get(target, 0) + 1
    loaded_shards: dict[str, set[object]] = {}
    num_found = 0
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.startswith(prefix):
                    continue
                num_found += 1
                local = name[len(prefix):]
                if local.startswith("embed_tokens."):
                    continue
                _load_one(params, packed, loaded_shards, local, _LazyCheckpointTensor(f, name))
    if num_found == 0:
        raise ValueError(f"checkpoint {str(model_dir)!r} has no multi-token-prediction layer "
                         f"({prefix}*): MTP speculative decoding needs one")
    missing = sorted(name for name in params if len(loaded_shards.get(name, ()))
                     < expected_shards.get(name.split(".")[-2], 1))
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r}'s MTP layer lacks tensors for: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    for module in mtp.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
