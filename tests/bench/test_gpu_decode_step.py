"""benchmarks/gpu/decode_step.py, the GPU script's decode-step stage, run on CPU over the tiny
Llama: every pdserve engine variant reports a step per batch size, vLLM is named as skipped
where it is not installed, and an engine that fails is reported instead of ending the run."""

from __future__ import annotations

import json

from benchmarks.gpu import decode_step


def test_each_engine_reports_its_decode_step(llama_dir, tmp_path) -> None:
    output = tmp_path / "decode_step.json"
    decode_step.main(["--model", str(llama_dir), "--device", "cpu", "--batch-sizes", "1", "3",
                      "--num-steps", "4", "--prompt-tokens", "16", "--output", str(output),
                      "--timeout-s", "120"])
    result = json.loads(output.read_text())
    engines = result["engines"]
    for name in ("pdserve", "pdserve-eager", "pdserve-no-async"):
        rows = engines[name]["rows"]
        assert [row["batch"] for row in rows] == [1, 3], engines[name]
        # a difference of two timings: on a busy CPU it can come out below zero
        assert all(isinstance(row["step_ms"], float) for row in rows)
        assert engines[name]["device"] == "cpu"
    if not decode_step._has_vllm():
        assert engines["vllm"] == {"skipped": "vllm is not installed"}


def test_a_failing_engine_is_reported(tmp_path) -> None:
    output = tmp_path / "decode_step.json"
    decode_step.main(["--model", str(tmp_path / "missing"), "--device", "cpu",
                      "--engines", "pdserve-eager", "--output", str(output)])
    failed = json.loads(output.read_text())["engines"]["pdserve-eager"]["failed"]
    assert "CalledProcessError" in failed
