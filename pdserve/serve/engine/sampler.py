"""Batched sampling from one step's logits, with vLLM's meaning of every parameter.

Per row (request), in this order:

    raw logits ──► logprobs (top-n + sampled token's; raw, before any processing, as vLLM)
        │
        ├─ min_tokens: eos / stop ids get -inf until min_tokens are out
        ├─ allowed_token_ids, bad_words, logit_bias (pdserve/serve/engine/logit_controls.py)
        ├─ repetition penalty (prompt + output tokens), frequency and presence (output tokens)
        ├─ greedy rows: argmax here
        ├─ temperature ─► min-p ─► top-k ─► top-p (masked tokens get -inf)
        └─ draw: argmax(probs / E) with E ~ Exponential(1), the Gumbel-max trick's sibling

Seeded rows draw E from a generator seeded by hash(seed, i), i = the index of the output
token being sampled. Nothing else feeds that generator, so the draw is reproducible
regardless of batch composition, and a decode worker that receives only (seed, i) continues
exactly where the prefill worker stopped. Unseeded rows share the engine's generator.

Everything runs on the logits' device as batched tensor ops: the per-request parameters go
down as small tensors, and only the sampled ids (one per row) and the logprobs a request asked
for come back to the host, in one transfer each. A seeded row's noise is drawn on the host (the
same draw on every device, so a seeded request gives the same tokens on CPU and GPU) and copied
down without waiting for it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pdserve.serve.engine.logit_controls import apply_logit_controls, ragged_index
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
    """The Exponential(1) draw of one seeded row: [vocab_size] float32, on the host."""
    generator = torch.Generator().manual_seed(seed_for_token(seed, output_index))
    return torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=generator)


def row_values(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """A per-row parameter as a [B] tensor on `like`'s device and dtype."""
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]],
                    output_ids: list[list[int]], presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits [B, V]; presence, frequency, repetition [B].

    repetition: tokens seen in prompt or output: logit / r if positive else logit * r.
    frequency / presence: logit -= frequency * count_in_output + presence * (count > 0).
    """
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros(num_rows, vocab_size, dtype=logits.dtype, device=logits.device)
    rows, ids = ragged_index(output_ids, logits.device)
    output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=logits.dtype),
                             accumulate=True)
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=logits.device)
    seen[ragged_index(prompt_ids, logits.device)] = True
    seen |= output_counts > 0
    r = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with prob < min_p * max prob. logits [B, V], min_p [B]."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None
                ) -> torch.Tensor:
    """Keep logits >= the k-th largest of the row (ties at the k-th are kept); 0 keeps all.
    `max_k`, the largest k, known on the host, spares a read of `top_k` from the device."""
    k = top_k.long()
    if max_k is None:
        max_k = int(k.max())
    max_k = min(max(max_k, 1), logits.shape[-1])
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
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """logits [len(requests), vocab] on any device: one row per request to sample."""
        token_ids, logprobs = self.sample(logits, requests)
        return [SampleResult(token_id, row_logprobs) for token_id, row_logprobs
                in zip(token_ids.tolist(), logprobs, strict=True)]

    def sample(self, logits: torch.Tensor, requests: list[Request],
               output_indices: list[int] | None = None
               ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The sampled ids, [B] long on the logits' device, and each row's logprobs (None where
        not asked for; reading them is the only other transfer to the host).

        output_indices: which output token each row samples (default: each request's next);
        async scheduling samples past tokens still in flight (pdserve/serve/engine/overlap.py)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        if output_indices is None:
            output_indices = [r.num_output_tokens for r in requests]
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        wants_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
        banned = self._banned_stops(requests, output_indices)
        controls = any(p.has_logit_controls for p in params)
        if any(banned) or controls:  # both write in place: the caller's logits stay as they were
            logits = logits.clone()
        if any(banned):
            logits[ragged_index(banned, logits.device)] = float("-inf")
        if controls:
            logits = apply_logit_controls(logits, requests)
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits, [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                row_values([p.presence_penalty for p in params], logits),
                row_values([p.frequency_penalty for p in params], logits),
                row_values([p.repetition_penalty for p in params], logits))
        token_ids = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            token_ids[sampled_rows] = self._draw(logits[sampled_rows],
                                                 [requests[i] for i in sampled_rows],
                                                 [output_indices[i] for i in sampled_rows])
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, wants in enumerate(wants_logprobs) if wants]
            for row, row_logprobs in zip(rows, _logprobs_of(
                    raw_logprobs[rows], token_ids[rows], [params[i].logprobs for i in rows]),
                    strict=True):
                logprobs[row] = row_logprobs
        return token_ids, logprobs

    @staticmethod
    def _banned_stops(requests: list[Request], output_indices: list[int]) -> list[list[int]]:
        """Per row, the token ids that min_tokens holds back: eos and stop ids until then."""
        banned = []
        for request, index in zip(requests, output_indices, strict=True):
            params = request.sampling_params
            token_ids: list[int] = []
            # a grammar holds its own end tokens back (pdserve/serve/engine/structured.py)
            if index < params.min_tokens and request.grammar is None:
                token_ids = list(params.stop_token_ids)
                if not params.ignore_eos:
                    token_ids += list(request.eos_token_ids)
            banned.append(token_ids)
        return banned

    def sampling_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, min-p, top-k, top-p, then
        softmax. [rows, V] -> [rows, V]. Speculative decoding verifies against it
        (pdserve/serve/engine/spec_decode.py) for requests whose stop, logit-control and penalty
        steps do nothing."""
        params = [r.sampling_params for r in requests]
        logits = logits.float()
        logits = logits / row_values([p.temperature for p in params], logits).unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, row_values([p.min_p for p in params], logits))
        if any(p.top_k > 0 for p in params):
            top_k = [p.top_k for p in params]
            logits = apply_top_k(logits, row_values(top_k, logits), max_k=max(top_k))
        if any(p.top_p < 1.0 for p in params):
            logits = apply_top_p(logits, row_values([p.top_p for p in params], logits))
        return torch.softmax(logits, dim=-1)

    def _draw(self, logits: torch.Tensor, requests: list[Request], output_indices: list[int]
              ) -> torch.Tensor:
        probs = self.sampling_probs(logits, requests)
        # every sampled row draws from the engine's generator, seeded or not, so that its
        # sequence does not depend on which rows are seeded
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        seeded = [(row, r.sampling_params.seed, index)
                  for row, (r, index) in enumerate(zip(requests, output_indices, strict=True))
                  if r.sampling_params.seed is not None]
        if seeded:
            rows = [row for row, _, _ in seeded]
            host_noise = torch.stack([exponential_noise(probs.shape[1], seed, index)
                                      for _, seed, index in seeded])
            noise[rows] = host_noise.to(noise.device, non_blocking=True)
        return (probs / noise).argmax(dim=-1)


def _logprobs_of(row_logprobs: torch.Tensor, token_ids: torch.Tensor, num_tops: list[int]
                 ) -> list[TokenLogprobs]:
    """Per row, {token: Logprob} for its top num_top tokens and the sampled one (rank 1 = best).
    row_logprobs [R, V], token_ids [R]: one transfer of [R, 2 + max num_top] values."""
    chosen = row_logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (row_logprobs > chosen).sum(dim=1, keepdim=True) + 1
    max_top = max(num_tops)
    top_values, top_ids = row_logprobs.topk(max_top, dim=-1) if max_top > 0 else (
        row_logprobs[:, :0], token_ids[:, None][:, :0])
    values = torch.cat([chosen, top_values], dim=1).tolist()
    ids = torch.cat([token_ids.unsqueeze(1), ranks, top_ids], dim=1).tolist()
    results = []
    for row_values_, row_ids, num_top in zip(values, ids, num_tops, strict=True):
        token_id, rank = row_ids[0], row_ids[1]
        result: TokenLogprobs = {token_id: Logprob(row_values_[0], rank)}
        for position in range(num_top):
            result.setdefault(row_ids[2 + position], Logprob(row_values_[1 + position],
                                                             position + 1))
        results.append(result)
    return results
