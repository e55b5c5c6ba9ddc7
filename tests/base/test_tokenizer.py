"""The tokenizer loader (pdserve/tokenizer.py): the object AutoTokenizer builds, without torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.tokenizer import is_plain, load_tokenizer

TEXTS = ["hello world", "  two  spaces\tand a tab\n", "ünïcödé ✓ 漢字 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x . y , z"]


def test_a_plain_tokenizer_is_what_autotokenizer_builds(llama_dir):
    ours, reference = load_tokenizer(llama_dir), AutoTokenizer.from_pretrained(str(llama_dir))
    assert is_plain(llama_dir)
    assert type(ours) is type(reference)
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == \
        (reference.eos_token_id, reference.pad_token_id, reference.bos_token_id)
    assert ours.clean_up_tokenization_spaces == reference.clean_up_tokenization_spaces
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special).input_ids
            assert ids == reference(text, add_special_tokens=special).input_ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    reference.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[2]}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_other_tokenizers_go_through_autotokenizer(llama_dir, tmp_path, monkeypatch):
    named = tmp_path / "named"
    shutil.copytree(llama_dir, named)
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"  # a model's own class: AutoTokenizer's job
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    unnamed = tmp_path / "unnamed"
    shutil.copytree(llama_dir, unnamed)
    del config["tokenizer_class"]
    (unnamed / "tokenizer_config.json").write_text(json.dumps(config))
    no_json = tmp_path / "no-json"
    shutil.copytree(llama_dir, no_json)
    (no_json / "tokenizer.json").unlink()
    assert not any(is_plain(d) for d in (named, unnamed, no_json, tmp_path / "missing"))

    asked = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda path, *a, **k: asked.append(Path(path)) or "auto")
    assert load_tokenizer(named) == "auto" and asked == [named]


def test_a_missing_tokenizer_is_an_error_the_roles_report(tmp_path):
    with pytest.raises((OSError, ValueError)):  # what a worker's and the router's start catch
        load_tokenizer(tmp_path)


def test_the_router_starts_without_torch(llama_dir):
    """The router builds its app (tokenizer, chat template, routes) without importing torch or
    transformers' model registry: seconds of CPU at every restart (a fleet under load pays
    them several times over)."""
    code = (
        "import sys\n"
        "from pdserve.router.app import build_app\n"
        "from pdserve.router.config import RouterConfig\n"
        f"build_app(RouterConfig(model={str(llama_dir)!r}, prefill_addrs=('tcp://127.0.0.1:1',),"
        " decode_addrs=('tcp://127.0.0.1:2',)))\n"
        "print(sorted(m for m in ('torch', 'transformers.models.auto.modeling_auto')"
        " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PDSERVE_INSECURE_PLAINTEXT="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
