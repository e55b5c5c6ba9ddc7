"""The soak's requests: five kinds in equal parts, each fresh, on an arrival schedule fixed
before the run (Poisson at the offered rate), and the Outcome a client records of each.

The schedule is drawn here, in the supervisor, and handed whole to the client processes
(client.py): a client sends each request at its planned time, whatever its event loop was
doing, so a client short of CPU shows up as send lag (start_s - at_s) and a lower sent rate,
never as a silently lighter load.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

KINDS = ("plain", "stream", "json-schema", "n2", "logprobs")
GREEDY_KINDS = ("plain", "stream", "logprobs")
"""Temperature 0: the offline engine's greedy run of the prompt is their reference."""
SCHEMA = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 8}}}}
"""Bounded (strings of at most 8 characters, at most 3 tags, no free whitespace), so that
the whole object fits in the request's max_tokens and every answer can be parsed: an
unbounded schema on a random model runs out of tokens inside a string."""
LOGPROBS = 2
JSON_MAX_TOKENS = 96
"""A JSON-schema request's max_tokens: SCHEMA's longest answer is about 60 tokens."""


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at_s: float
    """When to send it, seconds after the schedule's start."""
    kind: str
    path: str
    body: dict[str, Any]
    reference: int | None = None
    """n2 only: the index of the undisturbed run (before the kills) of this same request."""


@dataclass
class Outcome:
    """What a client saw of one request. `ok`: HTTP 200 and every choice finished; whether
    the answer is right is judged after the run (checks.py) into `wrong`."""

    index: int
    kind: str
    start_s: float
    at_s: float = 0.0
    end_s: float = 0.0
    ok: bool = False
    cause: str | None = None
    """Why it failed: http_<status>, timeout, transport (the connection broke), no_router
    (every router refused the connection), stream_error (an error event), stream_incomplete,
    bad_response."""
    error: str | None = None
    router: int = 0
    """The router that served it (its index in ROUTERS)."""
    ttft_s: float | None = None
    num_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    """Each choice's text, by choice index."""
    pieces: list[list[str]] | None = None
    """n2: each choice's streamed pieces, one per token event, compared token by token."""
    finish_reasons: list[str | None] = field(default_factory=list)
    token_logprobs: list[Any] | None = None
    top_logprobs: list[Any] | None = None
    wrong: str | None = None
    """Set after the run: what its kind's check found wrong with a completed answer."""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_tokens < 2:
            return None
        return (self.end_s - self.start_s - self.ttft_s) / (self.num_tokens - 1)


def arrival_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrivals at `rate` per second over [0, duration_s)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def make_request(kind: str, rng: random.Random, max_tokens_range: tuple[int, int]
                 ) -> tuple[str, dict[str, Any]]:
    """(path, body) of a fresh request of this kind."""
    prompt = " ".join(f"w{rng.randrange(100_000)}" for _ in range(rng.randint(8, 120)))
    max_tokens = rng.randint(*max_tokens_range)
    if kind == "json-schema":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": JSON_MAX_TOKENS, "temperature": 0, "stream": True,
            "structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}}
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": 0}
    if kind in ("stream", "n2"):
        body["stream"] = True
    if kind == "n2":
        body.update(n=2, temperature=1.0, seed=rng.randrange(1 << 30))
    if kind == "logprobs":
        body["logprobs"] = LOGPROBS
    return "/v1/completions", body


def plan(rate: float, duration_s: float, seed: int, max_tokens_range: tuple[int, int],
         n2_pool: list[PlannedRequest] | None = None, first_index: int = 0
         ) -> list[PlannedRequest]:
    """The run's requests: kinds in turn on Poisson arrivals. With `n2_pool`, each n2 request
    repeats one of the pool's (same prompt, seed and max_tokens), in turn, so that it has an
    undisturbed run to be compared with; every other prompt is fresh."""
    rng = random.Random(seed)
    planned: list[PlannedRequest] = []
    num_n2 = 0
    for i, at_s in enumerate(arrival_times(rate, duration_s, rng)):
        kind = KINDS[i % len(KINDS)]
        path, body = make_request(kind, rng, max_tokens_range)
        reference = None
        if kind == "n2" and n2_pool:
            reference = n2_pool[num_n2 % len(n2_pool)]
            path, body, reference = reference.path, reference.body, reference.index
            num_n2 += 1
        planned.append(PlannedRequest(first_index + i, at_s, kind, path, body, reference))
    return planned


def n2_pool(size: int, seed: int, max_tokens_range: tuple[int, int], spacing_s: float
            ) -> list[PlannedRequest]:
    """`size` fresh n2 requests, `spacing_s` apart: the undisturbed runs the soak's n2
    requests repeat."""
    rng = random.Random(seed)
    return [PlannedRequest(i, i * spacing_s, "n2", *make_request("n2", rng, max_tokens_range))
            for i in range(size)]


def to_json(planned: PlannedRequest) -> dict[str, Any]:
    return {"index": planned.index, "at_s": planned.at_s, "kind": planned.kind,
            "path": planned.path, "body": planned.body, "reference": planned.reference}


def from_json(entry: dict[str, Any]) -> PlannedRequest:
    return PlannedRequest(**entry)
