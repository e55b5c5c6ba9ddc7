"""The engine gives the same greedy tokens with the Triton attention backend as with torch.

On CPU the Triton kernels run in the interpreter (get_attention_backend sets
TRITON_INTERPRET=1 before defining them), so the models and the run are tiny: the conftest
Llama (4 query heads, 2 KV heads, head_dim 16) and a DeepSeek-V2 (MLA: the latent cache,
absorbed prefill through the prefill kernel against torch's expanded form, the MLA decode
kernel), two short prompts that share a prefix (the second request reuses cached blocks:
prefill over a cached prefix plus new tokens), 8 tokens.
Every call is counted, so the test fails if the Triton path was not the one that ran. With a
GPU the same comparison runs on CUDA with compiled kernels (fp32 model: exact products).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

import pdserve.kernels
from pdserve.serve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def counting_backends(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Wrap get_attention_backend so every backend call is tallied as 'backend.operation'."""
    calls: Counter = Counter()
    original = pdserve.kernels.get_attention_backend

    def counted(name: str) -> pdserve.kernels.AttentionBackend:
        backend = original(name)

        def wrap(op: str):
            fn = getattr(backend, op)

            def call(*args, **kwargs):
                calls[f"{name}.{op}"] += 1
                return fn(*args, **kwargs)

            return call

        ops = [f.name for f in dataclasses.fields(backend) if f.name != "name"]
        return dataclasses.replace(backend, **{op: wrap(op) for op in ops})

    monkeypatch.setattr(pdserve.kernels, "get_attention_backend", counted)
    return calls


def greedy_tokens(model_dir: Path, prompts: list[list[int]], device: str) -> list[list[int]]:
    with LLM(model_dir, block_size=16, num_kv_blocks=32, max_num_seqs=4, device=device) as llm:
        first = llm.generate(prompts[:1], GREEDY)  # leaves its full blocks in the prefix cache
        rest = llm.generate(prompts[1:], GREEDY)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        llm.engine.block_manager.check_integrity()
    return [out.outputs[0].token_ids for out in first + rest]


@pytest.mark.parametrize("device", [
    # With CUDA present the kernels are compiled, not interpreted, and need CUDA tensors.
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                 reason="interpreter runs only without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])
@pytest.mark.parametrize("architecture", ["llama", "deepseek_v2"])
def test_triton_backend_gives_torch_backend_tokens(make_model_dir, architecture: str,
                                                   device: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_model_dir(architecture) if architecture == "llama" else make_model_dir(
        architecture, seed=3)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(5, 200, (37,), generator=gen).tolist()
    prompts = [shared, shared + torch.randint(5, 200, (6,), generator=gen).tolist(),
               torch.randint(5, 200, (3,), generator=gen).tolist()]
    calls = counting_backends(monkeypatch)

    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
    expected = greedy_tokens(model_dir, prompts, device)
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    actual = greedy_tokens(model_dir, prompts, device)

    assert actual == expected
    assert all(len(tokens) > 0 for tokens in actual)
    ops = (("write_kv_cache", "prefill_attention", "decode_attention") if architecture == "llama"
           else ("write_latent_cache", "mla_prefill_attention", "mla_decode_attention"))
    for op in ops:
        assert calls[f"triton.{op}"] > 0 and calls[f"torch.{op}"] > 0, calls
