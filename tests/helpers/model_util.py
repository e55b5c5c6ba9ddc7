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


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              stop_at_eos: bool = False) -> list[list[int]]:
    """Hugging Face's greedy continuation of each prompt: argmax step by step, eos an ordinary
    token as under the engine's `ignore_eos` (or the end of the sequence, with `stop_at_eos`)."""
    model = load_hf(model_dir)
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            past, step_ids, generated = None, ids, []
            for _ in range(max_tokens):
                result = model(step_ids, past_key_values=past, use_cache=True)
                past = result.past_key_values
                token = int(result.logits[0, -1].argmax())
                generated.append(token)
                if token in eos_ids:
                    break
                step_ids = torch.tensor([[token]])
            out.append(generated)
    return out


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
