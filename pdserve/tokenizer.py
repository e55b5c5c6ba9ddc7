"""The served model's tokenizer, loaded without importing what serving does not use.

`AutoTokenizer` imports transformers' model registry, and with it torch and torch._dynamo:
about 2 s of CPU at every start of a router (which uses no torch at all) and 1.5 s of a
worker's, which a restart under load pays several times over. A checkpoint whose tokenizer
is transformers' plain fast tokenizer (a tokenizer.json, and `tokenizer_class`
TokenizersBackend or PreTrainedTokenizerFast in tokenizer_config.json) is loaded by that class
directly: the object AutoTokenizer would build, from one module and without torch. Any other
checkpoint (a model's own tokenizer class, none named, a SentencePiece model only) goes
through AutoTokenizer as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_class values whose tokenizer is TokenizersBackend itself (transformers 5 maps
PreTrainedTokenizerFast to it), with nothing of a model's own on top."""


def tokenizer_class(model_dir: Path) -> str | None:
    """The `tokenizer_class` tokenizer_config.json names, or None (no file, unreadable, none)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def is_plain(model_dir: str | Path) -> bool:
    """Whether `model_dir`'s tokenizer loads without AutoTokenizer (see the module docstring)."""
    model_dir = Path(model_dir)
    return (model_dir / "tokenizer.json").is_file() and tokenizer_class(model_dir) in PLAIN_CLASSES


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a local checkpoint directory, as AutoTokenizer.from_pretrained gives it.
    Raises OSError (or ValueError) for a directory with no usable tokenizer."""
    if is_plain(model_dir):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def import_backend(model_dir: str | Path) -> None:
    """Import what load_tokenizer(model_dir) will use, without loading anything (a process
    started ahead of need, pdserve/app/standby.py)."""
    if is_plain(model_dir):
        import transformers.tokenization_utils_tokenizers  # noqa: F401
    else:
        import transformers  # noqa: F401
