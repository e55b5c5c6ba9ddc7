"""The chaos soak's pure parts (benchmarks/chaos_soak/): the arrival schedule offers the rate
asked for and the rate sent is measured; the capacity sweep's rule; every failure gets one
cause, and a broken stream counts as lost with a killed router only when that router held it;
each kind's answer check on canned answers; the client's parsing of streams, errors and
logprobs (on a mock transport); goodput per window; every kind of request is well formed; a
restarted worker is ready only by a status its new process sent."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time

import httpx
import pytest

from benchmarks.chaos_soak import checks, client, report, soak, workload
from benchmarks.chaos_soak.checks import Kill
from benchmarks.chaos_soak.fleet import Fleet
from benchmarks.chaos_soak.workload import Outcome, PlannedRequest


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def make_outcome(kind: str = "plain", start_s: float = 0.0, end_s: float = 1.0, *,
                 ok: bool = True, texts: list[str] | None = None, **fields) -> Outcome:
    fields.setdefault("index", 0)
    return Outcome(kind=kind, start_s=start_s, end_s=end_s, ok=ok,
                   texts=["a b"] if texts is None else texts, **fields)


# ---- the load --------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [2.0, 10.0, 40.0])
def test_the_arrival_schedule_offers_the_rate_asked_for(rate: float) -> None:
    duration_s = 600.0
    times = workload.arrival_times(rate, duration_s, random.Random(5))
    expected = rate * duration_s
    assert abs(len(times) - expected) < 4 * math.sqrt(expected)  # Poisson: sd = sqrt(mean)
    assert times == sorted(times) and 0 < times[0] and times[-1] < duration_s


def test_the_plan_takes_kinds_in_turn_and_n2_repeats_the_undisturbed_runs() -> None:
    pool = workload.n2_pool(3, seed=1, max_tokens_range=(4, 8), spacing_s=0.5)
    assert [p.at_s for p in pool] == [0.0, 0.5, 1.0]
    planned = workload.plan(20.0, 10.0, seed=2, max_tokens_range=(4, 8), n2_pool=pool)
    assert [p.kind for p in planned[:10]] == list(workload.KINDS) * 2
    n2 = [p for p in planned if p.kind == "n2"]
    assert [p.reference for p in n2[:4]] == [0, 1, 2, 0]
    assert n2[3].body == pool[0].body and n2[3].body["n"] == 2
    prompts = [p.body["prompt"] for p in planned if p.kind != "json-schema" and p.kind != "n2"]
    assert len(set(prompts)) == len(prompts)  # the rest fresh
    assert workload.from_json(json.loads(json.dumps(workload.to_json(planned[3])))) == \
        planned[3]


def test_the_sent_rate_is_measured_beside_the_offered_one() -> None:
    # planned one a second over 10 s; the client fell behind and sent the last at 14 s
    outcomes = [make_outcome(start_s=i + (0.5 if i >= 5 else 0.0), at_s=float(i), index=i)
                for i in range(10)]
    outcomes[-1].start_s = 14.0
    stats = report.send_stats(outcomes, offered_rate=1.2, duration_s=10.0)
    assert stats["num_sent"] == 10
    assert stats["planned_rate"] == pytest.approx(1.0)
    assert stats["sent_rate"] == pytest.approx(0.9)  # the last one went after the 10 s
    assert stats["send_lag_p50_s"] == pytest.approx(0.5)
    assert stats["send_lag_max_s"] == pytest.approx(5.0)


def test_capacity_is_the_last_rate_of_the_sweep_that_kept_up() -> None:
    def step(rate: float, num_done_late: int, num_failed: int = 0, num_sent_late: int = 0
             ) -> soak.SweepStep:
        outcomes = [make_outcome(start_s=i / rate, at_s=i / rate, end_s=i / rate + 1.0,
                                 index=i) for i in range(int(10 * rate))]
        for o in outcomes[:num_done_late]:
            o.end_s = 30.0  # after the step's 10 s and its 5 s of drain
        for o in outcomes[len(outcomes) - num_sent_late:]:
            o.start_s = 10.5  # the client fell behind: sent after the step
        for o in outcomes[len(outcomes) - num_failed:]:
            o.ok = False
        return soak.sweep_step(rate, step_s=10.0, drain_s=5.0, outcomes=outcomes)

    kept_up, behind, failing = step(2.0, 0), step(4.0, 8), step(3.0, 0, num_failed=1)
    assert kept_up.keeps_up and kept_up.served_rate == pytest.approx(2.0)
    assert not behind.keeps_up and behind.served_rate == pytest.approx(3.2)
    assert not failing.keeps_up  # 29 of 30 completed: under 99%
    late = step(4.0, 0, num_sent_late=3)
    assert not late.keeps_up and late.sent_rate == pytest.approx(3.7)
    assert late.planned_rate == pytest.approx(4.0)
    assert soak.capacity_of([kept_up, step(3.0, 0), behind, step(6.0, 0)]) == 3.0
    assert soak.capacity_of([behind, kept_up]) is None


# ---- losses by cause -------------------------------------------------------------------------
def test_each_failure_has_one_cause_and_only_a_held_stream_dies_with_its_router() -> None:
    kills = [Kill(["router-0"], at_s=10.0, dead_at_s=10.2, restarted_at_s=11.2,
                  ready_after_s=0.5),
             Kill(["decode-0", "decode-1"], at_s=30.0, dead_at_s=30.1, restarted_at_s=31.1,
                  ready_after_s=2.0)]
    cases = [
        (make_outcome("stream", 5.0, 10.5, ok=False, router=0, cause="transport"),
         checks.LOST_WITH_KILLED_ROUTER),
        (make_outcome("plain", 10.1, 10.2, ok=False, router=0, cause="transport"),
         checks.LOST_WITH_KILLED_ROUTER),  # sent as it died
        (make_outcome("stream", 5.0, 10.5, ok=False, router=1, cause="transport"),
         "transport"),  # the other router's stream: not the kill's
        (make_outcome("stream", 5.0, 10.5, ok=False, router=0, cause="http_503"), "http_503"),
        (make_outcome("stream", 5.0, 10.5, ok=False, router=0, cause="timeout"), "timeout"),
        (make_outcome("stream", 2.0, 4.0, ok=False, router=0, cause="transport"),
         "transport"),  # over before the kill
        (make_outcome("n2", 28.0, 33.0, wrong="choice 0 differs"), "wrong_output:n2"),
        (make_outcome("plain", 28.0, 33.0), None),
    ]
    for outcome, cause in cases:
        assert checks.cause_of(outcome, kills) == cause, outcome
    assert kills[1].empties_pool and not kills[0].empties_pool
    assert not Kill(["decode-0", "prefill-0"], at_s=0.0).empties_pool
    assert Kill(["prefill-0", "prefill-1"], at_s=0.0).empties_pool


def test_the_summary_counts_failures_by_cause_kind_and_worker_kill() -> None:
    args = _args(duration_s=60.0)
    kills = [Kill(["router-0"], at_s=10.0, dead_at_s=10.2, restarted_at_s=11.2,
                  ready_after_s=0.5),
             Kill(["decode-0"], at_s=30.0, dead_at_s=30.1, restarted_at_s=31.1,
                  ready_after_s=2.0)]
    outcomes = [
        make_outcome("stream", 5.0, 10.5, ok=False, router=0, cause="transport", index=0),
        make_outcome("n2", 28.0, 33.0, ok=False, cause="http_503", index=1),
        make_outcome("json-schema", 29.0, 31.0, wrong="not JSON", index=2),
        make_outcome("plain", 40.0, 41.0, ok=False, cause="timeout", index=3),
        make_outcome("stream", 42.0, 43.0, ttft_s=0.1, num_tokens=5, index=4),
    ]
    result = report.summarise(outcomes, kills, {}, offered_rate=1.0,
                              capacity={"capacity_req_s": 2.0, "steps": []}, args=args)
    assert result[checks.LOST_WITH_KILLED_ROUTER] == 1
    assert result["failed"] == 2
    assert result["failed_by_cause"] == {"http_503": 1, "timeout": 1}
    assert result["wrong_by_kind"] == {"json-schema": 1}
    assert result["completed"] == 2 and result["completed_right"] == 1
    assert result["failed_during_worker_kills"] == {"http_503": 1, "wrong_output:json-schema": 1}
    assert result["capacity_fraction"] == pytest.approx(0.5)
    assert result["kills"][1]["num_requests_overlapping"] == 2


# ---- each kind's check -----------------------------------------------------------------------
def _planned(kind: str, reference: int | None = None) -> PlannedRequest:
    return PlannedRequest(0, 0.0, kind, "/v1/completions", {}, reference)


@pytest.mark.parametrize(("text", "finish", "wrong"), [
    ('{"name":"ab","tags":["x"]}', "stop", None),
    ('{"name":"ab","tags":[', "length", "finished with ['length']"),
    ('{"name":"ab","tags":[', "stop", "not JSON"),
    ('{"name":"abcdefghij","tags":[]}', "stop", "not the schema's"),
    ('{"name":"ab"}', "stop", "not the schema's"),
])
def test_a_json_answer_must_finish_parse_and_match_the_schema(text: str, finish: str,
                                                               wrong: str | None) -> None:
    outcome = make_outcome("json-schema", texts=[text], finish_reasons=[finish])
    found = checks.check_answer(outcome, _planned("json-schema"), None, None)
    assert (found is None) if wrong is None else found.startswith(wrong)


def test_a_json_answer_says_whether_the_offline_engine_answers_the_same() -> None:
    valid, invalid = '{"name":"ab","tags":[]}', '{"name":"abcdefghij","tags":[]}'
    planned = _planned("json-schema")

    def check(text: str, offline: str) -> str | None:
        outcome = make_outcome("json-schema", texts=[text], finish_reasons=["stop"])
        return checks.check_answer(outcome, planned, offline, None)

    assert check(valid, valid) is None
    assert check(valid, '{"name":"ac","tags":[]}') == \
        "valid, and differs from the offline engine's at character 10"
    assert check(invalid, invalid).endswith("is too long (as the offline engine's)")
    assert check(invalid, valid).startswith("not the schema's")
    assert check(invalid, valid).endswith("differs from the offline engine's at character 11")


@pytest.mark.parametrize(("logprobs", "tops", "wrong"), [
    ([-0.1, -2.0], [{"a": -0.1, "b": -3.0}, {"c": -2.0}], None),
    (None, None, "no logprobs"),
    ([-0.1], [{"a": -0.1}], "1 logprobs for 2 tokens"),
    ([-0.1, float("nan")], [{"a": -0.1}, {"c": -2.0}], "token 1: logprob"),
    ([-0.1, 0.5], [{"a": -0.1}, {"c": -2.0}], "token 1: logprob"),
    ([-0.1, -2.0], [{"a": -0.1}, {}], "token 1: top_logprobs"),
    ([-0.1, -2.0], [{"a": -0.1, "b": -1.0, "c": -2.0}, {"c": -2.0}], "token 0: top_logprobs"),
])
def test_logprobs_must_be_there_and_finite_one_per_token(logprobs, tops, wrong) -> None:
    outcome = make_outcome("logprobs", num_tokens=2, token_logprobs=logprobs,
                           top_logprobs=tops)
    found = checks.check_answer(outcome, _planned("logprobs"), "a b", None)
    assert (found is None) if wrong is None else found.startswith(wrong)


def test_greedy_text_must_be_the_offline_engines() -> None:
    for kind in workload.GREEDY_KINDS:
        outcome = make_outcome(kind, texts=["a b"], num_tokens=2, token_logprobs=[-1.0, -1.0],
                               top_logprobs=[{"a": -1.0}, {"b": -1.0}])
        assert checks.check_answer(outcome, _planned(kind), "a b", None) is None
        assert checks.check_answer(outcome, _planned(kind), "a c", None) == \
            "text differs from the offline engine's at character 2"
        assert checks.check_answer(outcome, _planned(kind), None, None) == "no reference text"


def test_n2_choices_must_match_the_undisturbed_run_token_by_token() -> None:
    reference = make_outcome("n2", pieces=[["a", " b", " c"], ["x", " y"]])
    same = make_outcome("n2", pieces=[["a", " b", " c"], ["x", " y"]])
    other = make_outcome("n2", pieces=[["a", " b", " c"], ["x", " z"]])
    short = make_outcome("n2", pieces=[["a", " b", " c"]])
    planned = _planned("n2", reference=0)
    assert checks.check_answer(same, planned, None, reference) is None
    assert checks.check_answer(other, planned, None, reference) == \
        "choice 1 differs from the undisturbed run at token 1"
    assert checks.check_answer(short, planned, None, reference) == \
        "not as many choices as the undisturbed run"
    assert checks.check_answer(same, planned, None, None) == \
        "no undisturbed run to compare with"


# ---- the client's parsing --------------------------------------------------------------------
def _sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _send(handler, planned: PlannedRequest, urls: list[str] | None = None) -> Outcome:
    async def go() -> Outcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await client.send(http, urls or ["http://r0"], planned, t0=0.0)
    return asyncio.run(go())


def test_the_client_reads_each_choice_of_a_stream_apart() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"index": 1, "text": "x", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": " b", "finish_reason": "length"}]},
                  {"choices": [{"index": 1, "text": " y", "finish_reason": "length"}]}]
        return httpx.Response(200, content=_sse(*chunks))

    body = {"prompt": "p", "max_tokens": 2, "stream": True, "n": 2, "seed": 1}
    outcome = _send(handler, PlannedRequest(7, 0.0, "n2", "/v1/completions", body))
    assert outcome.ok and outcome.cause is None and outcome.index == 7
    assert outcome.texts == ["a b", "x y"]
    assert outcome.pieces == [["a", " b"], ["x", " y"]]
    assert outcome.num_tokens == 4


def test_the_client_names_the_cause_of_a_failure() -> None:
    def error_event(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
            {"error": {"message": "worker lost"}}))

    def unfinished(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}))

    def refused_then_503(request: httpx.Request) -> httpx.Response:
        if request.url.host == "r0":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(503, text="no decode worker")

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    stream = PlannedRequest(0, 0.0, "stream", "/v1/completions",
                            {"prompt": "p", "max_tokens": 2, "stream": True})
    urls = ["http://r0", "http://r1"]
    for handler, cause, router in [(error_event, "stream_error", 0),
                                   (unfinished, "stream_incomplete", 0),
                                   (refused_then_503, "http_503", 1), (refused, "no_router", 1),
                                   (broken, "transport", 0), (slow, "timeout", 0)]:
        outcome = _send(handler, stream, urls)
        assert not outcome.ok and (outcome.cause, outcome.router) == (cause, router), handler


def test_the_client_keeps_a_completions_logprobs() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={
            "choices": [{"index": 0, "text": "a b", "finish_reason": "length", "logprobs": {
                "tokens": ["a", " b"], "token_logprobs": [-0.5, -1.5],
                "top_logprobs": [{"a": -0.5}, {" b": -1.5}]}}],
            "usage": {"completion_tokens": 2}})

    body = {"prompt": "p", "max_tokens": 2, "logprobs": 2}
    outcome = _send(handler, PlannedRequest(0, 0.0, "logprobs", "/v1/completions", body))
    assert outcome.ok and outcome.texts == ["a b"] and outcome.num_tokens == 2
    assert outcome.token_logprobs == [-0.5, -1.5]
    assert checks.check_answer(outcome, _planned("logprobs"), "a b", None) is None


# ---- goodput and the requests ----------------------------------------------------------------
def test_goodput_counts_right_requests_within_both_slos_where_they_completed() -> None:
    outcomes = [
        make_outcome("plain", 0.0, 2.0, ttft_s=0.5, num_tokens=1),  # window 0
        make_outcome("stream", 1.0, 6.0, ttft_s=0.5, num_tokens=51),  # 0.09 s: ok
        make_outcome("stream", 1.0, 7.0, ttft_s=0.5, num_tokens=11),  # 0.55 s: slow
        make_outcome("plain", 3.0, 8.0, ttft_s=1.5, num_tokens=1),  # TTFT too long
        make_outcome("n2", 4.0, 9.0, ok=False, ttft_s=0.1, num_tokens=3),  # failed
        make_outcome("plain", 5.0, 9.0, ttft_s=0.1, num_tokens=1, wrong="text differs"),
    ]
    windows = report.goodput_windows(outcomes, 20.0, ttft_slo_ms=1000.0, tpot_slo_ms=100.0)
    assert len(windows) == 5
    assert windows[0] == pytest.approx(1 / 5)
    assert windows[1] == pytest.approx(1 / 5)
    assert sum(windows[2:]) == 0


@pytest.mark.parametrize("kind", workload.KINDS)
def test_every_kind_of_request_is_fresh_and_well_formed(kind: str) -> None:
    rng = random.Random(3)
    path, body = workload.make_request(kind, rng, (16, 128))
    _, again = workload.make_request(kind, rng, (16, 128))
    assert path == ("/v1/chat/completions" if kind == "json-schema" else "/v1/completions")
    assert 16 <= body["max_tokens"] <= 128
    text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
    other = again["messages"][0]["content"] if "messages" in again else again["prompt"]
    assert text != other  # fresh: nothing served from a prefix cache
    assert body.get("n", 1) == (2 if kind == "n2" else 1)
    assert ("logprobs" in body) == (kind == "logprobs")
    assert body.get("stream", False) == (kind in ("stream", "n2", "json-schema"))
    if kind == "json-schema":
        assert json.loads(body["structured_outputs"]["json"]) == workload.SCHEMA


# ---- ready -----------------------------------------------------------------------------------
def test_a_worker_is_ready_only_by_a_status_sent_after_its_restart(tmp_path, monkeypatch
                                                                   ) -> None:
    fleet = Fleet("model", tmp_path, base_port=30000)
    fleet.started_at["decode-0"] = time.monotonic() - 2.0  # restarted 2 s ago
    address = fleet.address("decode-0")
    seen: list[dict] = []
    monkeypatch.setattr(fleet, "router_status", lambda router: seen)
    seen[:] = [{"address": address, "is_alive": True, "is_ready": True, "status_age_s": 5.0}]
    assert not fleet.worker_ready_at("router-1", "decode-0")  # the dead process's last word
    seen[:] = [{"address": address, "is_alive": True, "is_ready": True, "status_age_s": 0.3}]
    assert fleet.worker_ready_at("router-1", "decode-0")
    seen[:] = [{"address": address, "is_alive": True, "is_ready": False, "status_age_s": 0.3}]
    assert not fleet.worker_ready_at("router-1", "decode-0")
    seen[:] = [{"address": address, "is_alive": False, "is_ready": False}]
    assert not fleet.worker_ready_at("router-1", "decode-0")
    fleet.started_at["decode-1"] = fleet.started_at["decode-0"]
    assert not fleet.worker_ready_at("router-1", "decode-1")  # another worker's port
