"""Huge pages for what a decode step streams: the CPU KV pool asks for them before it first
touches its memory (and is zeroed); the loader moves the large weights onto them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.model_util import load_hf, random_prompts
from torch import nn

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve import LLM
from pdserve.serve.cpu.huge_pages import (
    ALIGN_BYTES,
    HUGE_PAGE_BYTES,
    MIN_REHOME_BYTES,
    advise_huge_pages,
    huge_page_buffer,
    rehome_weights,
)
from pdserve.serve.executor import loader
from pdserve.serve.executor.kv_cache import KVCachePool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold the tensor (/proc/self/smaps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_pool_is_zeroed_and_small_tensors_are_left_alone() -> None:
    pool = KVCachePool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, device=torch.device("cpu"))
    assert all(int(t.count_nonzero()) == 0 for t in pool.kv_caches)
    assert advise_huge_pages(torch.empty(16)) is False  # under one huge page


NEEDS_THP = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
    reason="needs Linux with transparent huge pages not switched off")


def _skip_unless_host_grants(like: torch.Tensor) -> None:
    """Under memory pressure (a busy CI host) the kernel may have no free 2 MiB page to give
    at that moment: then a fresh mapping advised by hand gets none either, and the code under
    test is not at fault."""
    control = huge_page_buffer(like.numel() * like.element_size())
    assert control is not None
    control.zero_()
    if _huge_kib(control) == 0:
        pytest.skip("the host granted no huge page just now (memory pressure)")


@NEEDS_THP
def test_large_pool_gets_huge_pages_even_where_malloc_recycles_memory() -> None:
    # Large blocks freed first: glibc then serves the next few MiB from memory already touched
    # on small pages, where advice comes too late. The pool maps its own.
    for _ in range(3):
        freed = [torch.ones(30 << 18), torch.ones(30 << 18), torch.ones(9 << 18)]  # MiB each
        del freed
    # 4 huge pages per layer; the pool's layers are each a tensor of their own
    pool = KVCachePool(num_layers=1, num_blocks=256, block_size=16, num_kv_heads=4,
                       head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    (cache,) = pool.kv_caches
    assert cache.numel() * 4 >= 4 * HUGE_PAGE_BYTES
    assert int(cache.count_nonzero()) == 0
    if _huge_kib(cache) == 0:
        _skip_unless_host_grants(cache)  # where the host gives the control one, so must the pool
    assert _huge_kib(cache) >= HUGE_PAGE_BYTES // 1024


class _Weights(nn.Module):
    """A head tied to an embedding, a large linear with a packed copy, a small norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 384)  # 1.5 MiB
        self.head = nn.Linear(384, 1024, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Linear(1024, 768)  # 3 MiB weight (1.5 packed in bf16), 3 KiB bias
        self.proj.packed = self.proj.weight.detach().t().contiguous().to(torch.bfloat16)
        self.norm = nn.LayerNorm(384)


@NEEDS_THP
def test_rehome_moves_large_weights_onto_huge_pages_values_and_ties_kept() -> None:
    torch.manual_seed(0)
    model = _Weights()
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    packed = model.proj.packed.clone()
    small = {id(t): t.data_ptr() for t in (model.proj.bias, model.norm.weight)}
    moved = rehome_weights(model)
    if moved == 0:
        _skip_unless_host_grants(torch.empty(4 * HUGE_PAGE_BYTES // 4))
        pytest.fail("the host grants huge pages but no weight was moved")
    large = [model.embed.weight, model.proj.weight, model.proj.packed]
    assert moved == sum(-(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES
                        for t in large)
    assert all(t.numel() * t.element_size() >= MIN_REHOME_BYTES for t in large)
    assert model.head.weight is model.embed.weight  # still one tied parameter
    assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in large)
    starts = sorted(t.data_ptr() for t in large)
    assert starts[-1] - starts[0] < moved  # one buffer, back to back
    assert {id(t): t.data_ptr() for t in (model.proj.bias, model.norm.weight)} == small
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert model.proj.packed.dtype == torch.bfloat16 and torch.equal(model.proj.packed, packed)
    if _huge_kib(model.proj.weight) == 0:
        _skip_unless_host_grants(model.proj.weight)
    assert _huge_kib(model.proj.weight) >= HUGE_PAGE_BYTES // 1024


def test_loaded_weights_on_huge_pages_give_hf_greedy_tokens(make_model_dir, monkeypatch
                                                              ) -> None:
    """A Qwen2 with a tied head and MLP weights over 1 MiB (moved by the loader): the same
    greedy tokens as Hugging Face, and as the same model left where it was loaded."""
    model_dir = make_model_dir("qwen2", seed=3, tie_word_embeddings=True, hidden_size=256,
                               intermediate_size=1024, num_hidden_layers=2)
    prompts = random_prompts([9, 23], 256, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    moved: list[int] = []
    rehome = loader.rehome_weights
    monkeypatch.setattr(loader, "rehome_weights", lambda m: moved.append(rehome(m)) or moved[-1])
    with LLM(str(model_dir), num_kv_blocks=64, block_size=16) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(loader, "rehome_weights", lambda m: 0)
    with LLM(str(model_dir), num_kv_blocks=64, block_size=16) as llm:
        unmoved = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hf = load_hf(model_dir)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                do_sample=False, max_new_tokens=8, pad_token_id=0
                                )[0, len(p):].tolist() for p in prompts]
    assert tokens == unmoved == expected
    if _thp_mode() not in (None, "never") and sys.platform.startswith("linux"):
        assert moved and moved[0] >= 3 * 2 * (1 << 20)  # gate_up and down, each layer
