"""`pdserve profile --served`: calibrate an engine-only profile against the served system.

An engine-only sweep times the forward and nothing around it. Served, the same instance also
shares its cores with the router, the detokenizer, the store and the client, and a request pays
the hand-off between the pools and the router's own time before its first token. On this
project's 2-core machines that made the offline plan 36% optimistic on 1P1D
(docs/benchmarks.md, "Planner and controller accuracy"). Dynamo's profiler measures on a real
deployment for the same reason; this does it in two steps, keeping the engine sweep's shape:

1. start `pdserve up` at 1P1D with the profile's TP degree (each worker pinned to cores of its
   own, as served), the router's goodput controller starting from the engine profile;
2. drive it with `pdserve bench` (fresh random prompts, a few Poisson rates), then read what
   the controller fitted from the served steps (`/status` -> controller.profile), and
3. scale each phase's engine model by served / engine time at the calibration workload's
   points, and take the hand-off and first-token overhead the controller measured.

The scaled models keep the engine sweep's dependence on prompt length and batch (the served
fit sees one workload and cannot separate them); the factors carry what serving adds.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.planner.goodput_model import LinearLatency
from pdserve.planner.latency_profile import LatencyProfile, ProfileError

CALIBRATION_DECODE_BATCHES = (1, 2, 4, 8, 16)
"""Batch sizes at which served and engine decode steps are compared: what a served decode
instance runs at the calibration's rates."""


@dataclass(frozen=True)
class ServedWorkload:
    input_len: int = 256
    output_len: int = 32
    rates: tuple[float, ...] = (1.0, 2.0, 3.0)
    num_prompts: int = 24
    """Requests per rate (fresh prompts for each)."""
    port: int = 18780
    """The router's port; the workers and store take the ten after it."""
    ready_timeout_s: float = 300.0
    controller_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 2 or self.num_prompts < 1:
            raise ValueError("--served-input-len >= 1, --served-output-len >= 2 and "
                             "--served-num-prompts >= 1")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("--served-rates must be positive")


@dataclass(frozen=True)
class Calibration:
    tp: int
    prefill_factor: float
    decode_factor: float
    handoff_s: float
    ttft_overhead_s: float
    served: dict[str, Any] = field(default_factory=dict)
    """The controller's exported profile, as /status gave it."""

    def describe(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "prefill_factor": round(self.prefill_factor, 4),
            "decode_factor": round(self.decode_factor, 4),
            "handoff_s": round(self.handoff_s, 5),
            "ttft_overhead_s": round(self.ttft_overhead_s, 5),
        }


def _ratio(served: LinearLatency, engine: LinearLatency,
           points: Sequence[tuple[float, float]]) -> float:
    """Mean of served / engine step time over `points` (feature pairs)."""
    ratios = [served(*p) / engine(*p) for p in points if engine(*p) > 0]
    if not ratios:
        raise ProfileError("the engine model predicts no time at the calibration points")
    return statistics.fmean(ratios)


def calibrate(engine: LatencyProfile, served: LatencyProfile, tp: int,
              workload: ServedWorkload) -> Calibration:
    """The factors that turn `engine`'s TP-`tp` models into the served ones at `workload`'s
    points: a prefill of one prompt of input_len tokens (tokens, Σ q·k = L²), and decode
    steps of B sequences at the workload's mean context, B in CALIBRATION_DECODE_BATCHES."""
    if tp not in engine.prefill or tp not in served.prefill or tp not in served.decode:
        raise ProfileError(f"TP {tp} is missing from the engine or the served profile")
    length = workload.input_len
    prefill = _ratio(served.prefill[tp], engine.prefill[tp], [(length, length * length)])
    context = workload.input_len + workload.output_len / 2
    decode = _ratio(served.decode[tp], engine.decode[tp],
                    [(b * context, b) for b in CALIBRATION_DECODE_BATCHES])
    return Calibration(tp=tp, prefill_factor=prefill, decode_factor=decode,
                       handoff_s=served.handoff_s or 0.0,
                       ttft_overhead_s=served.ttft_overhead_s or 0.0,
                       served=served.to_dict())


def _scaled(model: LinearLatency, factor: float) -> LinearLatency:
    return LinearLatency(model.intercept * factor, tuple(c * factor for c in model.coefs),
                         num_samples=model.num_samples, rel_error=model.rel_error)


def apply(engine: LatencyProfile, calibrations: Sequence[Calibration]) -> LatencyProfile:
    """`engine` with each calibrated TP degree's models scaled, the fixed times from the
    calibration (the largest, when several degrees were calibrated), and the calibration
    recorded under `served_calibration`. Degrees not calibrated keep their engine models."""
    if not calibrations:
        return engine
    prefill = dict(engine.prefill)
    decode = dict(engine.decode)
    for c in calibrations:
        prefill[c.tp] = _scaled(prefill[c.tp], c.prefill_factor)
        decode[c.tp] = _scaled(decode[c.tp], c.decode_factor)
    extra = dict(engine.extra)
    extra["served_calibration"] = [c.describe() for c in calibrations]
    return LatencyProfile(
        model=engine.model,
        hardware=engine.hardware + ", calibrated served (pdserve up 1P1D)",
        kv_bytes_per_token=engine.kv_bytes_per_token,
        prefill=prefill,
        decode=decode,
        kv_transfer_bytes_per_s=engine.kv_transfer_bytes_per_s,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
        handoff_s=max(c.handoff_s for c in calibrations),
        ttft_overhead_s=max(c.ttft_overhead_s for c in calibrations),
        source=(engine.source or "pdserve profile") + "; served calibration",
        extra=extra,
    )


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve.app.cli"]


def _wait_ready(process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {process.returncode} before it was "
                               f"ready; its log: {log}\n{_tail(log)}")
        if "pdserve is ready" in log.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"pdserve up was not ready within {timeout_s:.0f} s; its log: {log}")


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _served_profile(base_url: str, tp: int, timeout_s: float) -> LatencyProfile:
    """What the controller fitted, once it has both phases at TP `tp` (polled until then)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{base_url}/status", timeout=10).json()
            data = (status.get("controller") or {}).get("profile") or {}
            if "error" not in data and data:
                profile = LatencyProfile.from_dict(data)
                if tp in profile.prefill and tp in profile.decode:
                    return profile
            last = json.dumps(data)[:200]
        except (httpx.HTTPError, ValueError, ProfileError) as exc:
            last = str(exc)
        time.sleep(1.0)
    raise RuntimeError(f"the router's controller fitted no served profile within "
                       f"{timeout_s:.0f} s (last: {last})")


def measure(model_dir: str, tp: int, engine_profile: Path, workload: ServedWorkload,
            log_dir: Path | None = None, progress: Any = print) -> LatencyProfile:
    """Serve `model_dir` at 1P1D TP `tp`, drive the workload, return the controller's fit."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-profile-served-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"up-tp{tp}.log"
    port = workload.port
    base_url = f"http://127.0.0.1:{port}"
    up = [*_pdserve(), "up", "--model", model_dir, "--port", str(port),
          "--worker-base-port", str(port + 2), "--store-port", str(port + 8),
          "--num-prefill", "1", "--num-decode", "1", "--prefill-tp", str(tp),
          "--decode-tp", str(tp), "--controller", "recommend",
          "--controller-profile", str(engine_profile),
          "--controller-interval-s", str(workload.controller_interval_s)]
    with open(log, "wb") as out:
        process = subprocess.Popen(up, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        _wait_ready(process, log, workload.ready_timeout_s)
        bench = [*_pdserve(), "bench", "--base-url", base_url, "--tokenizer", model_dir,
                 "--dataset-name", "random", "--random-input-len", str(workload.input_len),
                 "--random-output-len", str(workload.output_len), "--ignore-eos",
                 "--disable-tqdm", "--request-timeout", "120"]
        for i, rate in enumerate(workload.rates):
            progress(f"served calibration TP{tp}: {workload.num_prompts} requests at "
                     f"{rate:g} req/s ({i + 1}/{len(workload.rates)})")
            with open(log_dir / f"bench-tp{tp}-{rate:g}.log", "wb") as out:
                done = subprocess.run(
                    [*bench, "--num-prompts", str(workload.num_prompts), "--request-rate",
                     str(rate), "--seed", str(1000 + i)],
                    stdout=out, stderr=subprocess.STDOUT, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"pdserve bench failed (rc {done.returncode}); its log: "
                                   f"{log_dir / f'bench-tp{tp}-{rate:g}.log'}")
        # one controller tick after the last request, so the fit covers every step
        time.sleep(workload.controller_interval_s + 1)
        return _served_profile(base_url, tp, timeout_s=60)
    finally:
        _stop(process)
