"""Architecture registry: config.json's `architectures[0]` -> model class, imported lazily.

Adding a model means one file here and one line in ARCHITECTURES; nothing imports a model
module until a checkpoint of that architecture is loaded.
"""

from __future__ import annotations

import importlib

# architecture name -> (module under pdserve.serve.models, class name)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("llama_moe", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("llama_moe", "Qwen2MoeForCausalLM"),
}


def is_supported(architecture: str) -> bool:
    return architecture in ARCHITECTURES


def get_model_class(architecture: str) -> type:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; pdserve serves "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    module_name, class_name = ARCHITECTURES[architecture]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)
