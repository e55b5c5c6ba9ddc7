"""The sampler as it ran on the host before sampling moved to the logits' device (b502c61):
row by row, every parameter a host list, the per-row logit controls inlined. The device sampler
(pdserve/serve/engine/sampler.py) must give the same tokens and logprobs on every option."""

from __future__ import annotations

import torch

from pdserve.serve.engine.logit_controls import banned_now
from pdserve.serve.engine.request import Logprob, Request, TokenLogprobs
from pdserve.serve.engine.sampler import (
    SampleResult,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from pdserve.serve.engine.seeded_draw import seeded_tokens


def apply_logit_controls(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for row, request in enumerate(requests):
        params = request.sampling_params
        if not params.has_logit_controls:
            continue
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(logits.shape[1], dtype=torch.bool)
            allowed[list(params.allowed_token_ids)] = True
            logits[row].masked_fill_(~allowed, float("-inf"))
        banned = banned_now(request.bad_words_token_ids, request.output_token_ids)
        if banned:
            logits[row, banned] = float("-inf")
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(params.logit_bias.values()),
                                             dtype=logits.dtype)
    return logits


class HostSampler:
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
                # a grammar holds its own end tokens back (pdserve/serve/engine/structured.py)
                continue
            token_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                token_ids += list(request.eos_token_ids)
            if token_ids:
                banned.append((row, token_ids))
        return banned

    def sampling_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, min-p, top-k, top-p, then
        softmax. [rows, V] -> [rows, V]. Speculative decoding verifies against it
        (pdserve/serve/engine/spec_decode.py) for requests whose stop, logit-control and penalty
        steps do nothing."""
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
        token_ids = (probs / noise).argmax(dim=-1)
        for row, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None:
                token_ids[row] = seeded_tokens(probs[row:row + 1], [seed],
                                               [request.num_output_tokens])[0]
        return token_ids


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
