"""A one-rank CPU engine serves at once and switches to its fast path between two steps once a
child process has built the kernels and measured the paths
(pdserve/serve/executor/cpu_preparation.py).

"A fresh machine" here: this process sees no kernel library (its build directory is pointed at
an empty folder, and a build in this process fails the test) and an empty tuning cache; the
child sees the library the session built, so it builds nothing, and is held behind a gate until
the test opens it. Every path's greedy tokens are Hugging Face's, before the switch, after it,
and for a request whose prompt ran on one path and whose decode ran on the other.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.engine_util import token_ids
from helpers.model_util import hf_greedy, random_prompts

from pdserve.kernels import cpu_ops
from pdserve.protocol.sampling import SamplingParams
from pdserve.serve import LLM
from pdserve.serve.executor import cpu_preparation
from pdserve.serve.executor import cpu_tuning as tuning
from pdserve.serve.layers import ops
from pdserve.serve.worker.status import _cpu_path

GATED_CHILD = ("import pathlib, runpy, sys, time\n"
               "gate = pathlib.Path(sys.argv.pop())\n"
               "while not gate.exists():\n"
               "    time.sleep(0.05)\n"
               "runpy.run_module('pdserve.serve.executor.cpu_preparation', run_name='__main__')\n")
CHILD_WAIT_S = 600.0  # a bound on the wait for the child, not a timing assertion
MAX_TOKENS = 6
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class FreshMachine:
    """The stubs of a machine that never built the kernels, and the gate on the child."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.monkeypatch = monkeypatch
        self.gate = folder / "gate"
        self.build_directory = cpu_ops._build_directory
        monkeypatch.setattr(cpu_ops, "_outcome", [])
        monkeypatch.setattr(cpu_ops, "_num_elsewhere", [0])
        monkeypatch.setattr(cpu_ops, "_build_directory", lambda name: folder / "no-library")
        monkeypatch.setattr(cpu_ops, "_build", self._no_build_here)
        monkeypatch.setattr(cpu_preparation, "child_command",
                            lambda job: [sys.executable, "-c", GATED_CHILD, str(job),
                                         str(self.gate)])

    @staticmethod
    def _no_build_here(*args: object) -> None:
        raise AssertionError("the serving process compiled the kernels")

    def release(self) -> None:
        """The child goes on; what it builds (here: finds built) this process sees too."""
        self.monkeypatch.setattr(cpu_ops, "_build_directory", self.build_directory)
        self.gate.touch()


@pytest.fixture
def fresh(monkeypatch, tmp_path) -> FreshMachine:
    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    monkeypatch.setenv("PDSERVE_CPU_TUNING", "1")
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path / "cache")
    machine = FreshMachine(monkeypatch, tmp_path)
    ops.reset()
    yield machine
    ops.reset()


def wait_for_child(llm: LLM) -> None:
    preparation = llm.engine.runner._cpu_path.preparation
    deadline = time.monotonic() + CHILD_WAIT_S
    while not preparation.is_done():
        assert time.monotonic() < deadline, "the background preparation never ended"
        time.sleep(0.2)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.slow
def test_a_fresh_engine_serves_portable_then_switches_between_steps(fresh, llama_dir,
                                                                    caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve")
    prompts = random_prompts([5, 19], vocab_size=1000, seed=4)
    expected = hf_greedy(llama_dir, prompts + prompts[:1], MAX_TOKENS)
    with LLM(llama_dir, num_kv_blocks=64, block_size=16, device="cpu") as llm:
        runner = llm.engine.runner
        assert llm.cpu_path["path"] == "portable" and "background" in llm.cpu_path
        assert _cpu_path(llm.engine) == llm.cpu_path  # what a worker's /status shows
        assert ops.cpu_kernels() is None and ops.chosen("rms_norm") == "torch"
        assert "serving on the portable path" in caplog.text
        assert generate(llm, prompts) == expected[:2]  # held back: the portable path serves
        assert runner.cpu_tuning is None

        # a request starts on the portable path ...
        engine = llm.engine
        engine.add_request(prompts[0], PARAMS)
        outputs = engine.step()  # its prompt
        assert llm.cpu_path["path"] == "portable"
        fresh.release()
        wait_for_child(llm)
        assert llm.cpu_path["path"] == "portable"  # nothing switches but a step
        while engine.has_unfinished_requests():  # ... and ends on the fast one
            outputs += engine.step()
        assert token_ids(outputs) == expected[2]

        status = llm.cpu_path
        assert status["path"] == runner.cpu_tuning.chosen.label == ops.path().label
        assert status["source"] in ("measured", "cached")
        assert status["background"].startswith("prepared in the background")
        assert ops.cpu_kernels() is not None and ops.chosen("rms_norm") == "cpu"
        assert caplog.text.count("cpu path: switched from the portable path (plain torch) to") == 1
        assert generate(llm, prompts) == expected[:2]  # the fast path, after the switch


def test_a_warm_cache_serves_its_choice_at_once(monkeypatch, llama_dir, tmp_path,
                                                caplog) -> None:
    """`pdserve tune` first (here: the same foreground measurement, its re-check made to
    agree), then a start: the cached choice serves from the first step, and no child runs."""
    if cpu_ops.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    monkeypatch.setattr(tuning, "RECHECK_TOLERANCE", float("inf"))
    monkeypatch.setattr(cpu_preparation, "child_command", lambda job: pytest.fail("a child ran"))
    caplog.set_level(logging.INFO, logger="pdserve")
    ops.reset()
    try:
        with LLM(llama_dir, num_kv_blocks=64, block_size=16, device="cpu") as llm:
            tuned = llm.engine.runner.tune_cpu_path()
        assert len(list(tmp_path.glob("*.json"))) == 1
        monkeypatch.setenv("PDSERVE_CPU_TUNING", "1")
        with LLM(llama_dir, num_kv_blocks=64, block_size=16, device="cpu") as llm:
            assert llm.cpu_path["path"] == tuned.chosen.label
            assert llm.cpu_path["source"] == "cached" and "background" not in llm.cpu_path
            assert llm.wait_for_cpu_path(0) == llm.cpu_path  # nothing to wait for
            assert ops.path() == tuned.chosen
        assert "(cached " in caplog.text
    finally:
        ops.reset()


def test_a_failed_build_keeps_the_portable_path(fresh, llama_dir, caplog) -> None:
    """The child could not build the kernels (no compiler): the engine keeps serving on the
    portable path, says so, and never tries the build itself."""
    fresh.monkeypatch.setattr(cpu_preparation, "child_command",
                              lambda job: [sys.executable, "-c", "raise SystemExit(3)"])
    prompts = random_prompts([7], vocab_size=1000, seed=5)
    expected = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    with LLM(llama_dir, num_kv_blocks=64, block_size=16, device="cpu") as llm:
        assert llm.wait_for_cpu_path(CHILD_WAIT_S)["path"] == "portable"
        assert generate(llm, prompts) == expected
        assert llm.cpu_path["path"] == "portable"
        assert llm.cpu_path["background"].startswith("the background preparation failed")
        assert ops.cpu_kernels() is None and cpu_ops.load() is None
        assert "CPU kernels are unavailable (the background build failed" in caplog.text
        assert "staying on the portable path" in caplog.text
        assert ops.chosen("rms_norm") == "torch"


def test_stopping_a_worker_mid_build_ends_its_compiler_and_frees_the_build(fresh, llama_dir,
                                                                           tmp_path) -> None:
    """A worker stopped while its child builds (a user's Ctrl-C in the first minute): the
    child's whole process group goes (here a stand-in compiler), and the lock file a killed
    build leaves is seen as stale by the next build (no builder holds the flock)."""
    compiler_pid = tmp_path / "compiler.pid"
    stand_in = ("import subprocess, sys, time\n"
                "compiler = subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(600)'])\n"
                f"open({str(compiler_pid)!r}, 'w').write(str(compiler.pid))\n"
                "time.sleep(600)\n")
    fresh.monkeypatch.setattr(cpu_preparation, "child_command",
                              lambda job: [sys.executable, "-c", stand_in])
    with LLM(llama_dir, num_kv_blocks=64, block_size=16, device="cpu") as llm:
        deadline = time.monotonic() + CHILD_WAIT_S
        while not compiler_pid.exists() or not compiler_pid.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pid = int(compiler_pid.read_text())
        assert _is_running(pid)
        preparation = llm.engine.runner._cpu_path.preparation
    assert preparation.is_done()
    _wait_until_ended(pid)  # the signal reaches it as the child ends, not before

    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").touch()  # what torch's builder leaves when killed
    assert not cpu_ops._is_builder_alive(build)
    library = build / "library.so"
    library.write_bytes(b"\x7fELF")  # a linker's first bytes: beside the lock, not built yet
    assert not cpu_ops._is_complete(build, library)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.readline()",
         str(build / cpu_ops.BUILDER_FLOCK)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cpu_ops._is_builder_alive(build)  # a live builder's lock stays
    finally:
        holder.kill()
        holder.wait(10)
    assert not cpu_ops._is_builder_alive(build)
    (build / "lock").unlink()
    assert cpu_ops._is_complete(build, library)


def test_a_build_past_its_limit_ends_with_its_compilers(tmp_path) -> None:
    """cpu_ops._build's timeout kills the builder's whole tree (ninja, the compilers), not
    the builder alone, which left them compiling into the directory a next build uses."""
    compiler_pid = tmp_path / "compiler.pid"
    builder = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "compiler = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
         f"open({str(compiler_pid)!r}, 'w').write(str(compiler.pid))\n"
         "time.sleep(600)\n"])
    deadline = time.monotonic() + CHILD_WAIT_S
    while not compiler_pid.exists() or not compiler_pid.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    compiler = int(compiler_pid.read_text())
    cpu_ops._kill_tree(builder.pid)
    builder.wait(10)
    _wait_until_ended(compiler)


def _wait_until_ended(pid: int) -> None:
    deadline = time.monotonic() + 30  # a bound on the wait, not a timing assertion
    while _is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_running(pid)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][:1] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
