"""LLM objects one after another in one process: shutting one down, leaving its `with` block,
or dropping its last reference releases its TP ranks and the process group, so the next
LLM(tensor_parallel_size=2) starts; every one's greedy tokens equal a TP=1 run's."""

from __future__ import annotations

import gc
import multiprocessing
from pathlib import Path

import pytest
import torch.distributed as dist

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.llm import LLM

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 45))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _make(model_dir: Path, tp: int) -> LLM:
    return LLM(model_dir, tensor_parallel_size=tp, num_kv_blocks=32, device="cpu")


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def _assert_released() -> None:
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


def test_tp2_llms_one_after_another(llama_dir: Path) -> None:
    with _make(llama_dir, 1) as llm:
        expected = _tokens(llm)
    _assert_released()

    first = _make(llama_dir, 2)  # closed explicitly, twice
    assert _tokens(first) == expected
    first.shutdown()
    first.close()  # idempotent
    _assert_released()
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate(PROMPTS, GREEDY)

    with _make(llama_dir, 2) as second:  # closed by its `with` block
        assert _tokens(second) == expected
    _assert_released()

    third = _make(llama_dir, 2)  # released by dropping the last reference
    assert _tokens(third) == expected
    del third
    gc.collect()
    _assert_released()

    with _make(llama_dir, 2) as fourth:
        assert _tokens(fourth) == expected
        # while one is open, a second TP group cannot start in this process: a clear error
        with pytest.raises(RuntimeError, match="already has a torch.distributed process"):
            _make(llama_dir, 2)
    _assert_released()
