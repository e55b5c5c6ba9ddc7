"""Batched sampling from one step's logits, with vLLM's meaning of every parameter.

Per row (request), in this order:

    raw logits ──► logprobs (top-n + sampled token's; raw, before any processing, as vLLM)
        │
        ├─ min_tokens: eos / stop ids get -inf until min_tokens are out
        ├─ allowed_token_ids, bad_words, logit_bias (serve/engine/logit_controls.py)
        ├─ repetition penalty (prompt + output tokens), frequency and presence (output tokens)
        ├─ greedy rows: argmax here
        ├─ temperature ─► min-p ─► top-k ─► top-p (masked tokens get -inf)
        └─ draw: argmax(probs / E) with E ~ Exponential(1), the Gumbel-max trick's sibling

Seeded rows draw E from a generator seeded by hash(seed, i), i = the index of the output
token being sampled. Nothing else feeds that generator, so the draw is reproducible
regardless of batch composition, and a decode worker that receives only (seed, i) continues
exactly where the prefill worker stopped. Unseeded rows share the engine's generator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pdserve.serve.engine.logit_controls import apply_logit_controls
from pdserve.serve.engine.request import Logprob, Request, TokenLogprobs


@dataclass
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None
    """Top-n plus the sampled token when the request asked for logprobs."""


def seed_for_token(seed: int, output_index: int) -> int:
    """The generator seed of output token `output_index` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def exponential_noise(vocab_size: int, seed: int, output_index: int) -> torch.Tensor:
    """The Exponential(1) draw of one seeded row: [vocab_size] float32."""
    generator = torch.Generator().manual_seed(seed_for_token(seed, output_index))
    return torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=generator)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]],
                    output_ids: list[list[int]], presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits [B, V]; presence, frequency, repetition [B].

    repetition: tokens seen in prompt or output: logit / r if positive else logit * r.
    frequency / presence: logit -= frequency * count_in_output + presence * (count > 0).
    """
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros(num_rows, vocab_size, dtype=logits.dtype)
    rows, ids = _flatten(output_ids)
    output_counts.index_put_((rows, ids), torch.ones(len(ids), dtype=logits.dtype),
                             accumulate=True)
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    seen[_flatten(prompt_ids)] = True
    seen |= output_counts > 0
    r = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def _flatten(rows_of_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of a ragged list of id lists, as two [N] long tensors."""
    lengths = torch.tensor([len(ids) for ids in rows_of_ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(rows_of_ids)), lengths)
    ids = torch.tensor([t for ids in rows_of_ids for t in ids], dtype=torch.long)
    return rows, ids


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with prob < min_p * max prob. logits [B, V], min_p [B]."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= the k-th largest of the row (ties at the k-th are kept); 0 keeps all."""
    k = top_k.long()
    max_k = int(k.max().clamp(min=1, max=logits.shape[-1]))
    top_values = logits.topk(max_k, dim=-1).values  # [B, max_k], descending
    kth = top_values.gather(1, (k.clamp(1, max_k) - 1).unsqueeze(1))
    kth = torch.where(k.unsqueeze(1) > 0, kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-likely set with probability mass >= top_p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly before each token; a token is dropped once that alone reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """logits [len(requests), vocab] float32 (CPU): one row per request to sample."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        params = [r.sampling_params for r in requests]
        banned = self._banned_stops(requests)
        controls = any(p.has_logit_controls for p in params)
        if banned or controls:  # both write in place: the caller's logits stay as they were
            logits = logits.clone()
        for row, token_ids in banned:
            logits[row, token_ids] = float("-inf")
        if controls:
            logits = apply_logit_controls(logits, requests)
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits, [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                torch.tensor([p.presence_penalty for p in params]),
                torch.tensor([p.frequency_penalty for p in params]),
                torch.tensor([p.repetition_penalty for p in params]))
        token_ids = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            token_ids[sampled_rows] = self._draw(logits[sampled_rows],
                                                 [requests[i] for i in sampled_rows])
        results = []
        for row, (request, token_id) in enumerate(zip(requests, token_ids.tolist(),
                                                      strict=True)):
            num_logprobs = request.sampling_params.logprobs
            token_logprobs = None
            if num_logprobs is not None and raw_logprobs is not None:
                token_logprobs = _logprobs_of(raw_logprobs[row], token_id, num_logprobs)
            results.append(SampleResult(token_id, token_logprobs))
        return results

    @staticmethod
    def _banned_stops(requests: list[Request]) -> list[tuple[int, list[int]]]:
        """(row, token ids) that min_tokens holds back: eos and stop ids until then."""
        banned = []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens >= params.min_tokens or request.grammar is not None:
                continue  # a grammar holds its own end tokens back (serve/engine/structured.py)
            token_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                token_ids += list(request.eos_token_ids)
            if token_ids:
                banned.append((row, token_ids))
        return banned

    def sampling_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, min-p, top-k, top-p, then
        softmax. [rows, V] -> [rows, V]. Speculative decoding verifies against it
        (serve/engine/spec_decode.py) for requests whose stop, logit-control and penalty steps do
        nothing."""
        params = [r.sampling_params for r in requests]
        logits = logits.float() / torch.tensor([p.temperature for p in params]).unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params]))
        if any(p.top_k > 0 for p in params):
            logits = apply_top_k(logits, torch.tensor([p.top_k for p in params]))
        if any(p.top_p < 1.0 for p in params):
            logits = apply_top_p(logits, torch.tensor([p.top_p for p in params]))
        return torch.softmax(logits, dim=-1)

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = self.sampling_probs(logits, requests)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None:
                noise[row] = exponential_noise(probs.shape[1], seed, request.num_output_tokens)
        return (probs / noise).argmax(dim=-1)


def _logprobs_of(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """{token: Logprob} for the top num_top tokens and the sampled one (rank 1 = best)."""
    chosen = float(row_logprobs[token_id])
    result: TokenLogprobs = {
        token_id: Logprob(chosen, int((row_logprobs > chosen).sum()) + 1)}
    if num_top > 0:
        values, indices = row_logprobs.topk(num_top)
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist(), strict=True),
                                              1):
            result.setdefault(index, Logprob(value, rank))
    return result
