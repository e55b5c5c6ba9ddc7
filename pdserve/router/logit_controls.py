"""The router's half of the logit controls and prompt logprobs a request may ask for: from an
OpenAI body (OpenAI's `logit_bias`, vLLM's `allowed_token_ids`, `bad_words` and
`prompt_logprobs`) to SamplingParams fields, and the checks that need the model (token ids
inside the vocabulary, bad words that tokenize to something), each a 400 naming the field.
The worker applies them (pdserve/serve/engine/logit_controls.py,
pdserve/serve/engine/prompt_logprobs.py).
"""

from __future__ import annotations

from typing import Any

from pdserve.router.errors import ApiError


def control_fields(body: Any) -> dict[str, Any]:
    """SamplingParams fields of a SamplingFields body. A completion that echoes with logprobs
    gets its prompt's logprobs too (vLLM: prompt_logprobs defaults to logprobs then)."""
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and getattr(body, "echo", False):
        prompt_logprobs = getattr(body, "logprobs", None)
    return {
        "logit_bias": ({int(t): b for t, b in body.logit_bias.items()}
                       if body.logit_bias else None),
        "allowed_token_ids": (None if body.allowed_token_ids is None
                              else tuple(body.allowed_token_ids)),
        "bad_words": tuple(body.bad_words or ()),
        "prompt_logprobs": prompt_logprobs,
    }


def check_controls(body: Any, tokenizer: Any, vocab_size: int) -> None:
    """ApiError 400 when a control names a token outside the vocabulary, or a bad word has
    no tokens (the worker bans each word's tokens)."""
    for name, ids in (("logit_bias", [int(t) for t in body.logit_bias or ()]),
                      ("allowed_token_ids", body.allowed_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token id(s) {bad[:8]} in {name} are out of the vocabulary "
                           f"[0, {vocab_size})", name)
    for word in body.bad_words or ():
        if not tokenizer.encode(word.lstrip(), add_special_tokens=False):
            raise ApiError(400, f"bad word {word[:40]!r} has no tokens", "bad_words")
