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
from pdserve.serve.layers.uploads import to_device


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
    batched write per control, each through an index built on the host and sent down once."""
    restricted, allowed, banned, biased, biases = [], [], [], [], []
    for request in requests:
        params = request.sampling_params
        controlled = params.has_logit_controls
        ids_allowed = params.allowed_token_ids if controlled else None
        restricted.append(ids_allowed is not None)
        allowed.append(list(ids_allowed) if ids_allowed is not None else [])
        banned.append(banned_now(request.bad_words_token_ids, request.output_token_ids)
                      if controlled else [])
        bias = params.logit_bias if controlled else None
        biased.append(list(bias) if bias else [])
        biases += list(bias.values()) if bias else []
    flat = logits.view(-1)
    if any(restricted):
        outside = to_device(torch.tensor(restricted), logits.device)
        outside = outside.unsqueeze(1).expand(logits.shape).contiguous()
        outside.view(-1).index_fill_(0, flat_index(allowed, logits), False)
        logits.masked_fill_(outside, float("-inf"))
    if any(banned):
        flat.index_fill_(0, flat_index(banned, logits), float("-inf"))
    if biases:  # a request's biased ids are distinct: nothing is added twice
        flat.index_add_(0, flat_index(biased, logits),
                        to_device(torch.tensor(biases, dtype=logits.dtype), logits.device))
    return logits


def flat_index(rows_of_ids: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """The positions of (row, token id) pairs of a ragged list of id lists in `like` [B, V]
    viewed flat, as one [N] long tensor on its device."""
    vocab_size = like.shape[-1]
    return to_device(torch.tensor([row * vocab_size + t for row, ids in enumerate(rows_of_ids)
                                   for t in ids], dtype=torch.long), like.device)


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
