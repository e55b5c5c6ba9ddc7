"""Which rows of a step's hidden states get logits: the runner's half of sampling and prompt
logprobs (pdserve/serve/engine/prompt_logprobs.py has the request's half).

    runner logits: [ sampling rows of the step's chunks | prompt rows, in chunk order ]

A sampling chunk gives its last row (a verify chunk its last 1 + num_draft_tokens rows); a
chunk that collects prompt logprobs adds its first num_prompt_logits rows after all of those.
Both read the step message only (pdserve/protocol/tp.py StepInput), so every rank computes the
same rows.
"""

from __future__ import annotations

import numpy as np

from pdserve.protocol.tp import StepInput


def samples_every_row(step: StepInput) -> bool:
    """A decode step's shape: one token per chunk, each sampled, none a prompt row. Then the
    logit rows are all the step's rows, in order."""
    chunks = step.chunks
    return (len(chunks) > 0 and step.num_tokens == len(chunks)
            and all(c.need_logits and not c.num_prompt_logits for c in chunks))


def logit_rows(step: StepInput) -> np.ndarray:
    """Row indices of the step's hidden states [num_tokens] that get logits: each sampling
    chunk's last row (a verify chunk's last 1 + num_draft_tokens), then each chunk's prompt
    rows (see the module docstring)."""
    chunks = step.chunks
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths) - 1
    rows = ends[np.array([c.need_logits for c in chunks], dtype=bool)]
    if any(c.num_draft_tokens for c in chunks):  # a verify chunk: its 1 + k last rows
        rows = np.concatenate([np.arange(end - c.num_draft_tokens, end + 1, dtype=np.int64)
                               for end, c in zip(ends.tolist(), chunks, strict=True)
                               if c.need_logits])
    counts = [c.num_prompt_logits for c in chunks]
    if not any(counts):  # the usual step: one list pass more than sampling rows alone
        return rows
    starts = ends - np.array(lengths) + 1
    prompt_rows = [np.arange(start, start + count, dtype=np.int64)
                   for start, count in zip(starts.tolist(), counts, strict=True) if count]
    return np.concatenate([rows, *prompt_rows])
