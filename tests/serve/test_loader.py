"""Loader, ModelSpec, rope config forms and the KV pool (TP messages: test_tp_protocol.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.kvstore.block_key import KVLayout
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.executor.kv_cache import KVCachePool, bytes_per_block, plan_kv_cache
from pdserve.serve.executor.loader import checkpoint_files, load_model_spec
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.layers.common import rope_parameters


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _last_logits(model_dir: Path, token_ids: list[int], dtype: str = "auto") -> torch.Tensor:
    with ModelRunner(ModelConfig(str(model_dir), dtype=dtype),
                     CacheConfig(block_size=16, num_blocks=8)) as runner:
        return runner.execute(StepInput([SeqChunk("a", token_ids, 0, [3, 1], True)]))[0]


def test_spec_reads_gqa_head_dim_eos_and_layout(llama_dir: Path) -> None:
    spec = load_model_spec(ModelConfig(str(llama_dir), served_model_name="tiny"))
    assert (spec.architecture, spec.model_id, spec.dtype) == ("LlamaForCausalLM", "tiny",
                                                              "float32")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.hidden_size == 64 and spec.max_model_len == 2048
    assert spec.eos_token_ids == (2,)  # <|im_end|>, from config and generation_config
    assert not spec.tie_word_embeddings
    assert spec.kv_layout(16) == KVLayout(dtype="float32", block_size=16, num_layers=2,
                                          num_kv_heads=2, head_dim=16)
    assert load_model_spec(ModelConfig(str(llama_dir))).model_id == llama_dir.name


def test_eos_ids_merge_generation_config(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_checkpoint(llama_dir, tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    spec = load_model_spec(ModelConfig(str(model_dir), max_model_len=100))
    assert spec.eos_token_ids == (2, 7) and spec.max_model_len == 100


def test_sharded_checkpoint_loads_and_matches(llama_dir: Path, tmp_path: Path, capfd) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(llama_dir)).save_pretrained(
        str(sharded), max_shard_size="40KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(sharded)) > 1
    tokens = list(range(5, 25))
    capfd.readouterr()
    sharded_logits = _last_logits(sharded, tokens)
    assert "loading weights" in capfd.readouterr().err  # progress bar over the shards
    torch.testing.assert_close(sharded_logits, _last_logits(llama_dir, tokens), atol=0, rtol=0)


@pytest.mark.parametrize(("native", "half_panels"), [(False, False), (True, False),
                                                     (True, True)])
def test_auto_dtype_of_a_bf16_checkpoint_on_cpu(make_model_dir, monkeypatch, native,
                                                half_panels) -> None:
    """auto: bf16 where the CPU computes in bf16 and the kernels cannot read bf16 panels;
    float32 (exact for the weights, faster) where it does not or they can; an explicit dtype
    always wins."""
    from pdserve.serve.executor import loader

    model_dir = make_model_dir("llama", seed=4, dtype="bfloat16")
    monkeypatch.setattr(loader, "cpu_has_native", lambda dtype: native)
    monkeypatch.setattr(loader, "cpu_reads_half_panels", lambda: half_panels)
    want = "bfloat16" if native and not half_panels else "float32"
    assert load_model_spec(ModelConfig(str(model_dir)), "cpu").dtype == want
    assert load_model_spec(ModelConfig(str(model_dir)), "cuda").dtype == "bfloat16"
    assert load_model_spec(ModelConfig(str(model_dir)), None).dtype == "bfloat16"
    assert load_model_spec(ModelConfig(str(model_dir), dtype="bfloat16"), "cpu").dtype == \
        "bfloat16"
    with ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_blocks=4)) as runner:
        assert runner.spec.dtype == want
        assert runner.kv_caches[0].dtype == getattr(torch, want)


def test_bf16_checkpoint_loads_as_bf16(make_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_model_dir("llama", seed=4, dtype="bfloat16")
    tokens = list(range(30, 50))
    with ModelRunner(ModelConfig(str(model_dir), dtype="bfloat16"),
                     CacheConfig(num_blocks=4)) as runner:
        assert runner.spec.dtype == "bfloat16"
        assert all(p.dtype == torch.bfloat16 for p in runner._rank.model.parameters())
        assert runner.kv_caches[0].dtype == torch.bfloat16
        logits = runner.execute(StepInput([SeqChunk("a", tokens, 0, [2, 0], True)]))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0, -1].float()
    # bf16 keeps ~3 significant digits; the two attention paths round differently.
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.02)
    # dtype="float32" upcasts the same checkpoint (and then matches HF in fp32 tightly);
    # float16 (11-bit mantissa) lands within ~2e-2 of that.
    assert load_model_spec(ModelConfig(str(model_dir), dtype="float32")).dtype == "float32"
    fp32 = _last_logits(model_dir, tokens, dtype="float32")
    hf32 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(fp32, hf32(torch.tensor([tokens])).logits[0, -1],
                                   atol=1e-4, rtol=0)
    torch.testing.assert_close(_last_logits(model_dir, tokens, dtype="float16"), fp32,
                               atol=0.05, rtol=0)


def test_missing_directory_and_config_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_spec(ModelConfig(str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_spec(ModelConfig(str(tmp_path)))


def test_unknown_architecture_is_rejected(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_checkpoint(llama_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model_spec(ModelConfig(str(model_dir)))
    del config["architectures"]  # falls back to model_type
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model_spec(ModelConfig(str(model_dir))).architecture == "LlamaForCausalLM"
    config["model_type"] = "gpt2"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names no architecture"):
        load_model_spec(ModelConfig(str(model_dir)))


def test_missing_weights_and_bad_lengths_are_rejected(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model_spec(ModelConfig(str(llama_dir), max_model_len=4096))
    model_dir = _copy_checkpoint(llama_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_blocks=4))

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_blocks=4))

    tensors["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(32, 63)  # wrong hidden size
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="does not fit"):
        ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_blocks=4))


def test_rope_config_forms() -> None:
    new = rope_parameters({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                               "factor": 8.0}})
    old = rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})
    plain = rope_parameters({})
    assert (new["rope_type"], new["rope_theta"], new["factor"]) == ("llama3", 5e5, 8.0)
    assert (old["rope_type"], old["rope_theta"], old["factor"]) == ("linear", 5e5, 2)
    assert (plain["rope_type"], plain["rope_theta"]) == ("default", 10000.0)


def test_kv_pool_shape_sizing_and_block_copies() -> None:
    per_block = bytes_per_block(2, 4, 2, 8, torch.float32)
    assert per_block == 2 * 2 * 4 * 2 * 8 * 4
    budget = CacheConfig(block_size=4, kv_cache_memory_bytes=10 * per_block + 1)
    assert plan_kv_cache(budget, per_block, model_max_len=64).num_blocks == 10
    assert plan_kv_cache(CacheConfig(block_size=4, num_blocks=3), per_block,
                         model_max_len=64).num_blocks == 3
    with pytest.raises(ValueError, match="smaller than one KV block"):
        plan_kv_cache(CacheConfig(block_size=4, kv_cache_memory_bytes=1), per_block,
                      model_max_len=64)

    pool = KVCachePool(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert pool.kv_caches[0].shape == (2, 6, 4, 2, 8) and pool.num_bytes == 6 * per_block
    blocks = [torch.randn(2, 2, 4, 2, 8) for _ in range(2)]
    pool.write_blocks([4, 1], blocks)
    assert torch.equal(pool.kv_caches[1][:, 4], blocks[1][:, 0])
    read = pool.read_blocks([1, 4])
    assert torch.equal(read[0][:, 0], blocks[0][:, 1]) and torch.equal(read[0][:, 1],
                                                                       blocks[0][:, 0])
    assert torch.count_nonzero(pool.kv_caches[0][:, [0, 2, 3, 5]]) == 0
    with pytest.raises(IndexError):
        pool.read_blocks([6])
    with pytest.raises(ValueError, match="blocks must be"):
        pool.write_blocks([0], blocks)


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "MixtralForCausalLM"])
def test_sliding_window_caps_max_model_len(architecture: str, llama_dir: Path,
                                           tmp_path: Path) -> None:
    model_dir = _copy_checkpoint(llama_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=[architecture], sliding_window=64)
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model_spec(ModelConfig(str(model_dir))).max_model_len == 64
    with pytest.raises(ValueError, match="sliding_window"):
        load_model_spec(ModelConfig(str(model_dir), max_model_len=100))


def test_deepseek_spec_mtp_layer_and_quantized_checkpoints(make_model_dir,
                                                           tmp_path: Path) -> None:
    """An MLA checkpoint caches one latent row per token; the V3 multi-token-prediction layer
    (model.layers.{num_hidden_layers}.*) is skipped; an FP8 (block-scaled) config is read and
    other quantized checkpoints are refused."""
    from safetensors.torch import load_file, save_file

    source = make_model_dir("deepseek_v3", seed=3)
    spec = load_model_spec(ModelConfig(str(source)))
    config = json.loads((source / "config.json").read_text())
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.kv_kind == "mla"
    assert (spec.num_kv_heads, spec.head_dim) == (
        1, config["kv_lora_rank"] + config["qk_rope_head_dim"])
    assert spec.kv_layout(16).kind == "mla"

    model_dir = _copy_checkpoint(source, tmp_path / "mtp")
    weights = load_file(str(model_dir / "model.safetensors"))
    n = config["num_hidden_layers"]
    extra = {name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): t.clone()
             for name, t in weights.items() if name.startswith(f"model.layers.{n - 1}.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file({**weights, **extra}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    tokens = list(range(5, 25))
    torch.testing.assert_close(_last_logits(model_dir, tokens), _last_logits(source, tokens),
                               atol=0, rtol=0)

    # DeepSeek's FP8 release format is read (tests/serve/test_fp8.py loads one); others are refused
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model_spec(ModelConfig(str(model_dir))).quantization.block_size == (128, 128)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="awq checkpoint"):
        load_model_spec(ModelConfig(str(model_dir)))
