"""Step sequences shared by the model-fidelity tests of every architecture: each runs a
ModelRunner through real engine-shaped steps and checks every sampled row against Hugging
Face's logits for the same tokens (ATOL 1e-4, fp32: only the order of float32 sums differs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from helpers.model_util import BlockAllocator, hf_logits, random_prompts
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.executor.model_runner import ModelRunner

ATOL = 1e-4
NUM_BLOCKS = 32


def runner_for(model_dir: Path, block_size: int, tp: int = 1,
               expert_parallel: bool = False) -> ModelRunner:
    return ModelRunner(ModelConfig(str(model_dir)),
                       CacheConfig(block_size=block_size, num_blocks=NUM_BLOCKS),
                       ParallelConfig(tensor_parallel_size=tp, device="cpu",
                                      enable_expert_parallel=expert_parallel))


def randomise_biases(model_dir: Path, seed: int) -> None:
    """HF initialises every bias to zero, which would hide a bias added on the wrong ranks."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=gen) * 0.2
    save_file(tensors, str(path), metadata={"format": "pt"})


def assert_rows_match(logits: torch.Tensor, expected: list[torch.Tensor]) -> None:
    assert logits.shape[0] == len(expected)
    for row, want in zip(logits, expected, strict=True):
        torch.testing.assert_close(row, want, atol=ATOL, rtol=0)


def ragged_chunked_then_decodes(runner: ModelRunner, hf: torch.nn.Module, block_size: int,
                                num_decodes: int,
                                layer_done: Callable[[int], None] | None = None) -> None:
    """Step 1: a ragged prefill (5 and 17 tokens) plus the first 23 tokens of a 40-token
    prompt (no sample). Step 2: that prompt's other 17 tokens (over its cached prefix) beside
    two decode rows. Then num_decodes decode-only steps. Block tables are shuffled over the
    pool. layer_done goes to step 1."""
    lengths, chunk = [5, 17, 40], 23
    full = random_prompts([n + num_decodes + 1 for n in lengths], runner.spec.vocab_size)
    alloc = BlockAllocator(NUM_BLOCKS)
    tables = [alloc.table(len(seq), block_size) for seq in full]
    expected = [hf_logits(hf, seq) for seq in full]
    a, b, c = range(3)
    logits = runner.execute(StepInput([
        SeqChunk("a", full[a][:5], 0, tables[a], True),
        SeqChunk("b", full[b][:17], 0, tables[b], True),
        SeqChunk("c", full[c][:chunk], 0, tables[c], False),
    ]), layer_done=layer_done)
    assert_rows_match(logits, [expected[a][4], expected[b][16]])
    logits = runner.execute(StepInput([
        SeqChunk("a", full[a][5:6], 5, tables[a], True),
        SeqChunk("c", full[c][chunk:40], chunk, tables[c], True),
        SeqChunk("b", full[b][17:18], 17, tables[b], True),
    ]))
    assert_rows_match(logits, [expected[a][5], expected[c][39], expected[b][17]])
    computed = [6, 18, 40]
    for d in range(num_decodes):
        logits = runner.execute(StepInput([
            SeqChunk(name, [full[s][n + d]], n + d, tables[s], True)
            for name, s, n in zip("abc", (a, b, c), computed, strict=True)
        ]))
        assert_rows_match(logits, [expected[s][n + d]
                                   for s, n in zip((a, b, c), computed, strict=True)])


def two_prompts_in_two_chunks(runner: ModelRunner, hf: torch.nn.Module) -> None:
    """Two prompts (31 and 10 tokens) prefilled in two steps each, the second over the first's
    KV, with block size 8 and scattered tables."""
    prompts = random_prompts([31, 10], runner.spec.vocab_size, seed=2)
    tables = [[7, 1, 12, 4], [3, 9]]
    expected = [hf_logits(hf, p) for p in prompts]
    logits = runner.execute(StepInput([SeqChunk("a", prompts[0][:30], 0, tables[0], True),
                                       SeqChunk("b", prompts[1][:9], 0, tables[1], True)]))
    assert_rows_match(logits, [expected[0][29], expected[1][8]])
    logits = runner.execute(StepInput([SeqChunk("a", prompts[0][30:], 30, tables[0], True),
                                       SeqChunk("b", prompts[1][9:], 9, tables[1], True)]))
    assert_rows_match(logits, [expected[0][30], expected[1][9]])


def prefill_then_decodes(runner: ModelRunner, hf: torch.nn.Module, seed: int) -> None:
    """A ragged prefill of two prompts (13 tokens cut at 11, and 5 of 6), then single-token
    decodes of the first: at TP=2 with expert parallelism one rank's token share is empty."""
    prompts = random_prompts([13, 6], runner.spec.vocab_size, seed=seed)
    tables = [[5, 2], [9]]
    expected = [hf_logits(hf, p) for p in prompts]
    logits = runner.execute(StepInput([SeqChunk("a", prompts[0][:11], 0, tables[0], True),
                                       SeqChunk("b", prompts[1][:5], 0, tables[1], True)]))
    assert_rows_match(logits, [expected[0][10], expected[1][4]])
    for pos in (11, 12):
        logits = runner.execute(StepInput([SeqChunk("a", prompts[0][pos:pos + 1], pos,
                                                    tables[0], True)]))
        assert_rows_match(logits, [expected[0][pos]])
