"""Standbys (pdserve/app/standby.py): a supervised child's next incarnation, its imports done,
waiting. It serves nothing until told; told, it is the role (same process); its input ended,
it exits without serving; the supervisor keeps one per ready child and restarts from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers.cluster_util import free_port_block, wait_until

from pdserve.app.launcher import (
    Child,
    Cluster,
    RestartPolicy,
    Supervisor,
    activate,
    spawn,
    stop_standby,
)
from pdserve.kvstore.client import StoreClient
from pdserve.ports import PortInUse, check_port_free


def store_argv(port: int) -> list[str]:
    return ["store", "--role", "all", "--master-port", str(port), "--data-port", "0",
            "--transport", "zmq", "--insecure-plaintext"]


def answers(port: int) -> bool:
    client = StoreClient(None, f"tcp://127.0.0.1:{port}", transport="zmq", timeout_s=1.0)
    try:
        return "num_nodes" in client.stats()
    except Exception:  # not listening (yet)
        return False
    finally:
        client.close()


def is_free(port: int) -> bool:
    try:
        check_port_free("127.0.0.1", port)
    except PortInUse:
        return False
    return True


@pytest.fixture(autouse=True)
def plaintext(monkeypatch):
    monkeypatch.setenv("PDSERVE_INSECURE_PLAINTEXT", "1")


def test_a_standby_serves_only_once_told_and_is_then_the_role(tmp_path):
    port = free_port_block(1)
    with open(tmp_path / "store.log", "ab") as log:
        standby = spawn(store_argv(port), dict(os.environ), standby=True, stdout=log.fileno())
    try:
        assert not wait_until(lambda: not is_free(port) or standby.poll() is not None, 3.0)
        assert activate(standby)
        assert wait_until(lambda: answers(port), 60), (tmp_path / "store.log").read_text()
        assert standby.poll() is None  # the standby itself serves: no other process
        assert not activate(standby)  # told once; its input is closed
    finally:
        standby.terminate()
        standby.wait(20)
    assert standby.returncode == 0


def test_a_standby_whose_input_ends_exits_without_serving(tmp_path):
    port = free_port_block(1)
    standby = spawn(store_argv(port), dict(os.environ), standby=True)
    standby.stdin.close()
    assert standby.wait(60) == 0 and is_free(port)


def test_a_standby_stopped_by_its_supervisor_ends_without_serving():
    """At once after its start (SIGTERM before its interpreter set a handler: the default
    action) or once it waits (its handler: exit 0)."""
    for settle in (False, True):
        port = free_port_block(1)
        standby = spawn(store_argv(port), dict(os.environ), standby=True)
        if settle:
            assert not wait_until(lambda s=standby: s.poll() is not None, 2.0)
        stop_standby(standby, timeout_s=60)
        assert standby.returncode in (0, -signal.SIGTERM) and is_free(port)


# A standby that tells the test (on stderr) once its imports are done and their thread has
# ended: it then waits on stdin, its main thread alone. (Told from inside the nice-19 imports'
# thread, the test raced that thread's last steps: on a busy host it held the interpreter
# lock while starved, and the main thread could not run the stop's handler for 60 s.)
PRELOADED = """
import sys
from pdserve.app import standby
real_preload_quietly = standby.preload_quietly
def preload_quietly(argv):
    error = real_preload_quietly(argv)
    print("preloaded", file=sys.stderr, flush=True)
    return error
standby.preload_quietly = preload_quietly
sys.exit(standby.main())
"""


# One whose imports never end once they said so: a thread at nice 19 on a busy host, which
# sleeps (the lock released), as a thread waiting on the disk does.
STARVED = """
import sys, time
from pdserve.app import standby
real_preload = standby.preload
def preload(argv):
    real_preload(argv)
    print("preloaded", file=sys.stderr, flush=True)
    time.sleep(3600)
standby.preload = preload
sys.exit(standby.main())
"""


@pytest.mark.parametrize("program", [PRELOADED, STARVED], ids=["waiting", "importing"])
def test_a_standby_stopped_before_it_serves_exits_0_at_once(program):
    """A supervisor may stop a standby with SIGTERM (stopping its process group) rather than
    by ending its input: it exits 0, not by the default action (-15), and does not first wait
    for its imports' thread (CI once waited 60 s for one)."""
    port = free_port_block(1)
    standby = subprocess.Popen([sys.executable, "-c", program, *store_argv(port)],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert standby.stderr.readline() == "preloaded\n"
        standby.terminate()
        assert standby.wait(60) == 0
    finally:
        if standby.poll() is None:
            standby.kill()
            standby.wait()
        standby.stdin.close()
        standby.stderr.close()
    assert is_free(port)


def test_a_command_without_a_standby_is_refused():
    out = subprocess.run([sys.executable, "-m", "pdserve.app.standby", "bench", "--help"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "no standby for ['bench']" in out.stderr


def test_the_supervisor_restarts_a_ready_child_from_its_standby(tmp_path):
    port = free_port_block(1)
    child = Child("store", store_argv(port))
    cluster = Cluster([child])
    said: list[str] = []
    supervisor = Supervisor(cluster, RestartPolicy(backoff_s=0.0), tmp_path / "state.json",
                            said.append, standbys=True)
    try:
        child.start()
        assert wait_until(lambda: answers(port), 60)
        supervisor.check(0.0)
        assert child.standby is None  # not ready yet (the launcher's poll says when)
        child.state = "ready"
        supervisor.check(0.0)
        standby_pid = child.standby.pid
        assert child.standby.poll() is None and standby_pid != child.process.pid
        child.process.kill()
        child.process.wait(10)
        supervisor.check(100.0)  # dead: restart due at once (backoff 0)
        supervisor.check(100.0)
        assert child.process.pid == standby_pid and child.standby is None
        assert wait_until(lambda: answers(port), 60)
        assert "store        restarted" in said[-1]
    finally:
        cluster.stop()
    assert child.process.returncode == 0


def test_a_child_whose_standby_keeps_exiting_gets_no_more(tmp_path):
    """A standby that exits unasked (here: a command with none) is noted; after
    MAX_STANDBY_FAILURES the supervisor stops starting them for that child, and says so."""
    from pdserve.app.launcher.supervision import MAX_STANDBY_FAILURES

    child = Child("bench", ["bench"])  # no standby for it: each exits with code 2
    child.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child.state = "ready"
    said: list[str] = []
    supervisor = Supervisor(Cluster([child]), RestartPolicy(), tmp_path / "state.json",
                            said.append, standbys=True)
    try:
        now_s = 0.0
        for _ in range(MAX_STANDBY_FAILURES):
            supervisor.check(now_s)
            assert child.standby is not None
            child.standby.wait(60)
            now_s += 10.0
        supervisor.check(now_s)
        assert child.num_standby_failures == MAX_STANDBY_FAILURES and child.standby is None
        assert said[-1].endswith(f"standby exited (code 2) {MAX_STANDBY_FAILURES} times: "
                                 "its restarts start afresh")
        supervisor.check(now_s + 10.0)
        assert child.standby is None and len(said) == 1
    finally:
        child.process.kill()
        child.process.wait(10)


def test_a_standby_imports_at_the_lowest_priority_and_serves_at_its_own(monkeypatch):
    """The imports run on a thread at nice 19 and in the idle I/O class, so a standby started
    beside serving processes takes only what they leave; the main thread, which later runs
    the role, keeps the process's priority."""
    import ctypes
    import threading

    from pdserve.app import standby

    seen = {}

    def record(argv):
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        ioprio_get = {"x86_64": 252, "aarch64": 31}.get(os.uname().machine)
        if ioprio_get is not None:
            seen["io_class"] = ctypes.CDLL(None).syscall(ioprio_get, 1, tid) >> 13

    monkeypatch.setattr(standby, "preload", record)
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert standby.preload_quietly(["store"]) is None
    assert seen["nice"] == 19
    assert seen.get("io_class", 3) == 3  # IOPRIO_CLASS_IDLE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice


def test_standbys_wait_until_every_child_is_ready(tmp_path):
    """A ready child gets no standby while another child still starts (or restarts)."""
    ready = Child("bench", ["bench"])
    starting = Child("bench", ["bench"])
    ready.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    starting.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ready.state = "ready"
    supervisor = Supervisor(Cluster([ready, starting]), RestartPolicy(),
                            tmp_path / "state.json", lambda _: None, standbys=True)
    try:
        supervisor.check(0.0)
        assert ready.standby is None and starting.standby is None
        starting.state = "ready"
        supervisor.check(10.0)
        assert ready.standby is not None
    finally:
        for child in (ready, starting):
            child.drop_standby()
            child.process.kill()
            child.process.wait(10)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/autogroup"),
                    reason="needs root and scheduler autogroups")
def test_a_standby_session_waits_at_nice_19_and_serves_at_0():
    """Autogroups share the CPU by session: a standby (a session of its own) lowers its whole
    session while it imports and waits, and sets it back when told to run its role."""
    code = ("import os; from pdserve import lifecycle; "
            "assert lifecycle.set_session_nice(19); print(open('/proc/self/autogroup').read()); "
            "assert lifecycle.set_session_nice(0); print(open('/proc/self/autogroup').read())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert done.returncode == 0, done.stderr
    lowered, restored = [line for line in done.stdout.splitlines() if line.strip()]
    assert lowered.endswith("nice 19") and restored.endswith("nice 0")
    # a process in its parent's session leaves the session (its parent's too) alone
    inside = subprocess.run([sys.executable, "-c", "from pdserve import lifecycle; "
                             "assert not lifecycle.set_session_nice(19)"],
                            capture_output=True, text=True, timeout=60)
    assert inside.returncode == 0, inside.stderr
