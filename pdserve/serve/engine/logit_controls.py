"""The sampler's per-request logit controls, with vLLM's meaning: `allowed_token_ids`,
`bad_words` and `logit_bias` (SamplingParams).

    logits ─► allowed_token_ids: every other token -inf
           ─► bad_words: a word's last token -inf where the output so far ends with the rest
           ─► logit_bias: logits[token] += bias
           ─► (penalties, greedy / temperature, ... in pdserve/serve/engine/sampler.py)

They change what is sampled, never the logprobs reported (those are taken from the raw
logits, as vLLM does). A request without any of them costs the sampler one check.
The engine resolves a request's controls once, when it makes the request
(`resolve_logit_controls`): ids out of the vocabulary are the request's error there, and bad
words become token ids with the worker's tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.serve.engine.request import Request


def resolve_logit_controls(request: Request, tokenizer: Any, vocab_size: int) -> None:
    """Check the request's controls against the vocabulary and tokenize its bad words;
    ValueError when one cannot be honoured."""
    params = request.sampling_params
    if not params.has_logit_controls:
        return
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{name} token ids must be in [0, {vocab_size})")
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        request.bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer,
                                                          vocab_size)


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Any, vocab_size: int
                        ) -> list[list[int]]:
    """Each word as token ids, as it would start the text and (when that tokenizes to other
    tokens of the same count) after a space, so it is banned at the start and mid-text."""
    banned: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad word {word[:40]!r} has no tokens")
        banned.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            banned.append(spaced)
    if any(not 0 <= t < vocab_size for ids in banned for t in ids):
        raise ValueError(f"bad_words tokenize to ids outside [0, {vocab_size})")
    return banned


def apply_logit_controls(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [len(requests), vocab] on any device (changed in place and returned): one
    batched write per control."""
    allowed: list[list[int]] = [[] for _ in requests]
    restricted_rows, banned, biased, biases = [], [], [], []
    for row, request in enumerate(requests):
        params = request.sampling_params
        ids_allowed = params.allowed_token_ids if params.has_logit_controls else None
        if ids_allowed is not None:
            restricted_rows.append(row)
            allowed[row] = list(ids_allowed)
        bias = params.logit_bias if params.has_logit_controls else None
        banned.append(banned_now(request.bad_words_token_ids, request.output_token_ids)
                      if params.has_logit_controls else [])
        biased.append(list(bias) if bias else [])
        biases += list(bias.values()) if bias else []
    if restricted_rows:
        outside = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        outside[restricted_rows] = True
        outside[ragged_index(allowed, logits.device)] = False
        logits.masked_fill_(outside, float("-inf"))
    if any(banned):
        logits[ragged_index(banned, logits.device)] = float("-inf")
    if biases:
        values = torch.tensor(biases, dtype=logits.dtype).to(logits.device, non_blocking=True)
        logits.index_put_(ragged_index(biased, logits.device), values, accumulate=True)
    return logits


def ragged_index(rows_of_ids: list[list[int]], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of a ragged list of id lists, as two [N] long tensors."""
    rows = [row for row, ids in enumerate(rows_of_ids) for _ in ids]
    ids = [t for row_ids in rows_of_ids for t in row_ids]
    pairs = torch.tensor([rows, ids], dtype=torch.long).to(device, non_blocking=True)
    return pairs[0], pairs[1]


def banned_now(bad_words: list[list[int]], output_ids: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far."""
    banned = []
    for word in bad_words:
        num_before = len(word) - 1
        if num_before > len(output_ids):
            continue
        if num_before == 0 or output_ids[-num_before:] == word[:-1]:
            banned.append(word[-1])
    return banned
