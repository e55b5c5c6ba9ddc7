"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of every prompt token given
the ones before it, with the top-k alternatives, from the same forward that fills the KV.

A step computes logits only for the rows it samples from. A chunk of a request that asked for
prompt logprobs also returns the rows of its positions whose next token is a prompt token;
the runner appends them after the sampling rows
(pdserve/serve/executor/logit_rows.py):

    prompt  p0 p1 p2 p3 p4 p5 | o0          chunk A = [p0 p1 p2], chunk B = [p3 p4 p5]
    row at  p0 -> logprob of p1, ..., p4 -> logprob of p5, p5 -> samples o0
    chunk A: 3 prompt rows (p0 p1 p2)   chunk B: 2 prompt rows (p3 p4) + its sampling row p5

    runner logits: [ sampling rows of the step's chunks | prompt rows, in chunk order ]

Chunked prefill needs nothing more: each chunk fills its own entries. Such a request computes
its whole prompt, as in vLLM: a prefix-cache hit (or a prefix loaded from the store) would
leave its rows uncomputed. The entries are reported once, on the request's first output; a
request that arrives with outputs already generated (a hand-off to decode, a migration after
streaming) does not compute them again: the worker that ran its prompt sent them.
"""

from __future__ import annotations

import torch

from pdserve.protocol.tp import StepInput
from pdserve.protocol.worker import TokenLogprob
from pdserve.serve.engine.request import Logprob, Request, TokenLogprobs

ROWS_PER_SLICE = 256
"""Prompt rows turned into logprobs at once (bounds the host memory of a long chunk's)."""


def start_prompt_logprobs(request: Request) -> None:
    """Make a new request (nothing generated yet) collect its prompt logprobs, if it asks."""
    if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
        request.prompt_logprobs = [None] * request.num_prompt_tokens


def wants_prompt_logits(request: Request) -> bool:
    """Whether the request still collects prompt logprobs (so it may not skip any of its
    prompt through a cached prefix)."""
    return request.prompt_logprobs is not None


def num_prompt_logit_rows(request: Request, start: int, num_tokens: int) -> int:
    """How many leading rows of the chunk [start, start + num_tokens) predict a prompt token."""
    if request.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_tokens, request.num_prompt_tokens - 1) - start)


def record_prompt_logprobs(scheduled: list[tuple[Request, int]], step: StepInput,
                           logits: torch.Tensor, num_sampled: int) -> torch.Tensor:
    """Fill the requests' prompt logprobs from the prompt rows after the first `num_sampled`
    rows of `logits` [rows, vocab]; returns the sampling rows."""
    if logits.shape[0] == num_sampled:
        return logits
    offset = num_sampled
    for (request, _), chunk in zip(scheduled, step.chunks, strict=True):
        num_rows = chunk.num_prompt_logits
        if num_rows == 0:
            continue
        rows = logits[offset:offset + num_rows]
        offset += num_rows
        if request.prompt_logprobs is None:
            continue
        num_top = request.sampling_params.prompt_logprobs or 0
        # slices: the log-softmax and rank temporaries are [rows, vocab] each
        for begin in range(0, num_rows, ROWS_PER_SLICE):
            first = chunk.start_pos + 1 + begin  # the prompt token its first row predicts
            end = min(num_rows, begin + ROWS_PER_SLICE)
            request.prompt_logprobs[first:first + end - begin] = prompt_entries(
                rows[begin:end], request.prompt_token_ids[first:first + end - begin], num_top)
    if offset != logits.shape[0]:
        raise RuntimeError(f"runner returned {logits.shape[0]} logit rows; the step's chunks "
                           f"account for {offset}")
    return logits[:num_sampled]


def prompt_entries(logits: torch.Tensor, targets: list[int], num_top: int
                   ) -> list[TokenLogprobs]:
    """One {token: Logprob} per row of logits [n, vocab]: the target token (with its rank
    among all) and the num_top most likely, as the sampler reports an output token."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.long).to(logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, target)  # [n, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_values, top_ids = (logprobs.topk(num_top, dim=-1) if num_top > 0
                           else (logprobs[:, :0], logprobs[:, :0]))
    entries = []
    for i, (token_id, logprob, rank) in enumerate(
            zip(targets, chosen.squeeze(1).tolist(), ranks, strict=True)):
        entry: TokenLogprobs = {token_id: Logprob(logprob, rank)}
        for top_rank, (value, index) in enumerate(
                zip(top_values[i].tolist(), top_ids[i].long().tolist(), strict=True), 1):
            entry.setdefault(index, Logprob(value, top_rank))
        entries.append(entry)
    return entries


def take_prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
    """The request's prompt logprobs, once (its first output carries them)."""
    entries, request.prompt_logprobs = request.prompt_logprobs, None
    return entries


def wire_prompt_logprobs(entries: list[TokenLogprobs | None] | None, prompt_token_ids: list[int]
                         ) -> list[TokenLogprob | None] | None:
    """A request's prompt logprobs as the worker protocol's Output carries them."""
    if entries is None:
        return None
    return [None if entry is None else
            TokenLogprob(token_id, entry[token_id].logprob,
                         {t: lp.logprob for t, lp in entry.items()}, entry[token_id].rank)
            for token_id, entry in zip(prompt_token_ids, entries, strict=True)]
