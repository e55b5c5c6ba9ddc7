"""Batched sampling from one step's logits, with vLLM's meaning of every parameter.

Per row (request), in this order:

    raw logits ──► logprobs (top-n + sampled token's; raw, before any processing, as vLLM)
        │
        ├─ min_tokens: eos / stop ids get -inf until min_tokens are out
        ├─ allowed_token_ids, bad_words, logit_bias (pdserve/serve/engine/logit_controls.py)
        ├─ repetition penalty (prompt + output tokens), frequency and presence (output tokens)
        ├─ greedy rows: argmax here
        ├─ temperature ─► min-p ─► top-k ─► top-p (masked tokens get -inf)
        └─ draw: argmax(probs / E) with E ~ Exponential(1), the Gumbel-max trick's sibling;
                 seeded rows: the inverse CDF at a uniform keyed by (seed, i)

Seeded rows instead take the token where a uniform u, a pure function of (seed, i) with i
the index of the output token being sampled, falls in the row's cumulative distribution
(pdserve/serve/engine/seeded_draw.py): one number per row, made on the host alike on every
worker, so the draw is reproducible regardless of batch composition, and a decode worker that
receives only (seed, i) continues exactly where the prefill worker stopped, on CPU or GPU.
Unseeded rows share the engine's generator.

The host never waits for the device while a step samples. Everything runs on the logits'
device as batched tensor ops; what the host knows (per-row parameters, which rows are greedy,
seeded or want logprobs, the token ids that controls and penalties touch) goes down as small
tensors built once and sent from pinned memory without waiting; rows are picked with index
tensors and masks are applied with masked ops, never with host lists or boolean indexing.
Top-k takes `topk` of the largest k asked for; top-p ranks only the candidates top-k leaves,
exactly, ties included, and when a top-p row has no top-k it searches for the probability
threshold (a bisection over float32's bits, 30 masked sums per row) instead of sorting rows.
What the host needs back, the sampled ids and the logprobs asked for, crosses in one copy to
pinned memory (`SampledBatch`); reading it is the step's one wait
(tests/serve/test_sampler_syncs.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pdserve.serve.engine.logit_controls import apply_logit_controls, flat_index
from pdserve.serve.engine.request import Logprob, Request, TokenLogprobs
from pdserve.serve.engine.seeded_draw import seeded_tokens
from pdserve.serve.layers.uploads import to_device


@dataclass
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None
    """Top-n plus the sampled token when the request asked for logprobs."""


def seed_for_token(seed: int, output_index: int) -> int:
    """A host generator's seed for output token `output_index` of a request seeded with
    `seed` (speculative decoding's acceptance draws, pdserve/serve/engine/spec_decode.py)."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)



def row_values(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """A per-row parameter as a [B] tensor on `like`'s device and dtype."""
    return to_device(torch.tensor(values, dtype=like.dtype), like.device)


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as a [R] long index tensor on `device`."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]],
                    output_ids: list[list[int]], presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits [B, V]; presence, frequency, repetition [B].

    repetition: tokens seen in prompt or output: logit / r if positive else logit * r.
    frequency / presence: logit -= frequency * count_in_output + presence * (count > 0).
    """
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros(num_rows, vocab_size, dtype=logits.dtype, device=logits.device)
    positions = flat_index(output_ids, logits)
    output_counts.view(-1).index_add_(0, positions, torch.ones_like(positions,
                                                                    dtype=logits.dtype))
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=logits.device)
    seen.view(-1).index_fill_(0, flat_index(prompt_ids, logits), True)
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


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, max_candidates: int | None = None,
                search: bool | None = None) -> torch.Tensor:
    """Keep the smallest most-likely set with probability mass >= top_p: a token stays while
    the mass of the tokens strictly more likely than it is below top_p, so the most likely
    token always stays and tied tokens stay or go together; top_p >= 1 keeps every token.

    With `max_candidates`, only a row's that many most likely tokens are ranked: exact
    whenever no more than that many tokens can be kept, as after top-k with k <=
    max_candidates (tokens tied with the last candidate share its fate). Without, on a GPU
    (`search` None) or with `search`, the smallest kept probability is searched for
    (`_top_p_threshold`, nothing sorted); on a CPU the whole row is ranked, which its cores do
    faster than the search's 30 passes once rows are many (measured here: 686 against 1,160 ms
    at 64 x 128k, 17 against 20 ms at 8 x 32k, 83 against 66 ms at 8 x 128k). Either keeps
    the same tokens."""
    probs = torch.softmax(logits, dim=-1)
    if search is None:
        search = probs.device.type != "cpu"
    if max_candidates is None and search:
        threshold = _top_p_threshold(probs, top_p)
    else:
        threshold = _top_p_candidates_threshold(probs, top_p,
                                                max_candidates or probs.shape[-1])
    drop = (probs < threshold) & (top_p.unsqueeze(1) < 1.0)
    return logits.masked_fill(drop, float("-inf"))


def _top_p_candidates_threshold(probs: torch.Tensor, top_p: torch.Tensor, max_candidates: int
                                ) -> torch.Tensor:
    """[B, 1]: the smallest kept probability, ranking each row's `max_candidates` largest."""
    num_candidates = min(max(max_candidates, 1), probs.shape[-1])
    top_probs = probs.topk(num_candidates, dim=-1).values  # [B, K], descending
    mass_before = top_probs.cumsum(dim=-1) - top_probs
    # a run of tied candidates takes the mass before its first member
    starts = torch.cat([torch.ones_like(top_probs[:, :1], dtype=torch.bool),
                        top_probs[:, 1:] != top_probs[:, :-1]], dim=1)
    positions = torch.arange(num_candidates, device=probs.device).expand_as(top_probs)
    run_start = torch.where(starts, positions, 0).cummax(dim=-1).values
    kept = mass_before.gather(1, run_start) < top_p.unsqueeze(1)
    kept |= positions == 0
    return torch.where(kept, top_probs, float("inf")).min(dim=-1, keepdim=True).values


# float32's bit patterns of non-negative values order as the values do, and a probability's
# are below 2^30 (1.0 is 0x3F800000): 30 halvings of [0, bits(max prob)] leave one pattern.
TOP_P_SEARCH_STEPS = 30


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the smallest kept probability, as the smallest float32 q with

        mass_above(q) = sum of the row's probs > q  <  top_p

    (mass_above only falls as q grows, so a bisection finds it; a token of probability q
    stays exactly when mass_above(q) < top_p, the sort's rule). The row's largest
    probability always qualifies (nothing is above it), so it starts as the upper end.
    Each step is one masked sum per row, on the device, with no host read."""
    top_p = top_p.unsqueeze(1).to(probs.dtype)
    high = probs.float().max(dim=-1, keepdim=True).values.view(torch.int32).long()  # [B, 1]
    low = torch.zeros_like(high)
    for _ in range(TOP_P_SEARCH_STEPS):
        middle = (low + high) // 2
        candidate = middle.int().view(torch.float32).to(probs.dtype)
        qualifies = torch.where(probs > candidate, probs, 0.0).sum(-1, keepdim=True) < top_p
        high = torch.where(qualifies, middle, high)
        low = torch.where(qualifies, low, middle + 1)
    return high.int().view(torch.float32).to(probs.dtype)


@dataclass
class SampledBatch:
    """One step's samples on their way to the host. The ids stay on the device (the next
    step's inputs under async scheduling); one copy of the ids and the logprobs asked for,
    packed as float64 (ids and ranks are exact in it), is queued into pinned memory behind
    them, and reading it (`results`) is the step's one wait for the device."""

    token_ids: torch.Tensor  # [B] long, on the device
    host: torch.Tensor  # [B + R * (3 + 2 * max_top)] float64, pinned on CUDA
    ready: torch.cuda.Event | None  # CUDA: recorded after the copy
    logprob_rows: list[int]  # the R rows that asked for logprobs
    num_tops: list[int]  # and how many top tokens each

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def host_token_ids(self) -> list[int]:
        self.wait()
        return self.host[:self.token_ids.shape[0]].long().tolist()

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Each row's logprobs (None where not asked for); waits only when one was asked."""
        num_rows = self.token_ids.shape[0]
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if not self.logprob_rows:
            return logprobs
        self.wait()
        num_asked, width = len(self.logprob_rows), max(self.num_tops)
        values_end = num_rows + num_asked * (1 + width)
        values = self.host[num_rows:values_end].view(num_asked, 1 + width).tolist()
        ids = self.host[values_end:].view(num_asked, 2 + width).long().tolist()
        for row, row_logprobs in zip(self.logprob_rows,
                                     _logprobs_from(values, ids, self.num_tops), strict=True):
            logprobs[row] = row_logprobs
        return logprobs

    def results(self) -> list[SampleResult]:
        return [SampleResult(token_id, row_logprobs) for token_id, row_logprobs
                in zip(self.host_token_ids(), self.logprobs(), strict=True)]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """logits [len(requests), vocab] on any device: one row per request to sample."""
        return self.launch(logits, requests).results()

    def sample(self, logits: torch.Tensor, requests: list[Request],
               output_indices: list[int] | None = None
               ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The sampled ids, [B] long on the logits' device, and each row's logprobs (None where
        not asked for; only these make the host wait)."""
        sampled = self.launch(logits, requests, output_indices)
        return sampled.token_ids, sampled.logprobs()

    def launch(self, logits: torch.Tensor, requests: list[Request],
               output_indices: list[int] | None = None) -> SampledBatch:
        """Sample every row on the logits' device and queue the copy of what the host needs;
        nothing here waits for the device.

        output_indices: which output token each row samples (default: each request's next);
        async scheduling samples past tokens still in flight (pdserve/serve/engine/overlap.py)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        if output_indices is None:
            output_indices = [r.num_output_tokens for r in requests]
        device = logits.device
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if logprob_rows else None
        banned = self._banned_stops(requests, output_indices)
        controls = any(p.has_logit_controls for p in params)
        if any(banned) or controls:  # both write in place: the caller's logits stay as they were
            logits = logits.clone(memory_format=torch.contiguous_format)
        if any(banned):
            logits.view(-1).index_fill_(0, flat_index(banned, logits), float("-inf"))
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
        if len(sampled_rows) == len(requests):
            token_ids = self._draw(logits, requests, output_indices)
        elif sampled_rows:
            rows = row_index(sampled_rows, device)
            token_ids.index_copy_(0, rows, self._draw(
                logits.index_select(0, rows), [requests[i] for i in sampled_rows],
                [output_indices[i] for i in sampled_rows]))
        parts = [token_ids.double()]
        num_tops = [params[i].logprobs or 0 for i in logprob_rows]
        if raw_logprobs is not None:
            if len(logprob_rows) < len(requests):
                rows = row_index(logprob_rows, device)
                raw_logprobs, chosen_ids = raw_logprobs.index_select(0, rows), \
                    token_ids.index_select(0, rows)
            else:
                chosen_ids = token_ids
            parts += [t.flatten().double() for t in _logprob_tensors(raw_logprobs, chosen_ids,
                                                                     max(num_tops))]
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=packed.is_cuda)
        host.copy_(packed, non_blocking=True)
        ready = None
        if packed.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return SampledBatch(token_ids, host, ready, logprob_rows, num_tops)

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
        top_p_ks = [p.top_k for p in params if p.top_p < 1.0]
        if top_p_ks:  # top-k bounds the candidates unless a top-p row has none
            logits = apply_top_p(logits, row_values([p.top_p for p in params], logits),
                                 max_candidates=max(top_p_ks) if min(top_p_ks) > 0 else None)
        return torch.softmax(logits, dim=-1)

    def _draw(self, logits: torch.Tensor, requests: list[Request], output_indices: list[int]
              ) -> torch.Tensor:
        probs = self.sampling_probs(logits, requests)
        # every sampled row draws from the engine's generator, seeded or not, so that its
        # sequence does not depend on which rows are seeded
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        token_ids = (probs / noise).argmax(dim=-1)
        seeded = [row for row, r in enumerate(requests) if r.sampling_params.seed is not None]
        if seeded:  # their own draw, keyed by (seed, index)
            rows = row_index(seeded, probs.device)
            token_ids.index_copy_(0, rows, seeded_tokens(
                probs.index_select(0, rows), [requests[row].sampling_params.seed
                                              for row in seeded],
                [output_indices[row] for row in seeded]))
        return token_ids


def _logprob_tensors(row_logprobs: torch.Tensor, token_ids: torch.Tensor, max_top: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """row_logprobs [R, V], token_ids [R] -> values [R, 1 + max_top] (the sampled token's,
    then the top ones) and ids [R, 2 + max_top] (the sampled token, its rank, the top ids)."""
    chosen = row_logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (row_logprobs > chosen).sum(dim=1, keepdim=True) + 1
    top_values, top_ids = row_logprobs.topk(max_top, dim=-1) if max_top > 0 else (
        row_logprobs[:, :0], token_ids[:, None][:, :0])
    return (torch.cat([chosen, top_values], dim=1),
            torch.cat([token_ids.unsqueeze(1), ranks, top_ids], dim=1))


def _logprobs_from(values: list[list[float]], ids: list[list[int]], num_tops: list[int]
                   ) -> list[TokenLogprobs]:
    """Per row, {token: Logprob} for its top num_top tokens and the sampled one (rank 1 = best),
    from `_logprob_tensors`' rows on the host."""
    results = []
    for row_values_, row_ids, num_top in zip(values, ids, num_tops, strict=True):
        token_id, rank = row_ids[0], row_ids[1]
        result: TokenLogprobs = {token_id: Logprob(row_values_[0], rank)}
        for position in range(num_top):
            result.setdefault(row_ids[2 + position], Logprob(row_values_[1 + position],
                                                             position + 1))
        results.append(result)
    return results
