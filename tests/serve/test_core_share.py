"""Core lending (pdserve/serve/cpu/core_share.py): a worker's idle flag, the borrower moving torch's
threads onto the lent cores and back, the worker config's checks, and `pdserve up`'s plan of
who lends to whom. (A prefill worker that borrowed, with the same
greedy tokens: tests/cluster/test_server_e2e.py.)"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zmq
from helpers.cluster_util import free_port_block, wait_until
from helpers.worker_util import collect, make_engine, stop_workers

from pdserve.app import launcher
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import WORKER_PROTOCOL, GenerateRequest, Output
from pdserve.serve.config import ModelConfig, ParallelConfig
from pdserve.serve.cpu.core_share import IdleFlag, Lender
from pdserve.serve.worker.server import Worker, WorkerConfig


def test_idle_flag_is_written_by_the_lender_and_read_by_the_borrower(tmp_path) -> None:
    path = tmp_path / "decode-0.idle"
    reader = IdleFlag(path)
    assert not reader.is_idle()  # no lender yet: never borrow
    lender = IdleFlag(path, create=True)
    assert not reader.is_idle()  # a lender starts busy
    lender.set_idle(True)
    assert reader.is_idle()
    lender.set_idle(False)
    assert not reader.is_idle()
    with pytest.raises(RuntimeError, match="opened to read"):
        reader.set_idle(True)
    lender.set_idle(True)
    lender.close()  # the lender died idle; its restart starts busy again
    again = IdleFlag(path, create=True)
    assert not reader.is_idle()
    for flag in (reader, lender, again):
        flag.close()


def test_lender_parses_cores_at_path() -> None:
    assert Lender.parse("1@/dev/shm/x.idle") == Lender((1,), "/dev/shm/x.idle")
    assert Lender.parse("2-3,6@f") == Lender((2, 3, 6), "f")
    for bad in ("1", "1@", "a@f", "@f"):
        with pytest.raises(argparse.ArgumentTypeError):
            Lender.parse(bad)


BORROWER_SCRIPT = textwrap.dedent("""
    import os, sys, threading, torch
    from pdserve.serve.cpu.core_share import CoreBorrower, IdleFlag, Lender
    path = sys.argv[1]
    lender = IdleFlag(path, create=True)
    main_on_lent = sys.argv[2] == "1"
    borrower = CoreBorrower([Lender((1,), path)], main_on_lent)  # started on {0, 1}: owns 0
    me = threading.get_native_id()
    def affinities():
        return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    assert set(map(tuple, affinities().values())) == {(0,)}, affinities()
    torch.set_num_threads(1)
    x = torch.randn(256, 256)
    borrower.update()
    assert not borrower.is_borrowing and torch.get_num_threads() == 1
    lender.set_idle(True)
    borrower.update()
    assert borrower.is_borrowing and torch.get_num_threads() == 2
    x @ x
    pinned = affinities()
    # the main thread on the own core (a decode worker's: on the lent one), torch's second
    # thread on the other
    main, other = ([1], [0]) if main_on_lent else ([0], [1])
    assert pinned[me] == main and other in pinned.values(), pinned
    lender.set_idle(False)
    borrower.update()
    assert not borrower.is_borrowing and torch.get_num_threads() == 1
    assert affinities()[me] == [0]
    assert borrower.num_borrows == 1
    print("ok")
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs cores 0 and 1")
def test_borrower_runs_torch_threads_on_lent_cores_and_gives_them_back(tmp_path) -> None:
    for main_on_lent in ("0", "1"):
        result = subprocess.run(
            [sys.executable, "-c", BORROWER_SCRIPT, str(tmp_path / f"lender-{main_on_lent}"),
             main_on_lent],
            preexec_fn=lambda: os.sched_setaffinity(0, {0, 1}), capture_output=True,
            text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    # started on the lent cores only: nothing of its own to narrow to
    result = subprocess.run(
        [sys.executable, "-c", "from pdserve.serve.cpu.core_share import CoreBorrower, Lender; "
         "CoreBorrower([Lender((0,), 'f')])"],
        preexec_fn=lambda: os.sched_setaffinity(0, {0}), capture_output=True, text=True,
        timeout=120)
    assert result.returncode != 0 and "all of them lent" in result.stderr


def test_prefill_and_decode_lend_and_one_rank_workers_borrow() -> None:
    model = ModelConfig("/m")
    lender = (Lender((1,), "/tmp/f"),)
    for role in ("prefill", "decode"):
        WorkerConfig(role, model, 1234, lend_idle_flag="/tmp/f", borrow_idle_cores=lender)
    with pytest.raises(ValueError, match="only prefill and decode workers lend and borrow"):
        WorkerConfig("colocated", model, 1234, lend_idle_flag="/tmp/f")
    with pytest.raises(ValueError, match="only prefill and decode workers lend and borrow"):
        WorkerConfig("colocated", model, 1234, borrow_idle_cores=lender)
    with pytest.raises(ValueError, match="only a one-rank worker borrows"):
        WorkerConfig("prefill", model, 1234, borrow_idle_cores=lender,
                     parallel=ParallelConfig(tensor_parallel_size=2))


def _plan(tmp_path, *argv: str) -> dict[str, launcher.Child]:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    cluster = launcher.plan(parser.parse_args(["--device", "cpu", *argv]), "/m",
                            run_dir=tmp_path)
    return {c.role: c for c in cluster.children}


def test_pdserve_up_pairs_decode_and_prefill_workers_to_lend_each_other_cores(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    children = _plan(tmp_path)
    prefill, decode = children["prefill-0"], children["decode-0"]
    flag = str(tmp_path / "decode-0.idle")
    assert decode.argv[decode.argv.index("--lend-idle-flag") + 1] == flag
    assert prefill.argv[prefill.argv.index("--borrow-idle-cores") + 1] == f"1@{flag}"
    # and back: decode runs on the prefill's core while no prompt is there
    flag = str(tmp_path / "prefill-0.idle")
    assert prefill.argv[prefill.argv.index("--lend-idle-flag") + 1] == flag
    assert decode.argv[decode.argv.index("--borrow-idle-cores") + 1] == f"0@{flag}"
    # each starts on both cores (OpenMP sizes its waits from them) and narrows itself
    assert (prefill.cpus, decode.cpus) == ([0, 1], [0, 1])
    assert prefill.argv[prefill.argv.index("--cpu-threads") + 1] == "1"
    assert decode.argv[decode.argv.index("--cpu-threads") + 1] == "1"
    assert children["router"].cpus == [1]  # the services stay on decode's own core
    # a thread left on a core given back does not spin there long
    assert prefill.env["GOMP_SPINCOUNT"] == decode.env["GOMP_SPINCOUNT"] == "20000"
    for off in (("--no-core-lending",), ("--mode", "colocated"), ("--no-cpu-pinning",),
                ("--prefill-cores", "0-1", "--decode-cores", "1")):  # overlap: shared, not lent
        assert not any("--borrow-idle-cores" in c.argv or "--lend-idle-flag" in c.argv
                       for c in _plan(tmp_path, *off).values()), off
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    # TP 2 prefill workers hold their threads in two processes: decode lends to nobody
    children = _plan(tmp_path, "--prefill-tp", "2")
    assert not any("--lend-idle-flag" in c.argv for c in children.values())
    # two decode workers, one prefill: it may borrow both
    children = _plan(tmp_path, "--num-decode", "2")
    borrowed = [a for c in children.values() for i, a in enumerate(c.argv)
                if i and c.argv[i - 1] == "--borrow-idle-cores"]
    assert [b.split("@")[0] for b in borrowed] == ["2,3", "4,5"]
    assert children["prefill-0"].cpus == [0, 1, 2, 3, 4, 5]
    # and lends to neither: the two would share its cores
    assert "--lend-idle-flag" not in children["prefill-0"].argv


def test_decode_worker_says_idle_only_while_it_holds_no_request(llama_dir, tmp_path) -> None:
    """In-process prefill and decode workers over ZeroMQ; the decode one publishes its flag.
    Its steps wait for a go, so the request is surely held while the flag is read."""
    base = free_port_block(2)
    context = zmq.Context()
    flag_path = tmp_path / "decode-0.idle"
    workers, threads, sockets = {}, [], {}
    for i, role in enumerate(("prefill", "decode")):
        address = f"tcp://127.0.0.1:{base + i}"
        flag = IdleFlag(flag_path, create=True) if role == "decode" else None
        workers[role] = Worker(make_engine(llama_dir), role, address, role, idle_flag=flag)
        threads.append(threading.Thread(target=workers[role].serve_forever, daemon=True))
        threads[-1].start()
        sockets[role] = context.socket(zmq.DEALER)
        sockets[role].setsockopt(zmq.LINGER, 0)
        sockets[role].connect(address)
    reader = IdleFlag(flag_path)
    decode = workers["decode"]
    may_step = threading.Event()
    real_step = decode.engine.step
    decode.engine.step = lambda: real_step() if may_step.is_set() else []
    try:
        assert wait_until(reader.is_idle)  # started busy, idle once its loop runs
        prompt = list(range(40, 57))
        params = SamplingParams(max_tokens=5, temperature=0.0)
        [first] = collect(sockets["prefill"], GenerateRequest("r1", prompt, params))
        assert first.finish_reason == "handoff"
        sockets["decode"].send(WORKER_PROTOCOL.encode(
            GenerateRequest("r1", prompt, params, handoff=first.handoff)))
        assert wait_until(lambda: not reader.is_idle())  # holds r1: lent cores come back
        assert not reader.is_idle()
        may_step.set()
        deadline = time.monotonic() + 60
        finished = False
        while not finished and time.monotonic() < deadline:
            if sockets["decode"].poll(100):
                message = WORKER_PROTOCOL.decode(sockets["decode"].recv())
                finished = isinstance(message, Output) and message.finish_reason is not None
        assert finished
        assert wait_until(reader.is_idle)  # r1 done: idle again
    finally:
        del decode.engine.step
        stop_workers(workers, threads, sockets, context, check_idle=True)
        reader.close()
