"""n > 1 and best_of at the router: the workers' Outputs of one request, by choice.

The workers stream each choice's deltas under its index (Output.index, 0..num_seqs-1); the
prompt was prefilled once for all of them (pdserve/serve/engine/parallel_sampling.py). Here:

    stream   every chunk names its choice ("index"), as OpenAI and vLLM stream n > 1
    collect  one Accumulated per choice; the body lists the choices by index
    best_of  (completions, not streamable when > n) the n choices with the highest
             cumulative logprob, re-indexed 0..n-1 in that order (vLLM's V0 rule); the
             workers send the sampled tokens' logprobs for the ranking even when the client
             did not ask for logprobs (they are not shown then)
    usage    completion_tokens counts the tokens of every generated sequence (best_of: all
             best_of of them, as OpenAI bills them); prompt_tokens once
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import Output
from pdserve.router.responses import Accumulated
from pdserve.router.worker_client import WorkerClient


def sampling_for_ranking(sampling: SamplingParams) -> SamplingParams:
    """best_of > n ranks by cumulative logprob: ask the workers for the sampled tokens'."""
    if sampling.num_seqs > sampling.n and sampling.logprobs is None:
        return dataclasses.replace(sampling, logprobs=0)
    return sampling


@dataclasses.dataclass
class ChoicesAccumulated(Accumulated):
    """Accumulated over every choice (usage, metrics), and each choice apart."""

    choices: dict[int, Accumulated] = dataclasses.field(default_factory=dict)

    def add(self, output: Output) -> None:
        super().add(output)
        self.choice(output.index).add(output)

    def choice(self, index: int) -> Accumulated:
        if index not in self.choices:
            self.choices[index] = Accumulated()
        return self.choices[index]

    def best(self, n: int) -> list[Accumulated]:
        """The n choices to return: all in index order when no more were generated, else
        the n with the highest cumulative logprob (ties: the lower index)."""
        ordered = [self.choices[i] for i in sorted(self.choices)]
        if len(ordered) <= n:
            return ordered
        return sorted(ordered, key=lambda c: -sum(e.logprob for e in c.logprobs))[:n]


def longest_choice(acc: Accumulated) -> int:
    """Output tokens of the request's longest sequence (vLLM's max_num_generation_tokens):
    what its time per output token divides by, as the choices decode in the same steps."""
    if isinstance(acc, ChoicesAccumulated) and acc.choices:
        return max(len(choice.token_ids) for choice in acc.choices.values())
    return len(acc.token_ids)


def indexed_chunk(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """A streamed chunk of choice `index` (a chunk holds one choice)."""
    for choice in chunk.get("choices", ()):
        choice["index"] = index
    return chunk


def choices_body(render: Callable[[Accumulated], dict[str, Any]], acc: ChoicesAccumulated,
                 n: int) -> dict[str, Any]:
    """The response body with one entry per returned choice: `render` makes the body of one
    choice's Accumulated (a one-choice response); usage covers every sequence."""
    chosen = acc.best(n) if acc.choices else [acc]
    bodies = [render(choice) for choice in chosen]
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    if "usage" in body:
        body["usage"] = acc.usage()
    return body


def check_num_seqs(sampling: SamplingParams, workers: Sequence[WorkerClient]) -> None:
    """ValueError (a 400) when the request's sequences exceed the batch seats a worker has:
    every sequence takes one (max_num_seqs), so no worker could ever run it."""
    limits = [w.status.max_num_seqs for w in workers
              if w.status is not None and w.status.max_num_seqs > 0]
    if limits and sampling.num_seqs > min(limits):
        raise ValueError(f"{sampling.num_seqs} sequences (n, best_of) exceed the workers' "
                         f"max_num_seqs={min(limits)}")
