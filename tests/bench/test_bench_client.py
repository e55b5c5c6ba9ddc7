"""The harness's client and CLI against a scripted in-process OpenAI-style SSE server.

It runs in the test's own event loop on 127.0.0.1 with an ephemeral port. Each request gets a
script (delay before the first token, gaps between tokens), and the server records on the same
perf_counter clock the client uses when it received the request and when each chunk was
written. Tests then compare the client's measurements with these recorded times, so their
tolerance covers only event-loop wake-up jitter, never the server's speed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers.bench_util import ScriptedSSEServer, TokenScript, cli, served_in_thread

from pdserve.benchmarks.bench_serve import run_load
from pdserve.benchmarks.client import EndpointConfig
from pdserve.benchmarks.datasets import BenchRequest
from pdserve.benchmarks.metrics import SLOConfig, output_token_counts, summarize

# -- tests -----------------------------------------------------------------------------------

# Client-observed times trail the server's write times by one event-loop wake-up (both run in
# this process, on one perf_counter clock). On an idle core that is ~0.1 ms; 50 ms covers a
# loaded 2-core box. Lower bounds are exact (a chunk cannot be read before it is written), and
# the checks that tell metrics apart rest on them (e.g. a TTFT that counted the role chunk
# would be ~0, not >= 120 ms), so the loose upper bound cannot hide a wrong metric.
JITTER_S = 0.05


def by_prompt(scripts: dict[str, TokenScript]) -> Callable[[dict], TokenScript]:
    def script_for(body: dict) -> TokenScript:
        prompt = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        return scripts[prompt]
    return script_for


async def test_completions_timings_match_the_scripted_server() -> None:
    scripts = {"a": TokenScript(0.15, (0.05, 0.05, 0.05)),
               "b": TokenScript(0.02, (0.10, 0.02, 0.02, 0.02))}
    async with ScriptedSSEServer(by_prompt(scripts)) as server, httpx.AsyncClient() as http:
        endpoint = EndpointConfig(server.base_url, "scripted", ignore_eos=True)
        requests = [BenchRequest("a", 3, 4), BenchRequest("b", 3, 5)]
        outcomes, duration_s = await run_load(http, endpoint, requests, [0.0, 0.0])
    assert [s.body["max_tokens"] for s in server.served] == [4, 5]
    assert all(s.body["ignore_eos"] and s.body["stream"] for s in server.served)
    for outcome, served in zip(outcomes, sorted(server.served, key=lambda s: s.body["prompt"]),
                               strict=True):
        sent = served.chunk_sent_s
        assert outcome.success and outcome.output_tokens == len(sent)
        assert outcome.prompt_len == 7  # the server's usage replaces the nominal length
        assert outcome.cached_tokens == 3
        # Each client time is at or just after the server's write of that chunk.
        expected_ttft_s = sent[0] - outcome.start_time_s
        assert expected_ttft_s <= outcome.ttft_s + 1e-3 <= expected_ttft_s + JITTER_S
        expected_itl_s = np.diff(sent)
        np.testing.assert_allclose(outcome.itl_s, expected_itl_s, atol=JITTER_S)
        assert outcome.latency_s == pytest.approx(sent[-1] - outcome.start_time_s,
                                                  abs=JITTER_S)
        assert outcome.generated_text == "".join(f" t{i}" for i in range(len(sent)))
    a, b = outcomes
    assert a.ttft_s >= 0.15 and b.ttft_s >= 0.02 and b.itl_s[0] >= 0.10
    tokens = output_token_counts(outcomes, lambda text: None)
    s = summarize(outcomes, tokens, duration_s, SLOConfig(ttft_ms=100))
    # TPOT of "a" spans its three 50 ms gaps; "b" spans 100 + 3 x 20 ms over 4 gaps.
    tpot_a_s = (a.latency_s - a.ttft_s) / 3
    tpot_b_s = (b.latency_s - b.ttft_s) / 4
    # TPOT is the server's decode span per token (first token excluded), and the scripted
    # sleeps are a floor on it: 50 ms for "a", (100 + 3 x 20) / 4 = 40 ms for "b".
    by_prompt_sent = {s.body["prompt"]: s.chunk_sent_s for s in server.served}
    for tpot_s, prompt, gaps, floor_s in ((tpot_a_s, "a", 3, 0.05), (tpot_b_s, "b", 4, 0.04)):
        sent = by_prompt_sent[prompt]
        assert tpot_s == pytest.approx((sent[-1] - sent[0]) / gaps, abs=JITTER_S / gaps * 2)
        assert tpot_s >= floor_s - 2e-3
    assert s["mean_tpot_ms"] == pytest.approx(500 * (tpot_a_s + tpot_b_s))
    assert s["mean_ttft_ms"] == pytest.approx(500 * (a.ttft_s + b.ttft_s))
    assert s["mean_itl_ms"] == pytest.approx(1000 * np.mean(a.itl_s + b.itl_s))
    assert s["slo_attainment"] == 0.5  # "a" waits 150 ms > 100 ms for its first token


async def test_chat_role_chunk_is_not_a_token() -> None:
    scripts = {"hi": TokenScript(0.12, (0.03, 0.03), send_usage=False)}
    async with ScriptedSSEServer(by_prompt(scripts)) as server, httpx.AsyncClient() as http:
        endpoint = EndpointConfig(server.base_url, "scripted", "/v1/chat/completions")
        outcomes, _ = await run_load(http, endpoint, [BenchRequest("hi", 1, 3)], [0.0])
    (outcome,), (served,) = outcomes, server.served
    assert served.path == "/v1/chat/completions"
    assert served.body["messages"] == [{"role": "user", "content": "hi"}]
    assert served.body["max_completion_tokens"] == 3
    # The role chunk went out at once; TTFT waits for the first content (>= 120 ms).
    assert outcome.ttft_s >= 0.12
    assert outcome.num_token_chunks == 3 and len(outcome.itl_s) == 2
    assert outcome.output_tokens is None  # no usage: the caller counts the text
    assert outcome.cached_tokens is None
    assert output_token_counts(outcomes, lambda t: len(t.split())) == [3]


async def test_goodput_counts_requests_meeting_every_slo() -> None:
    # 2 slow-first-token, 1 slow-decode, 3 fast: only the 3 fast meet ttft:100 tpot:60.
    scripts = {f"slow{i}": TokenScript(0.25, (0.01,)) for i in range(2)}
    scripts["slowdecode"] = TokenScript(0.0, (0.15, 0.15))
    scripts.update({f"fast{i}": TokenScript(0.0, (0.01, 0.01)) for i in range(3)})
    async with ScriptedSSEServer(by_prompt(scripts)) as server, httpx.AsyncClient() as http:
        endpoint = EndpointConfig(server.base_url, "scripted")
        requests = [BenchRequest(p, 1, 3) for p in scripts]
        outcomes, duration_s = await run_load(http, endpoint, requests, [0.0] * len(requests),
                                              max_concurrency=6)
    tokens = output_token_counts(outcomes, lambda text: None)
    s = summarize(outcomes, tokens, duration_s, SLOConfig(ttft_ms=100, tpot_ms=60))
    assert s["completed"] == 6
    assert s["slo_attainment"] == pytest.approx(3 / 6)
    assert s["request_goodput"] == pytest.approx(3 / duration_s)


async def test_http_errors_are_failed_requests() -> None:
    scripts = {"ok": TokenScript(0.0, (0.0,)), "bad": TokenScript(0.0, (), status=500)}
    async with ScriptedSSEServer(by_prompt(scripts)) as server, httpx.AsyncClient() as http:
        endpoint = EndpointConfig(server.base_url, "scripted")
        outcomes, duration_s = await run_load(
            http, endpoint, [BenchRequest("ok", 1, 2), BenchRequest("bad", 1, 2)], [0.0, 0.0])
    ok, bad = outcomes
    assert ok.success and not bad.success and bad.error.startswith("HTTP 500")
    s = summarize(outcomes, output_token_counts(outcomes, lambda t: None), duration_s,
                  SLOConfig(ttft_ms=1000))
    assert (s["completed"], s["failed"], s["slo_attainment"]) == (1, 1, 0.5)


# -- the CLI end to end (server on its own thread: the CLI runs its own event loop) ----------


@pytest.fixture
def threaded_server() -> Iterator[ScriptedSSEServer]:
    # Every request: 20 ms to the first token, then 3 tokens 10 ms apart.
    with served_in_thread(ScriptedSSEServer(
            lambda body: TokenScript(0.02, (0.01, 0.01, 0.01)))) as server:
        yield server


# vLLM's `bench serve` result fields that mean the same here (checked against vLLM 0.32).
VLLM_FIELDS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput",
    *(f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99")
      for metric in ("ttft", "tpot", "itl", "e2el")),
}


def test_cli_single_run_writes_vllm_shaped_json(threaded_server: ScriptedSSEServer,
                                                tmp_path: Path, capsys) -> None:
    rc = cli("--base-url", threaded_server.base_url, "--num-prompts", "4",
             "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
             "--request-rate", "50", "--goodput", "ttft:5000", "tpot:5000", "--save-result",
             "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json",
             "--disable-tqdm")
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms)" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert VLLM_FIELDS <= set(result)
    assert result["model_id"] == "scripted"  # taken from /v1/models
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 16 and result["slo_attainment"] == 1.0
    assert len(result["ttfts"]) == 4 and all(len(itl) == 3 for itl in result["itls"])
    # Exactly the 4 measured requests reached the server: no test request (as in vLLM).
    assert len(threaded_server.served) == 4
    for name in ("r-attainment.png", "r-ttft-cdf.png", "r-tpot-cdf.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_and_compare(threaded_server: ScriptedSSEServer, tmp_path: Path,
                               capsys) -> None:
    url = threaded_server.base_url
    rc = cli("--base-url", url, "--compare-base-url", url, "--label", "one",
             "--compare-label", "two", "--num-prompts", "3", "--random-input-len", "8",
             "--random-output-len", "4", "--goodput", "ttft:5000", "--sweep-rates", "20", "40",
             "--num-workers", "2", "--save-result", "--no-plots", "--result-dir",
             str(tmp_path), "--result-filename", "s.json", "--disable-tqdm")
    assert rc == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert [s["label"] for s in result["servers"]] == ["one", "two"]
    for server in result["servers"]:
        assert [r["request_rate"] for r in server["runs"]] == [20, 40]
        assert server["goodput_rate"] == 40 and server["goodput_rate_per_worker"] == 20
        assert server["goodput_rate_is_lower_bound"]  # 40 was the highest rate tried
    assert result["ratio"]["goodput_rate"] == 1.0
    out = capsys.readouterr().out
    assert "one / two" in out and "the highest rate tried" in out
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("fresh", [False, True])
def test_cli_sweep_fresh_prompts(threaded_server: ScriptedSSEServer, tmp_path: Path,
                                 fresh: bool) -> None:
    """--sweep-fresh-prompts: each rate gets its own prompts, so a prefix cache cannot serve
    a rate from the one before; without it every rate repeats the same prompts."""
    # Seed 2: vLLM's random prompts are windows at random offsets of the vocabulary, and
    # seeds 0 and 1 happen to draw one common window (vLLM does the same).
    rc = cli("--base-url", threaded_server.base_url, "--num-prompts", "3", "--seed", "2",
             "--random-input-len", "8", "--random-output-len", "4", "--goodput", "ttft:5000",
             "--sweep-rates", "20", "40", *(["--sweep-fresh-prompts"] if fresh else []),
             "--save-result", "--save-detailed", "--no-plots", "--result-dir", str(tmp_path),
             "--result-filename", "s.json", "--disable-tqdm")
    assert rc == 0
    prompts = [s.body["prompt"] for s in threaded_server.served]
    first, second = set(prompts[:3]), set(prompts[3:])
    assert len(first) == len(second) == 3
    assert first.isdisjoint(second) if fresh else first == second
    runs = json.loads((tmp_path / "s.json").read_text())["servers"][0]["runs"]
    assert all(r["cached_lens"] == [3, 3, 3] for r in runs)


def test_cli_ready_check_and_warmups_send_the_first_prompt_unmeasured(
        threaded_server: ScriptedSSEServer, tmp_path: Path) -> None:
    rc = cli("--base-url", threaded_server.base_url, "--num-prompts", "3", "--seed", "4",
             "--random-input-len", "6", "--ready-check-timeout-sec", "5", "--num-warmups", "2",
             "--max-concurrency", "1",  # the measured three arrive in their order
             "--save-result", "--no-plots", "--result-dir", str(tmp_path),
             "--result-filename", "w.json", "--disable-tqdm")
    assert rc == 0
    prompts = [s.body["prompt"] for s in threaded_server.served]
    # 1 ready check + 2 warmups of the first prompt, then the 3 measured.
    assert len(prompts) == 6 and prompts[:4] == [prompts[3]] * 4
    assert json.loads((tmp_path / "w.json").read_text())["completed"] == 3


def test_cli_unreachable_compare_server_fails_before_measuring(
        threaded_server: ScriptedSSEServer, capsys) -> None:
    rc = cli("--base-url", threaded_server.base_url, "--compare-base-url", "http://127.0.0.1:9",
             "--model", "m", "--num-prompts", "2", "--random-input-len", "4",
             "--disable-tqdm")
    assert rc == 1 and "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    assert not threaded_server.served  # nothing measured: the second URL failed first


@pytest.mark.parametrize("argv, rc, message", [
    (["--goodput", "ttft"], 2, "KEY:MS"),
    (["--sweep-rates", "1", "2"], 2, "needs SLOs"),
    (["--sweep-fresh-prompts"], 2, "needs --sweep-rates"),
    (["--dataset-name", "mooncake"], 2, "--dataset-path"),
    (["--base-url", "localhost:8000"], 2, "http://"),
    (["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--random-input-len", "4"],
     1, "cannot reach"),
])
def test_cli_errors_are_messages_not_tracebacks(argv: list[str], rc: int, message: str,
                                                capsys) -> None:
    assert cli(*argv, "--model", "m") == rc
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_replays_a_mooncake_trace(threaded_server: ScriptedSSEServer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(e) + "\n" for e in [
        {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 1500, "output_length": 32, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 512, "output_length": 32, "hash_ids": [3]},
    ]))
    rc = cli("--base-url", threaded_server.base_url, "--dataset-name", "mooncake",
             "--dataset-path", str(trace), "--block-size", "8", "--time-scale", "0.05",
             "--goodput", "ttft:5000", "--save-result", "--result-dir", str(tmp_path),
             "--result-filename", "t.json", "--disable-tqdm")
    assert rc == 0
    # CDFs yes; no attainment-vs-rate plot, since a trace has no rate.
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["t-tpot-cdf.png", "t-ttft-cdf.png"]
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["request_rate"] == "trace" and result["completed"] == 3
    measured = threaded_server.served
    prompts = [s.body["prompt"] for s in measured]
    assert [s.body["max_tokens"] for s in measured] == [1, 1, 1]  # 64 / 64 rounds to 1
    # The scaled send offsets are unit-tested in test_bench_workloads: wall-clock gaps here
    # would make this test depend on the box's load. The prompts below arrive in trace order.
    # Ids 0, 1 are shared: the second prompt extends the first (two full 8-token blocks).
    assert prompts[1].startswith(prompts[0]) and len(prompts[1]) > len(prompts[0])
    assert not prompts[2].startswith(prompts[0][:8])
