"""`pdserve bench` draws the workload `vllm bench serve` draws: the same prompts (text, token
counts, max_tokens) sent at the same times, for the same flags and seed.

- Against a fixture recorded from vLLM 0.32 itself (tests/data/vllm_workload.json, made by
  benchmarks/record_vllm_workload.py with vLLM's own sampling and arrival code on a
  virtual clock): every prompt and every send offset must be equal, bit for bit.
- On a recording server: what pdserve bench actually sends, in order.
- Live, when the vLLM peer is installed (/tmp/vllm-peer): both clients against recording
  servers with the same flags; their request logs must match.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.bench_util import ScriptedSSEServer, TokenScript, cli, served_in_thread
from helpers.paths import TEST_DATA

from pdserve.benchmarks import bench_serve
from pdserve.benchmarks.datasets import TokenCodec

DATA = TEST_DATA
FIXTURE = json.loads((DATA / "vllm_workload.json").read_text())
TOKENIZER_DIR = DATA / FIXTURE["tokenizer"]
VLLM_BIN = Path(os.environ.get("PDSERVE_VLLM_PEER_VENV", "/tmp/vllm-peer")) / "bin" / "vllm"
CASES = {case["name"]: case for case in FIXTURE["cases"]}


@pytest.fixture(scope="module")
def codec() -> TokenCodec:
    return TokenCodec.load(str(TOKENIZER_DIR))


def parse_flags(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(flags)


@pytest.mark.parametrize("name", sorted(CASES))
def test_draws_equal_vllms_recorded_draws(name: str, codec: TokenCodec) -> None:
    case = CASES[name]
    args = parse_flags(case["flags"])  # vLLM's flag names, parsed by pdserve bench
    workload = bench_serve.build_workload(args, codec)
    assert [r.prompt for r in workload.requests] == case["prompts"]
    assert [r.prompt_len for r in workload.requests] == case["prompt_lens"]
    assert [r.expected_output_len for r in workload.requests] == case["output_lens"]
    offsets_s = bench_serve._offsets(workload, args.request_rate, args)
    assert offsets_s.tolist() == case["arrival_offsets_s"]  # exact: same draws, same sums


def test_fixture_exercises_the_hard_paths() -> None:
    """The fixture is only as strong as its cases: lengths vary with the range ratio, gaps
    are gamma (bursty) as well as Poisson, and prefix_repetition shares its prefixes."""
    assert FIXTURE["vllm_version"].startswith("0.32")
    assert len(set(CASES["random-gamma-range-prefix"]["prompt_lens"])) > 3
    gaps = np.diff(CASES["random-gamma-range-prefix"]["arrival_offsets_s"])
    assert gaps.std() / gaps.mean() > 1.0  # burstiness 0.5: CV ~ 1.4
    assert CASES["random-inf-rate"]["arrival_offsets_s"] == [0.0] * 6
    prompts = CASES["prefix-repetition"]["prompts"]
    assert len(prompts) == 12 and len({p[:40] for p in prompts}) == 3


# -- what actually goes on the wire -----------------------------------------------------------


def recording() -> contextlib.AbstractContextManager[ScriptedSSEServer]:
    """A server that records every request's body and arrival time and answers two tokens."""
    return served_in_thread(ScriptedSSEServer(lambda body: TokenScript(0.0, (0.0,)), model="rec"))


@pytest.fixture
def recording_server() -> Iterator[ScriptedSSEServer]:
    with recording() as server:
        yield server


def wire_log(server: ScriptedSSEServer) -> list[dict]:
    """The measured requests as the server saw them: body fields and arrival offset."""
    measured = server.served  # neither client sends a test request by default
    first_s = measured[0].received_s
    return [
        {
            "prompt": s.body["prompt"],
            "max_tokens": s.body["max_tokens"],
            "ignore_eos": s.body.get("ignore_eos"),
            "offset_s": s.received_s - first_s,
        }
        for s in measured
    ]


def test_pdserve_bench_sends_the_fixture_prompts_in_order(
    recording_server: ScriptedSSEServer,
) -> None:
    case = CASES["random-poisson"]
    rc = cli(
        "--base-url",
        recording_server.base_url,
        "--tokenizer",
        str(TOKENIZER_DIR),
        *case["flags"],
        "--disable-tqdm",
    )
    assert rc == 0
    log = wire_log(recording_server)
    assert [r["prompt"] for r in log] == case["prompts"]
    assert [r["max_tokens"] for r in log] == case["output_lens"]
    # --dataset-name random turns ignore_eos on, as vLLM does.
    assert all(r["ignore_eos"] is True for r in log)


@pytest.mark.skipif(not VLLM_BIN.exists(), reason="vLLM peer not installed (/tmp/vllm-peer)")
def test_live_vllm_and_pdserve_send_the_same_requests_and_measure_the_same(
    tmp_path: Path,
) -> None:
    """Both clients, same flags, each against its own recording server whose latencies are
    scripted (60 ms to the first token, then 20 ms per token): the same prompts, max_tokens
    and ignore_eos in the same order, sent at the same times, and mean TTFT, TPOT and E2EL
    within 5% (what is left of a difference is each client's own overhead)."""
    flags = [
        "--dataset-name", "random", "--num-prompts", "64", "--seed", "9",
        "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.3",
        "--request-rate", "20", "--burstiness", "0.7",
    ]  # fmt: skip
    results, logs = {}, {}
    for tool in ("vllm", "pdserve"):
        scripted = ScriptedSSEServer(lambda body: TokenScript(0.06, (0.02,) * 7), model="rec")
        with served_in_thread(scripted) as server:
            common = [
                *("--base-url", server.base_url, "--model", "rec"),
                *("--tokenizer", str(TOKENIZER_DIR), *flags, "--disable-tqdm"),
                *("--save-result", "--result-dir", str(tmp_path)),
                *("--result-filename", f"{tool}.json"),
            ]
            if tool == "vllm":
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
                subprocess.run(
                    [str(VLLM_BIN), "bench", "serve", "--backend", "openai", *common,
                     "--percentile-metrics", "ttft,tpot,itl,e2el"],
                    env=env, check=True, capture_output=True, timeout=240,
                )  # fmt: skip
            else:
                assert cli(*common, "--no-plots") == 0
            logs[tool] = wire_log(server)
        results[tool] = json.loads((tmp_path / f"{tool}.json").read_text())

    # Matched by prompt, not by arrival order: bursty gaps can be under a millisecond, and two
    # requests that close may reach the server in either order.
    def by_prompt(log: list[dict]) -> list[dict]:
        return sorted(log, key=lambda r: (r["prompt"], r["offset_s"]))

    pdserve_log, vllm_log = by_prompt(logs["pdserve"]), by_prompt(logs["vllm"])
    for field in ("prompt", "max_tokens", "ignore_eos"):
        assert [r[field] for r in pdserve_log] == [r[field] for r in vllm_log]
    # Send times: the schedules are equal (the fixture test); what is left is each client's
    # wake-up lag, a few ms on an idle core. 100 ms allows a loaded box while still telling
    # two different draws apart (offsets spread over 3.2 s).
    vllm_s = np.array([r["offset_s"] for r in vllm_log])
    pdserve_s = np.array([r["offset_s"] for r in pdserve_log])
    print("max |send-time difference| (ms):", 1000 * np.abs(vllm_s - pdserve_s).max())
    np.testing.assert_allclose(pdserve_s, vllm_s, atol=0.1)
    for metric in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms"):
        print(metric, results["pdserve"][metric], results["vllm"][metric])
        assert results["pdserve"][metric] == pytest.approx(results["vllm"][metric], rel=0.05)
    # The scripted times bound both from below: TTFT >= 60 ms, TPOT >= 20 ms.
    assert results["pdserve"]["mean_ttft_ms"] >= 60 and results["vllm"]["mean_tpot_ms"] >= 20
