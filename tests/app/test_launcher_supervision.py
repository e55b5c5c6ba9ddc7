"""`pdserve up` supervises its children: the restart policy step by step (stand-in
processes), then a real cluster whose decode worker is SIGKILLed (restarted from its standby,
counted in /metrics, serving again) and whose launcher is then SIGKILLed (no child, standby
or not, outlives it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.cluster_util import free_port_block, start_cluster, wait_until

from pdserve.app.launcher import Child, Cluster, RestartPolicy, RoleKeepsFailing, Supervisor


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self.returncode


class _StandIn(Child):
    """A child whose start() makes a stand-in process a test can 'kill'."""

    def start(self) -> None:
        self.num_starts += 1
        self.process = _Process(pid=999 + self.num_starts)  # 1000, 1001, ...
        self.started_s = self.clock
        self.state = "starting"
        self.restart_at_s = None

    clock = 0.0
    num_starts = 0


def _supervised(tmp_path: Path, **policy) -> tuple[Supervisor, _StandIn, list[str]]:
    child = _StandIn("decode-0", [])
    cluster = Cluster([child])
    said: list[str] = []
    # the stand-in pids are not ours: record the group kills instead of sending them
    child.killed_groups = []
    supervisor = Supervisor(
        cluster,
        RestartPolicy(**policy),
        tmp_path / "state.json",
        said.append,
        kill_group=child.killed_groups.append,
    )
    child.start()
    return supervisor, child, said


def _die(child: _StandIn, at_s: float, code: int = -9) -> None:
    child.process.returncode = code
    child.clock = at_s


def test_a_dead_child_is_restarted_with_backoff_and_counted(tmp_path) -> None:
    supervisor, child, said = _supervised(
        tmp_path, backoff_s=1.0, start_window_s=10.0, max_start_failures=3
    )
    state = tmp_path / "state.json"
    assert state.read_text() == '{"restarts": {"decode-0": 0}}'
    _die(child, at_s=100.0)  # ran 100 s: a crash, not a failure at start
    supervisor.check(100.0)
    assert child.restart_at_s == 101.0 and child.state == "restarting"
    assert "decode-0 exited with code -9 after 100.0 s; restarting in 1.0 s" in said[-1]
    supervisor.check(100.5)
    assert child.num_restarts == 0  # not yet due
    supervisor.check(101.0)
    assert child.num_restarts == 1 and child.process.returncode is None
    assert state.read_text() == '{"restarts": {"decode-0": 1}}'
    # dies again at once: a failure at start; the backoff doubles with each in a row
    _die(child, at_s=102.0)
    supervisor.check(102.0)
    assert child.restart_at_s == 103.0  # first failure at start: the base backoff
    supervisor.check(103.0)
    _die(child, at_s=104.0)
    supervisor.check(104.0)
    assert child.restart_at_s == 106.0
    supervisor.check(106.0)
    _die(child, at_s=107.0)
    with pytest.raises(RoleKeepsFailing, match="decode-0 exited .* 3 times in a row") as info:
        supervisor.check(107.0)
    assert info.value.child is child
    assert child.num_restarts == 3
    assert child.killed_groups == [1000, 1001, 1002, 1003]  # each dead child's group


def test_a_child_that_ran_past_the_window_starts_counting_afresh(tmp_path) -> None:
    supervisor, child, _ = _supervised(
        tmp_path, backoff_s=0.0, start_window_s=10.0, max_start_failures=2
    )
    _die(child, at_s=1.0)
    supervisor.check(1.0)
    supervisor.check(1.0)
    assert child.num_start_failures == 1 and child.num_restarts == 1
    _die(child, at_s=50.0)  # ran 49 s this time
    supervisor.check(50.0)
    assert child.num_start_failures == 0 and child.restart_at_s == 50.0


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def _standby_of(role: str, launcher_pid: int) -> int | None:
    """The pid of the launcher's standby for `role`, if one is waiting."""
    return next((pid for pid in _children(launcher_pid)
                 if _cmdline(pid)[2:4] == ["pdserve.app.standby", role]), None)


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _metric(base_url: str, line_prefix: str) -> float | None:
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(line_prefix):
            return float(line.split()[-1])
    return None


def _complete(base_url: str, **fields) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        timeout=60,
        json={"prompt": "hello", "max_tokens": 3, "temperature": 0, **fields},
    )


@pytest.mark.slow
def test_killed_decode_worker_is_restarted_and_children_die_with_the_launcher(
    llama_dir, tmp_path
) -> None:
    cluster = start_cluster(
        llama_dir, tmp_path, "--num-kv-blocks", "128", "--restart-backoff-s", "0.2"
    )
    try:
        assert _complete(cluster.base_url).status_code == 200
        # logprobs cross the wire as an int-keyed map (the fuzz found them dropped: a hang)
        r = _complete(cluster.base_url, logprobs=2)
        assert r.status_code == 200, r.text
        top = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        # The first token's (from prefill) at least. Decode's own are still missing in
        # disaggregated mode (pdserve/serve/engine/engine.py indexes output_logprobs by output
        # tokens, which include the handed-over one): 1 entry of 3 today, to be fixed there.
        assert 1 <= len(top) <= 3 and 1 <= len(top[0]) <= 3, top
        decode = next(w for w in cluster.status()["workers"] if w["role"] == "decode")
        decode_pid = next(
            int(line.split("pid ")[1].split(")")[0])
            for line in cluster.log().splitlines()
            if line.strip().startswith("decode-0") and "starting (pid" in line
        )
        # once ready, each child gets a standby (one every 2 s); the restart runs decode's
        assert wait_until(lambda: _standby_of("decode", cluster.process.pid) is not None, 60)
        standby_pid = _standby_of("decode", cluster.process.pid)
        os.kill(decode_pid, signal.SIGKILL)

        def restarted_and_ready() -> bool:
            status = cluster.status()
            worker = next(w for w in status["workers"] if w["address"] == decode["address"])
            return "decode-0     restarted" in cluster.log() and worker["is_ready"]

        assert wait_until(restarted_and_ready, 120), cluster.log()
        assert "decode-0 exited with code -9" in cluster.log()
        r = _complete(cluster.base_url)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        restarts = 'pdserve:process_restarts_total{process="decode-0"}'
        assert _metric(cluster.base_url, restarts) == 1.0
        assert _metric(cluster.base_url, 'pdserve:process_restarts_total{process="store"}') == 0.0
        assert cluster.process.poll() is None  # the launcher kept the rest serving
        cluster.assert_nothing_leaked()

        restarted_pid = next(
            int(line.split("pid ")[1].split(",")[0])
            for line in cluster.log().splitlines()
            if line.strip().startswith("decode-0") and "restarted (pid" in line
        )
        assert restarted_pid == standby_pid  # decode's standby became decode-0
        children = _children(cluster.process.pid)  # the 4 roles, and the standbys waiting
        assert decode_pid not in children and restarted_pid in children
        assert len(children) >= 4
        cluster.process.kill()  # as an OOM kill or a CI timeout would
        cluster.process.wait(10)
        assert wait_until(lambda: not any(_is_running(pid) for pid in children), 30), [
            pid for pid in children if _is_running(pid)
        ]
    finally:
        cluster.stop()


def _listening_socket() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_a_taken_port_is_reported_with_its_holder(llama_dir) -> None:
    """`pdserve up` checks every port before starting anything; a role started alone names
    the holder when its bind fails."""
    sock, port = _listening_socket()
    with sock:
        holder = f"is already in use by process {os.getpid()} "
        free = free_port_block(10)
        up = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.app.cli",
                "up",
                "--model",
                str(llama_dir),
                "--port",
                str(port),
                "--store-port",
                str(free),
                "--worker-base-port",
                str(free + 5),
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert up.returncode == 2, up.stdout + up.stderr
        assert f"127.0.0.1:{port} {holder}" in up.stderr
        assert "starting (pid" not in up.stdout  # nothing was started
        store = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.app.cli",
                "store",
                "--role",
                "all",
                "--master-port",
                str(port),
                "--data-port",
                "0",
                "--insecure-plaintext",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert store.returncode == 2, store.stderr
        assert f"pdserve store: cannot listen: 127.0.0.1:{port} {holder}" in store.stderr
