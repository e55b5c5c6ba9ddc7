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
# With tools it writes them Hermes-style, as Qwen2.5 does (so `--tool-call-parser hermes` reads
# the calls): their signatures in a system block, an assistant's calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a tool's result as a user turn in
# <tool_response> tags. A conversation without tools renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nThese functions are available, one JSON signature per line:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nTo call functions, answer with one block per call, each holding the '"
    "+ 'name and the arguments object as JSON:\n<tool_call>\n{\"name\": <name>, '"
    "+ '\"arguments\": <arguments>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined "
    "and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else (arguments | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
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


# architecture -> (transformers config class, model class)
HF_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}
# Per architecture, over the shared tiny defaults. The two DeepSeeks differ where the code
# does: no q_lora (q_proj) vs q_lora; V2 softmax group-limited routing vs V3 sigmoid routing;
# nope 32 / v 16 vs nope 16 / v 32. 8 experts in 4 groups of 2, 2 groups kept, 2 experts per
# token: the group limit really removes candidates. Layer 0 dense, the rest MoE.
_DEEPSEEK_SHARED: dict[str, object] = dict(
    num_key_value_heads=4,  # = heads: HF repeats its expanded K/V heads // kv_heads times
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    n_group=4,
    topk_group=2,
)
ARCHITECTURE_DEFAULTS: dict[str, dict[str, object]] = {
    "deepseek_v2": dict(_DEEPSEEK_SHARED, num_hidden_layers=2, q_lora_rank=None,
                        qk_nope_head_dim=32, v_head_dim=16, topk_method="group_limited_greedy",
                        routed_scaling_factor=2.0),
    # topk_method / scoring_func: what released V3 configs carry (HF hard-codes them; vLLM
    # reads them), so these checkpoints load in vLLM too.
    "deepseek_v3": dict(_DEEPSEEK_SHARED, num_hidden_layers=3, q_lora_rank=48,
                        qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5,
                        norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid"),
    # 8 experts, 2 per token. Mixtral's intermediate_size is each expert's (no dense MLP).
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # Layer 0 dense (mlp_only_layers, intermediate_size 128), layer 1 MoE with a shared expert
    # of its own width; HF's default norm_topk_prob=False (weights not renormalised).
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[0]),
}


def build_random_model(
    out_dir: str | os.PathLike,
    architecture: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_dir: str | os.PathLike | None = None,
    **config_overrides: object,
) -> Path:
    """Save a seeded random model (architecture: one of HF_CLASSES) with a tokenizer to
    `out_dir`.

    `initializer_range` defaults to 0.2 so greedy decoding has clear top-1 margins (HF's 0.02
    makes logits nearly flat and two correct implementations can break ties differently).
    DeepSeek-V3's e_score_correction_bias, which HF initialises to zeros, is drawn at random
    so that it really steers the routing.
    """
    import torch
    import transformers
    from transformers import AutoTokenizer

    if architecture not in HF_CLASSES:
        raise ValueError(f"unknown architecture {architecture!r} "
                         f"({', '.join(HF_CLASSES)})")

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
    config_kwargs.update(ARCHITECTURE_DEFAULTS.get(architecture, {}))
    config_kwargs.update(config_overrides)
    config_name, model_name = HF_CLASSES[architecture]
    config = getattr(transformers, config_name)(**config_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape) - 0.5)
    model = model.to(getattr(torch, dtype))
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


def _refresh_chat_template(model_dir: Path) -> None:
    """A default model cached by an older pdserve gets the current chat template (the
    weights and tokenizer do not change, the template learned tools)."""
    path = model_dir / "chat_template.jinja"
    if path.exists() and path.read_text() != CHAT_TEMPLATE:
        path.write_text(CHAT_TEMPLATE)


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded default checkpoint, built on first use and cached."""
    from pdserve import envs

    root = Path(cache_dir or envs.cache_dir())
    target = root / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        _refresh_chat_template(target)
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
