"""A worker's ranks on two "hosts": two process trees on this machine, joined only through the
rendezvous address (pdserve/serve/layers/distributed.py), as `--nnodes 2 --node-rank k` starts
them.

Node 0 is this test process (LLM with nnodes=2: the engine and rank 0); node 1 is a separate
`pdserve colocated ... --node-rank 1` process group running rank 1. TP 2 over 2 nodes x 1 rank
must give the greedy tokens of TP 2 on one host and of Hugging Face (and PP 2 with a stage on
each node those of Hugging Face); a missing node is an error naming it within
--dist-timeout-s; a node killed mid-serve, or while the engine idles, is reported by name, not
a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.cluster_util import free_port_block
from helpers.model_util import hf_greedy, random_prompts

from pdserve.serve import LLM, SamplingParams
from pdserve.serve.layers.distributed import RendezvousError

PROMPT_LENGTHS = [5, 11, 3]
MAX_TOKENS = 6
HANG_GUARD_S = 90.0  # far past every timeout below: only a hang gets here
COMMON = dict(tensor_parallel_size=2, block_size=8, num_kv_blocks=32, device="cpu")


def _start_node(model_dir: Path, node_rank: int, master_port: int, dist_timeout_s: float,
                log: Path, layout: tuple[str, ...] = ("--tensor-parallel-size", "2")
                ) -> subprocess.Popen:
    """`pdserve colocated` as node `node_rank` of 2, in a process group of its own (a "host").
    Its log goes to a file: torch logs every retry to reach the rendezvous, which could fill
    a pipe nobody reads yet."""
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.app.cli", "colocated", "--model", str(model_dir),
         *layout, "--nnodes", "2", "--node-rank", str(node_rank),
         "--master-addr", "127.0.0.1", "--master-port", str(master_port),
         "--dist-timeout-s", str(dist_timeout_s), "--device", "cpu", "--block-size", "8",
         "--num-kv-blocks", "32", "--insecure-plaintext"],
        stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)


def _kill_host(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]



def test_two_hosts_match_one_host_and_hf(llama_dir: Path, tmp_path: Path) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=1000, seed=3)
    with LLM(llama_dir, **COMMON) as one_host:
        expected = _greedy(one_host, prompts)
    assert expected == hf_greedy(llama_dir, prompts, MAX_TOKENS)

    port = free_port_block(1)
    node1 = _start_node(llama_dir, 1, port, dist_timeout_s=60, log=tmp_path / "node1.log")
    try:
        with LLM(llama_dir, nnodes=2, master_port=port, dist_timeout_s=60, **COMMON) as llm:
            assert llm.engine.runner._workers == []  # rank 1 is not a child of this process
            assert _greedy(llm, prompts) == expected
        # node 0's shutdown stops node 1's rank through the control group: node 1 exits 0
        assert node1.wait(timeout=HANG_GUARD_S) == 0
    finally:
        _kill_host(node1)
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


def test_pipeline_stages_on_two_hosts_match_hf(llama_dir: Path, tmp_path: Path) -> None:
    """PP 2 x TP 1: stage 1 (layer 1, the LM head) lives on node 1; activations cross hosts."""
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=1000, seed=6)
    port = free_port_block(1)
    node1 = _start_node(llama_dir, 1, port, dist_timeout_s=60, log=tmp_path / "node1.log",
                        layout=("--tensor-parallel-size", "1", "--pipeline-parallel-size", "2"))
    try:
        with LLM(llama_dir, tensor_parallel_size=1, pipeline_parallel_size=2, nnodes=2,
                 master_port=port, dist_timeout_s=60, block_size=8, num_kv_blocks=32,
                 device="cpu") as llm:
            assert _greedy(llm, prompts) == hf_greedy(llama_dir, prompts, MAX_TOKENS)
        assert node1.wait(timeout=HANG_GUARD_S) == 0
    finally:
        _kill_host(node1)
    assert not dist.is_initialized()


def test_killing_node1_mid_serve_names_the_lost_rank(llama_dir: Path, tmp_path: Path) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=1000, seed=4)
    port = free_port_block(1)
    node1 = _start_node(llama_dir, 1, port, dist_timeout_s=60, log=tmp_path / "node1.log")
    try:
        llm = LLM(llama_dir, nnodes=2, master_port=port, dist_timeout_s=60, **COMMON)
        try:
            _greedy(llm, prompts)
            # the whole "host" (its CLI process and its rank) dies while requests run
            killer = threading.Timer(0.5, _kill_host, (node1,))
            killer.start()
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"lost rank 1 \(node 1\)"):
                while time.monotonic() - started < HANG_GUARD_S:
                    _greedy(llm, prompts)
            killer.join()
            with pytest.raises(RuntimeError, match=r"rank 1 \(node 1\)"):  # and stays named
                _greedy(llm, prompts[:1])
        finally:
            llm.shutdown()
    finally:
        _kill_host(node1)
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


def test_an_idle_engine_notices_a_lost_host(llama_dir: Path, tmp_path: Path) -> None:
    """No step runs: the control group's heartbeat finds rank 1 gone and names it."""
    port = free_port_block(1)
    node1 = _start_node(llama_dir, 1, port, dist_timeout_s=60, log=tmp_path / "node1.log")
    try:
        with LLM(llama_dir, nnodes=2, master_port=port, dist_timeout_s=60, **COMMON) as llm:
            procs = llm.engine.runner._procs
            _kill_host(node1)
            started = time.monotonic()
            while procs.failure is None and time.monotonic() - started < HANG_GUARD_S:
                time.sleep(0.2)
            assert procs.failure is not None and "lost rank 1 (node 1)" in procs.failure
            with pytest.raises(RuntimeError, match=r"lost rank 1 \(node 1\)"):
                _greedy(llm, [[1, 2, 3]])
    finally:
        _kill_host(node1)
    assert not dist.is_initialized()


def test_node0_without_node1_names_the_missing_node(llama_dir: Path) -> None:
    port = free_port_block(1)
    # it gives up by its own rendezvous timeout (the error says which), not by a hang
    with pytest.raises(RendezvousError,
                       match=rf"rank 1 \(node 1\) did not reach 'started' within 4 s.*"
                             rf"--master-port {port}"):
        LLM(llama_dir, tensor_parallel_size=2, nnodes=2, master_port=port, dist_timeout_s=4,
            block_size=8, num_kv_blocks=8, device="cpu")
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


def test_node1_without_node0_exits_with_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    port = free_port_block(1)
    node1 = _start_node(llama_dir, 1, port, dist_timeout_s=3, log=tmp_path / "node1.log")
    try:
        node1.wait(timeout=HANG_GUARD_S)
    finally:
        _kill_host(node1)
    stderr = (tmp_path / "node1.log").read_text()
    assert node1.returncode == 1
    assert f"could not reach the rendezvous at 127.0.0.1:{port}" in stderr
    assert "is node 0 running" in stderr


def test_bad_node_layouts_are_refused(llama_dir: Path) -> None:
    from pdserve.serve.config import ParallelConfig

    with pytest.raises(ValueError, match="needs master_port"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="cannot spread evenly"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match="node_rank"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234)
    layout = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=1234)
    assert list(layout.local_ranks) == [2, 3] and layout.node_of(1) == 0


def test_rank0_hosts_on_the_port_the_kernel_picks_and_names_a_taken_one() -> None:
    """With no --master-port, rank 0 listens on port 0 and reports the port it got (no
    free-then-bind window another socket could fill); a taken port is a clear error."""
    from pdserve.serve.layers.distributed import Rendezvous

    host = Rendezvous(0, 2, "127.0.0.1", 0, start_timeout_s=5)
    assert host.master_port > 0
    peer = Rendezvous(1, 2, "127.0.0.1", host.master_port, start_timeout_s=5)
    host.store.set("probe", "up")
    assert peer.store.get("probe") == b"up"
    with pytest.raises(RendezvousError, match=f"cannot host the rendezvous on port "
                                              f"{host.master_port}"):
        Rendezvous(0, 2, "127.0.0.1", host.master_port, start_timeout_s=5)
