"""Helpers shared by the model-fidelity tests: Hugging Face as the reference model, random
prompts, and scattered block tables."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def load_hf(model_dir: Path) -> torch.nn.Module:
    """The Hugging Face model of a checkpoint, in fp32 and eval mode: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] logits for every position of one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


class BlockAllocator:
    """Hands out shuffled (non-contiguous) block ids, as a long-running block manager would."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int, block_size: int) -> list[int]:
        count = -(-num_tokens // block_size)
        table, self.free = self.free[:count], self.free[count:]
        return table


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """One seeded prompt of uniformly random token ids per entry of `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
