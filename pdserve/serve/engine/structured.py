"""Structured outputs in the engine: a grammar masks every sampled row's logits (xgrammar).

A request whose SamplingParams carry `structured_outputs` (protocol/sampling.py) gets a
GrammarState when the engine makes it: the spec compiled against the worker's tokenizer
(cached, keyed by the spec) and a matcher that has replayed the request's output tokens so far.
Each step then does:

    step(): schedule ──► start_masks(to_sample) ─┐  one thread fills the bitmask rows of the
                         runner.execute (forward) │  structured rows while the forward runs
                         masks.apply(logits) ◄────┘  (xgrammar's C++ releases the GIL)
            Sampler(logits) ──► accept(token) ──► stop checks (a terminated grammar stops)

State lives with the request (`Request.grammar`), never in a table keyed by batch order, so
preemption, chunked prefill and batch reshuffles need nothing. The grammar state never
crosses a socket: a worker that continues a request (a decode worker after a hand-off, a
migration's `resume_output_ids`, any `Engine.make_request(output_token_ids=...)`) rebuilds it
by replaying the output tokens it receives. A request without structured outputs costs
nothing: no compiler is built, no thread started and no mask made until one arrives, and a
step with no structured row returns None from start_masks.

Checked: xgrammar 0.2.9's fill releases the GIL (a Python loop spinning beside 3,000 fills on
another thread kept its pace), so the fill really overlaps the forward. The fused CPU decode
loop (pdserve/serve/layers/fused_decode.py) replaces only the layer loop: its hidden states still go
through compute_logits and runner.execute returns logits as the module path does, so they are masked
the same way. A children-of-one-prompt fork (n > 1) makes each child with make_request, which
gives it a state of its own (GrammarState). Compiling is synchronous, in make_request, and
cached: a schema seen for the first time costs its compile once (milliseconds on a small
vocabulary; vLLM compiles on a thread pool while the request waits).

Semantics, as vLLM 0.32 (v1/structured_output) unless said:
- The grammar's end tokens are the request's eos ids plus its stop_token_ids (vLLM's
  `all_stop_token_ids` passed as `override_stop_tokens`). Where the grammar is complete and
  cannot continue, the mask allows only those, so the request ends with one of them.
- The mask is applied to the logits before the sampler, so greedy and sampled rows draw from
  the grammar's tokens only, and logprobs are those of the masked distribution (vLLM's
  default `raw_logprobs` are computed from the logits the sampler gets, after the bitmask);
  masked tokens have logprob -inf, which the router writes as -9999.0 (as vLLM's server).
- A grammar that has terminated (accepted an end token) ends the request with finish_reason
  'stop', even under `ignore_eos` (vLLM would go on sampling unconstrained after the end,
  breaking the output) and before `min_tokens` (see below).
- `min_tokens` holds the end tokens back only while the grammar allows something else: the
  fill clears their bits unless that leaves the row empty, and the sampler leaves the
  structured rows' stop tokens alone. (vLLM masks them after the bitmask, leaving a complete
  grammar with no token at all, and fails the request.)
- Stop strings apply as usual and may cut the text inside the grammar, as in vLLM: the client
  asked for it. A response cut by max_tokens (finish_reason 'length') is incomplete.
- A sampled token the grammar rejects (which the mask prevents) aborts the request, logged;
  vLLM fails it likewise (FINISHED_ERROR).
- No output holds the UTF-8 form of a UTF-16 surrogate (ED A0-BF ..), which UTF-8 forbids
  and every decoder turns into three U+FFFD (`Utf8Guard`): xgrammar 0.2.9's string rules
  admit those bytes as one character (measured: 7 of 200 of a random model's JSON answers
  held them, each then past its string's maxLength once decoded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve.protocol.sampling import StructuredOutputs
from pdserve.structured_grammar import (
    StructuredOutputsError,
    build_grammar,
    short_message,
    spec_kind,
)

if TYPE_CHECKING:
    import xgrammar as xgr

    from pdserve.serve.engine.request import Request

NUM_COMPILED_KEPT = 128
"""Compiled grammars kept (least recently used dropped): a hot schema compiles once."""


class Utf8Guard:
    """The tokens a structured output may never take because their bytes would make the
    UTF-8 form of a surrogate: those holding ED then A0-BF anywhere (always), and those
    starting with A0-BF after a token ending with ED. Packed like xgrammar's bitmask rows
    (bit t of word t // 32), as the bits to clear."""

    def __init__(self, decoded_vocab: Sequence[bytes], num_words: int) -> None:
        always = np.zeros(num_words * 32, dtype=bool)
        after_ed = np.zeros(num_words * 32, dtype=bool)
        self.ends_with_ed = np.zeros(len(decoded_vocab), dtype=bool)
        for token_id, raw in enumerate(decoded_vocab):
            if not raw:
                continue
            always[token_id] = 0xED in raw[:-1] and any(
                a == 0xED and 0xA0 <= b <= 0xBF for a, b in zip(raw, raw[1:], strict=False))
            after_ed[token_id] = 0xA0 <= raw[0] <= 0xBF
            self.ends_with_ed[token_id] = raw[-1] == 0xED
        self.always = _packed(always)
        self.after_ed = _packed(always | after_ed)
        """What to clear after a token ending with ED: the always-forbidden ones too."""

    def apply(self, words: np.ndarray, last_token_id: int | None) -> None:
        """Clear the forbidden tokens' bits in one row (uint32 words), unless that leaves
        the row empty (the grammar's own choice then stands)."""
        after_ed = (last_token_id is not None and last_token_id < self.ends_with_ed.shape[0]
                    and self.ends_with_ed[last_token_id])
        _clear_unless_empty(words, self.after_ed if after_ed else self.always)


def _clear_unless_empty(words: np.ndarray, bits: np.ndarray) -> None:
    """Clear `bits` from a bitmask row's words, unless that leaves no token allowed (the row
    then stays as it was)."""
    kept = words & ~bits
    if kept.any():
        words[:] = kept


def _packed(bits: np.ndarray) -> np.ndarray:
    """Booleans over token ids as uint32 words, bit t of word t // 32."""
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(
        np.uint32).reshape(-1)


class GrammarState:
    """One request's position in its grammar: an xgrammar matcher fed every output token.

    Never shared between requests. A fork (n > 1: children of one prompt) gets its own state:
    `StructuredOutputManager.grammar_for(child)` compiles (from the cache) the child's spec
    and replays the child's output tokens, exactly as a decode worker does after a hand-off.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, end_token_ids: tuple[int, ...],
                 utf8_guard: Utf8Guard | None = None) -> None:
        self._matcher = matcher
        self._utf8_guard = utf8_guard
        self._last_token_id: int | None = None
        self.end_token_ids = end_token_ids
        """Tokens that end the grammar (eos ids + the request's stop_token_ids)."""
        self.num_accepted_tokens = 0
        self.is_terminated = False
        """The grammar accepted an end token: the output is complete."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it (state unchanged)."""
        if self.is_terminated or not self._matcher.accept_token(token_id):
            return False
        self._last_token_id = token_id
        self.num_accepted_tokens += 1
        self.is_terminated = self._matcher.is_terminated()
        return True

    def fill(self, bitmask: torch.Tensor, row: int, hold_end: bool) -> None:
        """Write the allowed next tokens into bitmask[row]; `hold_end` (min_tokens not yet
        reached) clears the end tokens' bits unless nothing else would be allowed."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        words = bitmask[row].numpy().view(np.uint32)  # the same memory, bits as unsigned
        if self._utf8_guard is not None:
            self._utf8_guard.apply(words, self._last_token_id)
        if not hold_end or not self.end_token_ids:
            return
        end = np.zeros_like(words)
        for token_id in self.end_token_ids:
            if token_id >> 5 < words.shape[0]:
                end[token_id >> 5] |= np.uint32(1 << (token_id & 31))
        # unless the grammar can only end here: min_tokens then yields to it
        _clear_unless_empty(words, end)


class StepMasks:
    """The bitmask of one step's structured rows, being filled on the manager's thread."""

    def __init__(self, future: Future[None], bitmask: torch.Tensor, rows: list[int]) -> None:
        self._future = future
        self._bitmask = bitmask
        self.rows = rows
        """Rows of the step's logits (to_sample order) that carry a grammar."""

    def apply(self, logits: torch.Tensor) -> None:
        """Wait for the fill, then set the disallowed tokens' logits to -inf, in place."""
        import xgrammar as xgr

        self._future.result()
        if logits.shape[0] < self._bitmask.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} logit rows for a {self._bitmask.shape[0]}-"
                               "row bitmask")
        # the mask is filled on the host; on a GPU it goes down with the step, unawaited
        bitmask = self._bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                        indices=self.rows)


class StructuredOutputManager:
    """An engine's grammar compiler (a bounded cache of compiled specs), matcher factory and
    bitmask filler. Built on the first request with structured outputs."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 num_compiled_kept: int = NUM_COMPILED_KEPT) -> None:
        """`vocab_size`: the model's logits width, which may exceed len(tokenizer) (padded
        embeddings): those extra ids are never allowed."""
        import xgrammar as xgr

        if tokenizer is None:
            raise StructuredOutputsError(
                "structured outputs need the worker's tokenizer, and this worker has none")
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.utf8_guard = Utf8Guard(info.decoded_vocab, (vocab_size + 31) // 32)
        # Our own LRU keyed by the spec replaces xgrammar's cache (keyed by its arguments).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutputs, xgr.CompiledGrammar] = OrderedDict()
        self._num_compiled_kept = num_compiled_kept
        self._executor: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None

    # ---- compiling ----------------------------------------------------------------------
    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            return compiled
        try:
            compiled = self._compiler.compile_grammar(build_grammar(spec))
        except StructuredOutputsError:
            raise
        except Exception as exc:
            raise StructuredOutputsError(f"invalid {spec_kind(spec)}: {short_message(exc)}"
                                         ) from None
        self._compiled[spec] = compiled
        if len(self._compiled) > self._num_compiled_kept:
            self._compiled.popitem(last=False)
        return compiled

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    # ---- per request --------------------------------------------------------------------
    def grammar_for(self, request: Request) -> GrammarState:
        """A fresh state for `request` (its params must carry structured outputs), with its
        output tokens so far replayed; raises StructuredOutputsError if one is rejected."""
        import xgrammar as xgr

        params = request.sampling_params
        assert params.structured_outputs is not None
        end_token_ids = tuple(dict.fromkeys((*request.eos_token_ids, *params.stop_token_ids)))
        matcher = xgr.GrammarMatcher(self.compile(params.structured_outputs),
                                     override_stop_tokens=list(end_token_ids) or None)
        state = GrammarState(matcher, end_token_ids, self.utf8_guard)
        for i, token_id in enumerate(request.output_token_ids):
            if not state.accept(token_id):
                raise StructuredOutputsError(
                    f"output token {i} ({token_id}) does not follow the request's grammar")
        return state

    # ---- per step -----------------------------------------------------------------------
    def start_masks(self, to_sample: Sequence[Request]) -> StepMasks | None:
        """Start filling the bitmask of `to_sample`'s structured rows on a thread (call before
        the forward, StepMasks.apply after it); None when no row carries a grammar."""
        rows = [row for row, request in enumerate(to_sample)
                if request.grammar is not None and not request.grammar.is_terminated]
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(to_sample))
        jobs = [(to_sample[row].grammar, row, to_sample[row].num_output_tokens
                 < to_sample[row].sampling_params.min_tokens) for row in rows]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return StepMasks(self._executor.submit(_fill_rows, bitmask, jobs), bitmask, rows)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """A [num_rows, ceil(vocab / 32)] int32 bitmask (one buffer, grown on demand, reused:
        a step joins its fill before the next step starts)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _fill_rows(bitmask: torch.Tensor, jobs: list[tuple[Any, int, bool]]) -> None:
    for state, row, hold_end in jobs:
        state.fill(bitmask, row, hold_end)
