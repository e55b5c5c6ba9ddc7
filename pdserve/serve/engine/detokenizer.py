"""Incremental detokenization and stop strings for one request.

Decoding token by token is wrong for byte-level BPE (one character can span tokens) and for
tokenizers whose text depends on the previous token (leading spaces). So, as vLLM does, keep
two offsets into the token list and decode a short window:

    ids:  [ ...context... | prefix_offset ... read_offset | new tokens ]
    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text   = decode(ids[prefix_offset:])
    new text    = full_text[len(prefix_text):]   (held back while it ends in U+FFFD: a
                                                   character still incomplete)

Stop strings are searched in the text as it grows; when one appears the text is cut where it
starts (or ends, with include_stop_str_in_output). While streaming, the last
max_stop_len - 1 characters are held back: they may be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

from pdserve.serve.engine.request import Request

_PROMPT_CONTEXT_TOKENS = 5  # enough for a tokenizer to place leading spaces correctly


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, request: Request) -> None:
        self.tokenizer = tokenizer
        self.params = request.sampling_params
        context = list(request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self._num_emitted_chars = 0
        self._stop_buffer = 0 if self.params.include_stop_str_in_output else \
            max(0, self.params.max_stop_str_len - 1)
        # A fast tokenizer's decode is its Rust backend's plus, when asked for, a clean-up of
        # spaces; without that clean-up, call the backend directly: the same text, without
        # transformers' per-call Python (two decodes per token and sequence, every step).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) \
                is False:
            self._backend_decode = backend.decode
        else:
            self._backend_decode = None

    def _decode(self, ids: list[int]) -> str:
        skip = self.params.skip_special_tokens
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False,
               check_stop_strings: bool = True) -> str | None:
        """Add tokens; returns the stop string that ended the text, if one did.

        stop_terminated: the last token is an eos / stop token id; its text is left out
        unless include_stop_str_in_output (as vLLM). check_stop_strings is False while
        min_tokens are not out yet."""
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        num_chars_before = len(self.text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        if len(self.text) == num_chars_before or not self.params.stop or \
                not check_stop_strings:
            return None
        return self._find_stop(num_chars_before)

    def flush(self) -> None:
        """The request ended (not at a stop string): keep an incomplete last character as
        U+FFFD, as a full decode would."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text):
            self.text += full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)

    def _find_stop(self, num_chars_before: int) -> str | None:
        # A stop string ending in the new text starts at most max_len - 1 chars before it.
        search_from = max(0, num_chars_before - self.params.max_stop_str_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:end]
        self._num_emitted_chars = min(self._num_emitted_chars, end)
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, withhold a possible stop-string start."""
        end = len(self.text) if finished else max(self._num_emitted_chars,
                                                  len(self.text) - self._stop_buffer)
        delta = self.text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
        return delta
