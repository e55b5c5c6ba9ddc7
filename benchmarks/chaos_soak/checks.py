"""Every answer against an independent reference, and every failure by its cause.

A completed answer is right when:
  plain, stream, logprobs  its text is the offline engine's greedy text of the same prompt
                           (temperature 0, ignore_eos, same max_tokens);
  logprobs                 also: one finite log probability <= 0 per generated token, each
                           with 1 to LOGPROBS finite top entries;
  json-schema              it finished ("stop"), parses as JSON and validates against SCHEMA
                           (jsonschema), and is the offline engine's greedy answer of the same
                           chat under the same schema (a wrong answer says whether it is);
  n2                       each of its two seeded choices streams the same pieces, token by
                           token, as the undisturbed run of the same request before the kills
                           (whose choices are checked in turn against the offline engine's,
                           seeded alike).

A failed request has one cause (Outcome.cause, from the client), except that a broken
connection to a router while that router was being killed is "lost_with_killed_router": only a
stream that router held (served by it, sent before it was gone, not over before the SIGKILL),
and only a broken connection, not a 503 or a timeout that merely overlapped the kill.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from benchmarks.chaos_soak.fleet import ROUTERS, WORKERS
from benchmarks.chaos_soak.workload import GREEDY_KINDS, LOGPROBS, SCHEMA, Outcome, PlannedRequest

LOST_WITH_KILLED_ROUTER = "lost_with_killed_router"


@dataclass
class Kill:
    victims: list[str]
    """Killed together (both workers of a pool: the pool is empty until one is back)."""
    at_s: float
    dead_at_s: float = 0.0
    """When every victim was gone (SIGKILL sent at at_s, reaped by then)."""
    restarted_at_s: float = 0.0
    ready_after_s: float | None = None
    """Restart to ready of the last victim, seconds (None: not ready within the wait)."""
    ready_after_s_each: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "+".join(self.victims)

    @property
    def empties_pool(self) -> bool:
        roles = [v.partition("-")[0] for v in self.victims]
        return any(roles.count(role) == sum(w.startswith(role) for w in WORKERS) > 0
                   for role in ("prefill", "decode"))

    @property
    def back_at_s(self) -> float:
        """When the last victim was ready again (the restart, where it never was)."""
        return self.restarted_at_s + (self.ready_after_s or 0.0)


def check_answer(outcome: Outcome, planned: PlannedRequest, greedy_text: str | None,
                 reference: Outcome | None) -> str | None:
    """What is wrong with a completed answer (None: nothing); see the module's docstring."""
    if outcome.kind in GREEDY_KINDS:
        if greedy_text is None:
            return "no reference text"
        if outcome.texts[0] != greedy_text:
            return f"text differs from the offline engine's at character " \
                   f"{_first_difference(outcome.texts[0], greedy_text)}"
    if outcome.kind == "logprobs":
        return check_logprobs(outcome)
    if outcome.kind == "json-schema":
        wrong = check_json(outcome)
        if greedy_text is None:
            return wrong
        if outcome.texts[0] != greedy_text:
            return f"{wrong or 'valid'}, and differs from the offline engine's at character " \
                   f"{_first_difference(outcome.texts[0], greedy_text)}"
        return None if wrong is None else f"{wrong} (as the offline engine's)"
    if outcome.kind == "n2":
        if reference is None or reference.pieces is None:
            return "no undisturbed run to compare with"
        for choice, (got, want) in enumerate(zip(outcome.pieces or [], reference.pieces,
                                                 strict=False)):
            if got != want:
                return f"choice {choice} differs from the undisturbed run at token " \
                       f"{_first_difference(got, want)}"
        if len(outcome.pieces or []) != len(reference.pieces):
            return "not as many choices as the undisturbed run"
    return None


def check_logprobs(outcome: Outcome) -> str | None:
    logprobs, tops = outcome.token_logprobs, outcome.top_logprobs
    if logprobs is None or tops is None:
        return "no logprobs"
    if len(logprobs) != outcome.num_tokens or len(tops) != outcome.num_tokens:
        return f"{len(logprobs)} logprobs for {outcome.num_tokens} tokens"
    for i, (value, top) in enumerate(zip(logprobs, tops, strict=True)):
        if not _is_logprob(value):
            return f"token {i}: logprob {value!r}"
        if not isinstance(top, dict) or not 1 <= len(top) <= LOGPROBS or not all(
                _is_logprob(v) for v in top.values()):
            return f"token {i}: top_logprobs {top!r}"
    return None


def check_json(outcome: Outcome) -> str | None:
    if outcome.finish_reasons != ["stop"]:
        return f"finished with {outcome.finish_reasons}"
    try:
        jsonschema.validate(json.loads(outcome.texts[0]), SCHEMA)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    except jsonschema.ValidationError as exc:
        return f"not the schema's: {exc.message}"
    return None


def _is_logprob(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value <= 0


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def held_by_killed_router(outcome: Outcome, kills: list[Kill]) -> bool:
    """The router that served `outcome` was killed while it held it: sent before the router
    was gone, and not over before the SIGKILL."""
    return any(ROUTERS[outcome.router] in k.victims
               and outcome.start_s <= max(k.dead_at_s, k.at_s) and outcome.end_s >= k.at_s
               for k in kills)


def cause_of(outcome: Outcome, kills: list[Kill]) -> str | None:
    """Why a request did not come back right (None: it did), one cause each."""
    if outcome.ok:
        return None if outcome.wrong is None else f"wrong_output:{outcome.kind}"
    if outcome.cause == "transport" and held_by_killed_router(outcome, kills):
        return LOST_WITH_KILLED_ROUTER
    return outcome.cause or "unknown"


def overlapping_kills(outcome: Outcome, kills: list[Kill]) -> list[Kill]:
    """The kills whose outage (SIGKILL to ready again) overlaps the request's life."""
    return [k for k in kills if outcome.start_s <= k.back_at_s and outcome.end_s >= k.at_s]


def offline_reference(model: str, outcomes: list[Outcome],
                      planned: dict[int, PlannedRequest], n2_pool: list[PlannedRequest]
                      ) -> tuple[dict[int, str], dict[int, list[str]]]:
    """The offline engine's answers: the greedy text of every completed greedy request, by
    index (the JSON ones through its chat template, under the same schema); and each n2 pool
    request's choices, seeded as served (a seeded draw depends on (seed, token index) only),
    by pool index, to check the undisturbed runs themselves."""
    from pdserve.protocol.sampling import StructuredOutputs
    from pdserve.serve import LLM, SamplingParams

    completions = [planned[o.index] for o in outcomes if o.ok and o.kind in GREEDY_KINDS]
    chats = [planned[o.index] for o in outcomes if o.ok and o.kind == "json-schema"]
    texts: dict[int, str] = {}
    n2_choices: dict[int, list[str]] = {}
    with LLM(model) as llm:
        if completions:
            outs = llm.generate([p.body["prompt"] for p in completions],
                                [SamplingParams(temperature=0, max_tokens=p.body["max_tokens"],
                                                ignore_eos=True) for p in completions])
            texts.update((p.index, out.outputs[0].text)
                         for p, out in zip(completions, outs, strict=True))
        if chats:
            structured = chats[0].body["structured_outputs"]
            outs = llm.chat([p.body["messages"] for p in chats], SamplingParams(
                temperature=0, max_tokens=chats[0].body["max_tokens"],
                structured_outputs=StructuredOutputs(
                    json=structured["json"],
                    disable_any_whitespace=structured["disable_any_whitespace"])))
            texts.update((p.index, out.outputs[0].text)
                         for p, out in zip(chats, outs, strict=True))
        if n2_pool:
            outs = llm.generate([p.body["prompt"] for p in n2_pool], [SamplingParams(
                n=p.body["n"], temperature=p.body["temperature"], seed=p.body["seed"],
                max_tokens=p.body["max_tokens"], ignore_eos=True) for p in n2_pool])
            n2_choices.update((p.index, [choice.text for choice in out.outputs])
                              for p, out in zip(n2_pool, outs, strict=True))
    return texts, n2_choices


def judge(outcomes: list[Outcome], planned: dict[int, PlannedRequest],
          greedy: dict[int, str], n2_references: dict[int, Outcome]) -> None:
    """Set `wrong` on every completed answer its kind's check finds wrong."""
    for outcome in outcomes:
        if outcome.ok:
            request = planned[outcome.index]
            reference = None if request.reference is None else n2_references.get(
                request.reference)
            outcome.wrong = check_answer(outcome, request, greedy.get(outcome.index),
                                         reference)
