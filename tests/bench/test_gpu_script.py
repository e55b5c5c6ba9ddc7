"""benchmarks/gpu/run.sh's promises, read from the script (it needs a GPU to run in earnest;
`run.sh --rehearse` runs it on CPU): its stages fit one device command of 600 s with time to
spare, it writes at most 8 files, a trap kills the running stage's process group, every @gpu
test is in some stage, and the served stage names the client that measured each number and
leaves no server behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu import served

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "benchmarks/gpu/run.sh").read_text()
DEVICE_FILES_BACK = 8  # the device tool returns at most 8 files from $OUT


def _assignment(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)", SCRIPT, re.MULTILINE)
    assert match, name
    return match.group(1)


def _array(name: str) -> list[str]:
    """A bash array's words, comments dropped."""
    match = re.search(rf"^{name}=\((.*?)^\)", SCRIPT, re.MULTILINE | re.DOTALL)
    assert match, name
    return " ".join(line.split("#")[0] for line in match.group(1).splitlines()).split()


def test_the_stages_fit_one_device_command_with_time_to_spare():
    limits = dict(entry.split("=") for entry in _array("STAGE_LIMITS"))
    assert list(limits) == ["wheels", "tests", "gpu-tests", "kernels", "engine", "decode-step",
                            "served"]
    command_s, spare_s = int(_assignment("COMMAND_LIMIT_S")), int(_assignment("SPARE_S"))
    assert command_s == 600 and spare_s >= 60
    assert sum(map(int, limits.values())) <= command_s - spare_s
    for name in limits:  # each stage runs under its limit
        assert re.search(rf"stage {name} ", SCRIPT), name


def test_at_most_eight_files_come_back():
    names = set(re.findall(r'\$OUT/([\w.-]+)"', SCRIPT))  # summary.json: SUMMARY="$OUT/..."
    assert names == {"log.txt", "summary.json", "bench_attention.json", "decode_step.json",
                     "served.json"}
    assert len(names) <= int(_assignment("MAX_OUT_FILES")) <= DEVICE_FILES_BACK
    # the served stage's logs and per-rate results go elsewhere
    runs = SCRIPT.count("stage served ")
    assert runs == 2 and SCRIPT.count('--work-dir "$WORK/served"') == runs


def test_a_trap_kills_the_running_stages_process_group():
    assert re.search(r"""^trap '[^']*stop_stage[^']*' EXIT""", SCRIPT, re.MULTILINE)
    assert re.search(r"^trap stopped TERM INT", SCRIPT, re.MULTILINE)
    stopped = SCRIPT.split("\nstopped() {")[1].split("\n}")[0]
    assert "stop_stage" in stopped and "summarize" in stopped and "exit 143" in stopped
    assert 'kill -KILL -- "-$STAGE_PID"' in SCRIPT
    # the stage runs in the background (so the trap runs at once), led by timeout's own group
    assert re.search(r'timeout -k \d+ "\$limit" "\$@" .*&\n\s*STAGE_PID=\$!', SCRIPT)


def test_the_summary_is_written_after_every_stage():
    body = SCRIPT.split("\nstage() {")[1].split("\n}")[0]
    assert body.rstrip().endswith("summarize")


def test_every_gpu_test_is_in_a_stage():
    selected = {*_array("GPU_TEST_FILES"), *_array("KERNEL_TESTS"), _assignment("ENGINE_TEST")}
    marked = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
              if re.search(r"^@pytest\.mark\.gpu|^pytestmark = .*mark\.gpu", path.read_text(),
                           re.MULTILINE)}
    assert marked, "no @gpu test found"
    for path in marked:
        assert path in selected or any(path.startswith(f"{folder}/") for folder in selected), path


def test_the_served_stage_names_its_client(monkeypatch, tmp_path):
    monkeypatch.setattr(served.shutil, "which", lambda name: None)
    assert served.choose_client("auto") == "pdserve"
    with pytest.raises(SystemExit, match="no `vllm` command"):
        served.choose_client("vllm")  # never a silent swap
    monkeypatch.setattr(served.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert served.choose_client("auto") == "vllm"

    def no_server(command, log, *args, **kwargs):
        log.write_text("no GPU here\n")
        raise RuntimeError("not ready")

    monkeypatch.setattr(served.shutil, "which", lambda name: None)
    monkeypatch.setattr(served.server_process, "start", no_server)
    output = tmp_path / "served.json"
    served.main(["--output", str(output), "--model", str(tmp_path), "--no-vllm",
                 "--work-dir", str(tmp_path / "work")])
    result = json.loads(output.read_text())
    assert result["client"] == "pdserve bench"
    assert result["colocated"] == {"error": "not ready", "log_tail": "no GPU here"}


PARENT = """
import socket, sys, time
from pathlib import Path
from pdserve.benchmarks import server_process
port = int(sys.argv[1])
process = server_process.start([sys.executable, "-m", "http.server", str(port), "--bind",
                                "127.0.0.1"], Path(sys.argv[2]), f"http://127.0.0.1:{port}/",
                               30, poll_s=0.1)
print(process.pid, flush=True)
time.sleep(60)
"""


def test_a_server_dies_with_the_benchmark_that_started_it(tmp_path):
    """A benchmark killed outright (SIGKILL: no finally runs) still takes its server, which
    runs in a session of its own, with it: the parent-death signal."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(port), str(tmp_path / "log")],
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        server_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _is_running(server_pid):
            time.sleep(0.1)
        assert not _is_running(server_pid)
    finally:
        parent.kill()


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
