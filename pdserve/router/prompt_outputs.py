"""What a response says about the prompt itself, in vLLM's shapes: `prompt_logprobs` (vLLM's
extra, completions and chat) and `echo` (completions).

    prompt_logprobs  completions: choices[0].prompt_logprobs; chat: the body's prompt_logprobs
                     [null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]
                     one entry per prompt token (the first has nothing before it); not
                     streamed (a stream that asks for more than 0 is a 400, as in vLLM)
    echo             the prompt's text before the completion's (non-stream: in `text`;
                     stream: in the first chunk); with `logprobs`, the prompt tokens' logprobs
                     come first too (vLLM asks the worker for prompt_logprobs = logprobs), the
                     first one null. Usage is unchanged. With max_tokens=0 the prompt
                     alone comes back (vLLM: one token is generated, and counted, not shown).

The worker that computed the prompt sends its logprobs on the request's first Output
(protocol/worker.py), in disaggregated mode the prefill worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.worker import TokenLogprob
from pdserve.router.responses import MIN_LOGPROB, Accumulated, TokenText


def prompt_logprobs_json(entries: Sequence[TokenLogprob | None], token_text: TokenText
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}},
    the prompt token first (with its rank among all tokens), then the top ones."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = token_text(token_id)
        return texts[token_id]

    rendered: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            rendered.append(None)
            continue
        item = {}
        for token_id, logprob in entry.top.items():
            rank = entry.rank if token_id == entry.token_id else 1 + sum(
                other > logprob for other in entry.top.values())
            item[str(token_id)] = {"logprob": max(logprob, MIN_LOGPROB), "rank": rank,
                                   "decoded_token": text(token_id)}
        if str(entry.token_id) not in item:
            item[str(entry.token_id)] = {"logprob": max(entry.logprob, MIN_LOGPROB),
                                         "rank": entry.rank, "decoded_token": text(
                                             entry.token_id)}
        rendered.append(item)
    return rendered


def completion_logprobs_with_nulls(token_ids: Sequence[int],
                                   entries: Sequence[TokenLogprob | None],
                                   token_text: TokenText, text_offset_start: int = 0
                                   ) -> dict[str, Any]:
    """The completions API's logprobs over tokens some of which have none (the prompt's
    first): their token_logprobs and top_logprobs entries are null."""
    tokens = [token_text(t) for t in token_ids]
    offsets, offset = [], text_offset_start
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else max(e.logprob, MIN_LOGPROB)
                           for e in entries],
        "top_logprobs": [None if e is None else
                         {token_text(t): max(lp, MIN_LOGPROB) for t, lp in e.top.items()}
                         for e in entries],
        "text_offset": offsets,
    }


@dataclass
class PromptEcho:
    """A completion's echo: the prompt's text and tokens, sent before the first output."""

    text: str
    token_ids: list[int]
    token_text: TokenText
    with_logprobs: bool
    is_prompt_only: bool = False
    """max_tokens=0: the prompt alone comes back (the one token generated is not shown)."""
    echoed: set[int] = field(default_factory=set, init=False)
    """The choices (Output.index) whose stream sent the prompt already (in its first chunk,
    as vLLM echoes each choice)."""
    prompt_entries: list[TokenLogprob | None] | None = field(default=None, init=False)
    """The prompt logprobs, kept from the Output that brought them for the other choices."""

    def logprobs(self, prompt_entries: Sequence[TokenLogprob | None] | None,
                 output_ids: Sequence[int], output_entries: Sequence[TokenLogprob]
                 ) -> dict[str, Any] | None:
        """The prompt's tokens' logprobs then the output's, offsets from the text's start."""
        if not self.with_logprobs:
            return None
        if self.is_prompt_only:
            output_ids, output_entries = [], []
        prompt = list(prompt_entries or [None] * len(self.token_ids))
        entries: list[TokenLogprob | None] = [*prompt, *output_entries]
        token_ids = [*self.token_ids, *output_ids[:len(output_entries)]]
        return completion_logprobs_with_nulls(token_ids, entries, self.token_text)

    def first_delta(self, index: int, text: str, output_ids: Sequence[int],
                    prompt_entries: Sequence[TokenLogprob | None] | None,
                    output_entries: Sequence[TokenLogprob] | None
                    ) -> tuple[str, dict[str, Any] | None]:
        """A choice's first chunk: (prompt text + the delta's, their logprobs)."""
        self.echoed.add(index)
        if prompt_entries is not None:
            self.prompt_entries = list(prompt_entries)
        prompt_entries = self.prompt_entries
        return (self.text + ("" if self.is_prompt_only else text),
                self.logprobs(prompt_entries, output_ids, output_entries or []))


def with_prompt_outputs(body: dict[str, Any], acc: Accumulated, echo: PromptEcho | None,
                        token_text: TokenText,
                        prompt_logprobs: list[TokenLogprob | None] | None = None
                        ) -> dict[str, Any]:
    """A non-streamed completion or chat body (of one choice, `acc`) with its echo and prompt
    logprobs added; `prompt_logprobs`: the request's, when another choice's output brought
    them (n > 1)."""
    choice = body["choices"][0]
    prompt_logprobs = acc.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
    if echo is not None:
        choice["text"] = echo.text + ("" if echo.is_prompt_only else choice["text"])
        if echo.with_logprobs:
            choice["logprobs"] = echo.logprobs(prompt_logprobs, acc.token_ids, acc.logprobs)
    if prompt_logprobs is not None:
        rendered = prompt_logprobs_json(prompt_logprobs, token_text)
        if body["object"] == "chat.completion":
            body["prompt_logprobs"] = rendered
        else:
            choice["prompt_logprobs"] = rendered
    return body


def prompt_echo(body: Any, prompt_ids: list[int], tokenizer: Any, token_text: TokenText,
                num_logprobs: int | None) -> PromptEcho:
    """The echo of a completion request: its prompt as given (a text prompt) or decoded (a
    prompt of token ids), as vLLM echoes (CPU work: the router runs it off the event loop)."""
    text = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt_ids)
    return PromptEcho(text, list(prompt_ids), token_text, num_logprobs is not None,
                      is_prompt_only=body.max_tokens == 0)
