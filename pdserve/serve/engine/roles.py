"""A worker's role, as the one policy object the engine consults at a request's two ends.

    colocated  a request runs from its prompt to its last token here.
    prefill    a request ends after its first token (finish_reason 'handoff'); its prompt's KV
               leaves through the role's KV saver: layer by layer during the step that
               completes the prompt, or whole just before the engine frees the blocks.
    decode     a request arrives with its first token and its prompt's KV (or recomputes
               the prompt); when it ends (stopped or at its length, not aborted) its answer's
               full blocks go to the role's KV saver, for whichever worker prefills the next
               turn of the conversation (the answer is in that turn's prompt).

The role is stored once, here: the engine holds the policy (`Engine.role`), the worker's
hand-off component swaps it on a role flip, and everything else asks `engine.role.name`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.serve.engine.request import Request

ROLE_NAMES = ("colocated", "prefill", "decode")

LayerDone = Callable[[int], None]
"""Called by the model runner with a layer index once that layer wrote its KV in a step."""


class KVSaver(Protocol):
    """Where a prefill role's KV goes (pdserve/serve/worker/kv_transfer.py's KVTransfer, or a
    test's)."""

    def start_layerwise_save(self, requests: list[Request]) -> LayerDone | None:
        """Before a step in which `requests` complete their prompt: a per-layer callback
        that saves each layer as soon as it is written, or None to save after the step."""

    def save_handoff(self, request: Request, block_ids: list[int],
                     block_keys: list[bytes]) -> None:
        """The request handed off; its blocks are freed right after this returns."""

    def save_answer(self, request: Request, block_ids: list[int],
                    block_keys: list[bytes]) -> None:
        """A decoded request ended; its blocks are freed right after this returns."""


class Role:
    """Colocated behaviour; the other roles override what differs."""

    name = "colocated"
    ends_at_first_token = False
    """The engine finishes a request after its first token (prefill)."""
    can_flip = False
    """A drained worker of this role may switch to the other phase on the router's request."""

    def layer_saver(self, finishing_prompts: list[Request]) -> LayerDone | None:
        """The runner's per-layer callback for a step in which `finishing_prompts` complete
        their prompt (None: nothing to do per layer)."""
        return None

    def on_handoff(self, request: Request, block_ids: list[int], block_keys: list[bytes]
                   ) -> None:
        """A request ended at its first token; its blocks are still allocated."""

    def on_finish(self, request: Request, block_ids: list[int], block_keys: list[bytes]
                  ) -> None:
        """A request ended here after its last token (stopped or at its length, never an
        abort); its blocks are still allocated, `block_keys` name its computed full ones."""


class PrefillRole(Role):
    name = "prefill"
    ends_at_first_token = True
    can_flip = True

    def __init__(self, saver: KVSaver | None = None) -> None:
        self.saver = saver
        """None: nothing is saved and the decode worker recomputes the prompt."""

    def layer_saver(self, finishing_prompts: list[Request]) -> LayerDone | None:
        if self.saver is None or not finishing_prompts:
            return None
        return self.saver.start_layerwise_save(finishing_prompts)

    def on_handoff(self, request: Request, block_ids: list[int], block_keys: list[bytes]
                   ) -> None:
        if self.saver is not None:
            self.saver.save_handoff(request, block_ids, block_keys)


class DecodeRole(Role):
    name = "decode"
    can_flip = True

    def __init__(self, saver: KVSaver | None = None) -> None:
        self.saver = saver
        """None: an answer's KV stays in this worker's pool and tiers only."""

    def on_finish(self, request: Request, block_ids: list[int], block_keys: list[bytes]
                  ) -> None:
        if self.saver is not None:
            self.saver.save_answer(request, block_ids, block_keys)


def make_role(name: str, saver: KVSaver | None = None) -> Role:
    """The policy for a role name; a prefill role saves its prompts through `saver` when
    given, a decode role its answers."""
    if name == "prefill":
        return PrefillRole(saver)
    if name == "decode":
        return DecodeRole(saver)
    if name == "colocated":
        return Role()
    raise ValueError(f"role must be one of {ROLE_NAMES}, got {name!r}")
