"""The runner's logits against Hugging Face transformers on the same tiny seeded checkpoints.

Tolerance 1e-4 (fp32): both sides compute the same float32 math in a different order
(paged gather + SDPA vs HF's eager attention), which moves logits by ~1e-6 here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.model_util import BlockAllocator, hf_logits, load_hf, random_prompts

from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.default_model import build_random_model
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.layers.parallel import unpack

ATOL = 1e-4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def hf_models():
    cache: dict[Path, torch.nn.Module] = {}

    def get(model_dir: Path) -> torch.nn.Module:
        if model_dir not in cache:
            cache[model_dir] = load_hf(model_dir)
        return cache[model_dir]

    return get


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, llama_dir: Path, qwen2_dir: Path) -> Path:
    return llama_dir if request.param == "llama" else qwen2_dir


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_prefill_then_batched_decode(model_dir: Path, block_size: int,
                                                 hf_models) -> None:
    hf = hf_models(model_dir)
    num_decodes = 3
    lengths = [5, 17, 40]
    with ModelRunner(ModelConfig(str(model_dir)),
                     CacheConfig(block_size=block_size, num_blocks=NUM_BLOCKS)) as runner:
        full = random_prompts([n + num_decodes for n in lengths], runner.spec.vocab_size)
        alloc = BlockAllocator(NUM_BLOCKS)
        tables = [alloc.table(len(seq), block_size) for seq in full]
        expected = [hf_logits(hf, seq) for seq in full]

        # One step: three prompts of mixed lengths, flattened into one forward.
        step = StepInput([SeqChunk(f"r{i}", seq[:n], 0, tables[i], True)
                          for i, (seq, n) in enumerate(zip(full, lengths, strict=True))])
        logits = runner.execute(step)
        assert logits.shape == (3, runner.spec.vocab_size) and logits.dtype == torch.float32
        for i, n in enumerate(lengths):
            torch.testing.assert_close(logits[i], expected[i][n - 1], atol=ATOL, rtol=0)

        # Then decode steps: one token per sequence (the decode kernel path).
        for d in range(num_decodes):
            step = StepInput([SeqChunk(f"r{i}", [seq[n + d]], n + d, tables[i], True)
                              for i, (seq, n) in enumerate(zip(full, lengths, strict=True))])
            logits = runner.execute(step)
            for i, n in enumerate(lengths):
                torch.testing.assert_close(logits[i], expected[i][n + d], atol=ATOL, rtol=0)
                assert logits[i].argmax() == expected[i][n + d].argmax()


def test_prompt_chunked_over_two_steps_with_decode_rows(llama_dir: Path, hf_models) -> None:
    """Chunk 1 samples nothing; chunk 2 attends to chunk 1's KV through a scattered table,
    sharing its step with another request's decode row."""
    block_size = 8
    hf = hf_models(llama_dir)
    with ModelRunner(ModelConfig(str(llama_dir)),
                     CacheConfig(block_size=block_size, num_blocks=NUM_BLOCKS)) as runner:
        prompt, other = random_prompts([29, 12], runner.spec.vocab_size, seed=3)
        table = [41, 3, 17, 8]  # 29 tokens -> 4 blocks, deliberately out of order
        other_table = [5, 60]
        assert runner.execute(StepInput([
            SeqChunk("a", prompt[:11], 0, table, False),  # ends mid-block
            SeqChunk("b", other[:11], 0, other_table, True),
        ])).shape == (1, runner.spec.vocab_size)
        logits = runner.execute(StepInput([
            SeqChunk("b", other[11:12], 11, other_table, True),
            SeqChunk("a", prompt[11:], 11, table, True),
        ]))
        torch.testing.assert_close(logits[0], hf_logits(hf, other)[11], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], hf_logits(hf, prompt)[28], atol=ATOL, rtol=0)


def test_step_without_sampling_returns_no_rows(llama_dir: Path) -> None:
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(num_blocks=8)) as runner:
        empty = runner.execute(StepInput([]))
        assert empty.shape == (0, runner.spec.vocab_size)
        out = runner.execute(StepInput([SeqChunk("a", [1, 2, 3], 0, [0], False)]))
        assert out.shape == (0, runner.spec.vocab_size)


def test_step_validation_rejects_bad_ids(llama_dir: Path) -> None:
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(num_blocks=4)) as runner:
        vocab = runner.spec.vocab_size
        with pytest.raises(ValueError, match="vocabulary"):
            runner.execute(StepInput([SeqChunk("a", [vocab], 0, [0], True)]))
        with pytest.raises(ValueError, match="block id"):
            runner.execute(StepInput([SeqChunk("a", [1], 0, [4], True)]))
        with pytest.raises(ValueError, match="block_table"):
            runner.execute(StepInput([SeqChunk("a", [1] * 17, 0, [0], True)]))
    with pytest.raises(RuntimeError, match="shut down"):
        runner.execute(StepInput([]))


@pytest.mark.parametrize("prepack", ["0", "1"])
def test_tied_embeddings_load_once(qwen2_dir: Path, prepack: str, monkeypatch) -> None:
    """A tied head reads the embedding's rows: the same tensor, and with CPU prepacking a
    packed copy of exactly those rows (pdserve's panels on AVX-512, oneDNN's layout elsewhere)."""
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", prepack)
    with ModelRunner(ModelConfig(str(qwen2_dir)), CacheConfig(num_blocks=4)) as runner:
        model = runner._rank.model
        assert runner.spec.tie_word_embeddings
        head, embedding = model.lm_head, model.model.embed_tokens.weight
        assert head.weight is embedding
        if prepack == "0":
            assert head.packed is None
        else:
            assert torch.equal(unpack(head.packed, embedding.shape), embedding)


def test_llama3_rope_scaling_matches_hf(tmp_path: Path, tokenizer_dir: Path, hf_models) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    model_dir = build_random_model(tmp_path / "llama3", "llama", seed=2,
                                   tokenizer_dir=tokenizer_dir, rope_parameters=rope)
    hf = hf_models(model_dir)
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    with ModelRunner(ModelConfig(str(model_dir)),
                     CacheConfig(block_size=16, num_blocks=NUM_BLOCKS)) as runner:
        (prompt,) = random_prompts([70], runner.spec.vocab_size, seed=5)
        logits = runner.execute(StepInput([SeqChunk("a", prompt, 0, [9, 1, 30, 4, 2], True)]))
        torch.testing.assert_close(logits[0], hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_matches_hf(llama_dir: Path, hf_models) -> None:
    """The CUDA path (Triton kernels by default). Tolerance 2e-2: tl.dot may use TF32 for
    fp32 inputs (10-bit mantissa), which moves these logits by up to ~1e-2."""
    from pdserve.serve.config import ParallelConfig

    hf = hf_models(llama_dir)
    with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=16, num_blocks=16),
                     ParallelConfig(device="cuda")) as runner:
        assert runner.kv_caches[0].is_cuda
        full = random_prompts([37], runner.spec.vocab_size, seed=9)[0]
        logits = runner.execute(StepInput([SeqChunk("a", full[:36], 0, [4, 0, 7], True)]))
        torch.testing.assert_close(logits[0], hf_logits(hf, full)[35], atol=2e-2, rtol=0)
        logits = runner.execute(StepInput([SeqChunk("a", full[36:], 36, [4, 0, 7], True)]))
        torch.testing.assert_close(logits[0], hf_logits(hf, full)[36], atol=2e-2, rtol=0)


@pytest.mark.parametrize("overrides", [
    {"attention_bias": True, "mlp_bias": True},  # Llama's optional biases (O and MLP too)
    {"head_dim": 32},  # head_dim from config, not hidden_size / num_heads
    {"num_key_value_heads": 4},  # plain multi-head attention
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}},
], ids=["bias", "head_dim", "mha", "linear_rope"])
def test_llama_config_variants_match_hf(overrides: dict, tmp_path: Path, tokenizer_dir: Path,
                                        hf_models) -> None:
    model_dir = build_random_model(tmp_path / "m", "llama", seed=6, tokenizer_dir=tokenizer_dir,
                                   **overrides)
    hf = hf_models(model_dir)
    with ModelRunner(ModelConfig(str(model_dir)),
                     CacheConfig(block_size=8, num_blocks=NUM_BLOCKS)) as runner:
        prompts = random_prompts([9, 20], runner.spec.vocab_size, seed=8)
        logits = runner.execute(StepInput([SeqChunk("a", prompts[0], 0, [3, 11], True),
                                           SeqChunk("b", prompts[1], 0, [0, 7, 2], True)]))
        for row, prompt in zip(logits, prompts, strict=True):
            torch.testing.assert_close(row, hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_attention_metadata_of_a_mixed_step() -> None:
    """The docstring's example in pdserve/serve/layers/attention.py, value by value (block_size
    4)."""
    from pdserve.serve.layers.attention import build_attention_metadata

    step = StepInput([SeqChunk("A", [7] * 5, 0, [3, 8], True),
                      SeqChunk("B", [9], 9, [1, 0, 6], True)])
    meta = build_attention_metadata(step, 4, torch.device("cpu"))
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 9]
    # A: pos 0-3 in block 3 (slots 12-15), pos 4 in block 8 (slot 32); B: pos 9 -> block 6.
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 32, 25]
    assert meta.cu_seqlens_q.tolist() == [0, 5, 6] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 10] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 8, 0], [1, 0, 6]]
    assert meta.max_query_len == 5 and not meta.is_decode_only
    decode = build_attention_metadata(StepInput([SeqChunk("B", [9], 9, [1, 0, 6], True)]), 4,
                                      torch.device("cpu"))
    assert decode.is_decode_only and decode.slot_mapping.tolist() == [25]
    # a decode step of three (its own shorter path): the same tensors, dtypes included
    three = build_attention_metadata(StepInput([
        SeqChunk("B", [9], 9, [1, 0, 6], True), SeqChunk("C", [2], 0, [5], True),
        SeqChunk("D", [4], 4, [7, 2], True)]), 4, torch.device("cpu"))
    expected = {"positions": ([9, 0, 4], torch.int64), "slot_mapping": ([25, 20, 8], torch.int64),
                "cu_seqlens_q": ([0, 1, 2, 3], torch.int32),
                "seq_lens": ([10, 1, 5], torch.int32),
                "block_tables": ([[1, 0, 6], [5, 0, 0], [7, 2, 0]], torch.int32)}
    for name, (values, dtype) in expected.items():
        tensor = getattr(three, name)
        assert (tensor.tolist(), tensor.dtype) == (values, dtype), name
    assert three.is_decode_only and three.max_query_len == 1
    assert three.token_seq_lens is None and three.token_block_tables is None
