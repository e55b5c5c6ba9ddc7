"""Tiny random-weight checkpoints with a real, locally trained byte-level BPE tokenizer.

No weights can be downloaded on the machines pdserve is developed on, so `pdserve up` with no
`--model` serves one of these (announced as random weights), and the tests build them to
compare pdserve against Hugging Face transformers on the very same checkpoint.

The tokenizer is trained once from Python's standard-library sources (always present) and
the whole checkpoint directory (config.json, model.safetensors, tokenizer files with a chat
template) loads with `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` offline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# A ChatML template, as Qwen2 uses: readable and needs no special tokens beyond two markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_files(max_files: int = 60) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:max_files]


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1024) -> None:
    """Train a byte-level BPE tokenizer and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_random_model(
    out_dir: str | os.PathLike,
    architecture: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_dir: str | os.PathLike | None = None,
    **config_overrides: object,
) -> Path:
    """Save a seeded random LlamaForCausalLM / Qwen2ForCausalLM with a tokenizer to `out_dir`.

    `initializer_range` defaults to 0.2 so greedy decoding has clear top-1 margins (HF's 0.02
    makes logits nearly flat and two correct implementations can break ties differently).
    """
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        build_tokenizer(out)
    else:
        for name in os.listdir(tokenizer_dir):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json",
                                                        "chat_template.jinja"):
                shutil.copy(os.path.join(tokenizer_dir, name), out / name)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    config_kwargs: dict[str, object] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config_kwargs.update(config_overrides)
    if architecture == "llama":
        config, model_cls = LlamaConfig(**config_kwargs), LlamaForCausalLM
    elif architecture == "qwen2":
        config, model_cls = Qwen2Config(**config_kwargs), Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown architecture {architecture!r} (llama, qwen2)")
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    return out


# The embedded default: ~10M parameters, head_dim 64 (what vLLM's CPU attention accepts too).
DEFAULT_MODEL_CONFIG: dict[str, object] = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
DEFAULT_MODEL_NAME = "pdserve-tiny-random-llama"


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded default checkpoint, built on first use and cached."""
    from pdserve import envs

    root = Path(cache_dir or envs.cache_dir())
    target = root / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.warning(
        "building the embedded default model %s: RANDOM WEIGHTS (its output is gibberish); "
        "pass --model DIR to serve a real checkpoint", DEFAULT_MODEL_NAME,
    )
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        build_random_model(tmp, "llama", seed=0, **DEFAULT_MODEL_CONFIG)
        with open(Path(tmp) / "pdserve_default.json", "w") as f:
            json.dump({"random_weights": True, "name": DEFAULT_MODEL_NAME}, f)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        os.makedirs(tmp)  # TemporaryDirectory's cleanup expects it
    return target
