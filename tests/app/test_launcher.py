"""`pdserve up`'s plan: which GPUs each worker gets (CUDA_VISIBLE_DEVICES in its environment),
the error when the ranks do not fit, sharing when asked, and a CPU plan as before."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from pdserve.app import launcher
from pdserve.serve.cpu.core_share import parse_core_list


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(list(argv))


def _workers(cluster: launcher.Cluster) -> dict[str, launcher.Child]:
    return {c.role: c for c in cluster.children if c.role not in ("store", "router")}


def _flag(child: launcher.Child, name: str) -> str | None:
    return child.argv[child.argv.index(name) + 1] if name in child.argv else None


TWO_TP2_PREFILL_ONE_DECODE = ("--num-prefill", "2", "--prefill-tp", "2", "--num-decode", "1")


def test_each_worker_gets_its_own_gpus() -> None:
    cluster = launcher.plan(_args(*TWO_TP2_PREFILL_ONE_DECODE), "/m",
                            gpus=["0", "1", "2", "3", "4"])
    workers = _workers(cluster)
    assert {role: c.env["CUDA_VISIBLE_DEVICES"] for role, c in workers.items()} == {
        "prefill-0": "0,1", "prefill-1": "2,3", "decode-0": "4"}
    for child in workers.values():
        assert _flag(child, "--gpu-memory-utilization") == "0.9"  # nobody shares
        assert "--cpu-threads" not in child.argv
        assert "--max-prefills-per-step" not in child.argv  # GPUs batch prompts
    assert [c.role for c in cluster.children] == ["store", "prefill-0", "prefill-1",
                                                  "decode-0", "router"]
    assert all(not c.env for c in cluster.children if c.role in ("store", "router"))


def test_gpu_ids_come_from_the_visible_set() -> None:
    cluster = launcher.plan(_args("--num-decode", "2"), "/m", gpus=["3", "5", "GPU-abc"])
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in _workers(cluster).values()] == [
        "3", "5", "GPU-abc"]


def test_more_ranks_than_gpus_fails_clearly() -> None:
    with pytest.raises(ValueError, match=r"need 5 GPUs \(TP sizes 2 \+ 2 \+ 1\) but 3 are "
                                         r"visible .*--allow-gpu-sharing"):
        launcher.plan(_args(*TWO_TP2_PREFILL_ONE_DECODE), "/m", gpus=["0", "1", "2"])
    with pytest.raises(ValueError, match="--device cuda, but no GPU"):
        launcher.plan(_args("--device", "cuda"), "/m", gpus=[])


def test_sharing_wraps_around_and_splits_the_memory() -> None:
    cluster = launcher.plan(_args(*TWO_TP2_PREFILL_ONE_DECODE, "--allow-gpu-sharing",
                                  "--gpu-memory-utilization", "0.8"), "/m",
                            gpus=["0", "1", "2"])
    workers = _workers(cluster)
    assert {role: c.env["CUDA_VISIBLE_DEVICES"] for role, c in workers.items()} == {
        "prefill-0": "0,1", "prefill-1": "2,0", "decode-0": "1"}
    # GPUs 0 and 1 carry two workers each, GPU 2 one: a worker takes its busiest GPU's share
    assert {role: _flag(c, "--gpu-memory-utilization") for role, c in workers.items()} == {
        "prefill-0": "0.4", "prefill-1": "0.4", "decode-0": "0.4"}
    with pytest.raises(ValueError, match="TP 4 needs 4 GPUs of its own"):
        launcher.assign_gpus([4], ["0", "1", "2"], allow_sharing=True)


def test_cpu_plan_is_unchanged() -> None:
    cluster = launcher.plan(_args(*TWO_TP2_PREFILL_ONE_DECODE), "/m", gpus=[])
    for child in _workers(cluster).values():
        assert not child.env and "--device" not in child.argv
        assert "--gpu-memory-utilization" not in child.argv
        assert int(_flag(child, "--cpu-threads")) >= 1
    # --device cpu on a GPU host: no GPUs handed out, the workers told to stay on CPU
    cluster = launcher.plan(_args("--device", "cpu", "--kv-cache-memory-gb", "2"), "/m",
                            gpus=["0", "1"])
    for child in _workers(cluster).values():
        assert "CUDA_VISIBLE_DEVICES" not in child.env and _flag(child, "--device") == "cpu"
        assert _flag(child, "--kv-cache-memory-gb") == "2.0"
        assert "--no-prefix-caching" not in child.argv
    cluster = launcher.plan(_args("--no-prefix-caching"), "/m", gpus=[])
    assert all("--no-prefix-caching" in c.argv for c in _workers(cluster).values())


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setattr(launcher.placement, "_count_gpus", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert launcher.visible_gpus() == ["4", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launcher.visible_gpus() == [str(i) for i in range(8)]
    monkeypatch.setattr(launcher.placement, "_count_gpus", lambda: 0)
    assert launcher.visible_gpus() == []


def test_cpu_workers_get_cores_of_their_own(monkeypatch) -> None:
    """Disjoint cores per worker rank (and that many threads); the router and store get a
    core of their own only where there are more than 4; nothing pinned when the ranks
    outnumber the cores, or with --no-cpu-pinning."""
    assert launcher.place_on_cores([1, 1], [0, 1]) == ([[0], [1]], None)
    assert launcher.place_on_cores([2, 1], list(range(8))) == ([[0, 1, 2, 3], [4, 5]], [7])
    assert launcher.place_on_cores([1], [0, 1]) == ([[0, 1]], None)
    assert launcher.place_on_cores([2, 2], [0, 1, 2]) == ([], None)
    # 2 cores, disaggregated: the router and store share decode's core, never prefill's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cluster = launcher.plan(_args("--device", "cpu"), "/m")
    by_role = {c.role: c.cpus for c in cluster.children}
    assert by_role == {"store": [1], "prefill-0": [0], "decode-0": [1], "router": [1]}
    # and a CPU prefill computes one prompt a step; decode is left alone
    workers = _workers(cluster)
    assert _flag(workers["prefill-0"], "--max-prefills-per-step") == "1"
    assert "--max-prefills-per-step" not in workers["decode-0"].argv
    batched = _workers(launcher.plan(_args("--prefill-max-prefills-per-step", "0"), "/m",
                                     gpus=[]))
    assert _flag(batched["prefill-0"], "--max-prefills-per-step") == "0"
    with pytest.raises(ValueError, match="--prefill-max-prefills-per-step must be >= 0"):
        launcher.plan(_args("--prefill-max-prefills-per-step", "-1"), "/m", gpus=[])
    assert "GOMP_CPU_AFFINITY" not in workers["decode-0"].env  # one core: nothing to keep
    # colocated: the worker keeps its first core to its main thread (OpenMP thread 0 bound
    # there), the router, the store (the tier below its host DRAM) and the worker's ZeroMQ
    # I/O thread run on its other one
    colocated = launcher.plan(_args("--device", "cpu", "--mode", "colocated"), "/m")
    assert {c.role: c.cpus for c in colocated.children} == {"store": [1], "colocated-0": [0, 1],
                                                            "router": [1]}
    assert "--store" in _workers(colocated)["colocated-0"].argv
    env = _workers(colocated)["colocated-0"].env
    assert (env["GOMP_CPU_AFFINITY"], env["PDSERVE_IO_CORES"]) == ("0,1", "1")
    tp2 = launcher.plan(_args("--device", "cpu", "--mode", "colocated", "--prefill-tp", "2"),
                        "/m")  # a core per rank: nothing to keep, the router shares both
    assert {c.role: c.cpus for c in tp2.children}["router"] == [0, 1]
    assert "GOMP_CPU_AFFINITY" not in _workers(tp2)["colocated-0"].env
    assert launcher.share_with_services([[0, 1], [2]], [1, 1]) == ([1, 2], {0: [0, 1]})
    assert launcher.share_with_services([], []) == (None, {})
    chosen = launcher.plan(_args("--device", "cpu", "--mode", "colocated",
                                 "--service-cores", "0"), "/m")
    assert {c.role: c.cpus for c in chosen.children}["router"] == [0]
    assert "GOMP_CPU_AFFINITY" not in _workers(chosen)["colocated-0"].env  # as chosen
    # chosen cores: a prefill that borrows decode's core runs 2 threads and waits passively
    overlap = launcher.plan(_args("--device", "cpu", "--prefill-cores", "0-1",
                                  "--decode-cores", "1"), "/m")
    workers = _workers(overlap)
    assert (workers["prefill-0"].cpus, workers["decode-0"].cpus) == ([0, 1], [1])
    assert (_flag(workers["prefill-0"], "--cpu-threads"),
            _flag(workers["decode-0"], "--cpu-threads")) == ("2", "1")
    assert all(w.env["OMP_WAIT_POLICY"] == "PASSIVE" for w in workers.values())
    assert "OMP_WAIT_POLICY" not in _workers(cluster)["prefill-0"].env  # disjoint: spin
    with pytest.raises(ValueError, match="--prefill-cores 0: fewer cores"):
        launcher.plan(_args("--device", "cpu", "--num-prefill", "2", "--prefill-cores", "0"),
                      "/m")
    assert parse_core_list("0,2-3") == [0, 2, 3]
    with pytest.raises(argparse.ArgumentTypeError, match="core list"):
        parse_core_list("a-b")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    cluster = launcher.plan(_args(*TWO_TP2_PREFILL_ONE_DECODE, "--device", "cpu"), "/m")
    workers = _workers(cluster)
    # 5 ranks on the 7 cores left after the services' one: a core per rank
    assert [workers[r].cpus for r in ("prefill-0", "prefill-1", "decode-0")] == \
        [[0, 1], [2, 3], [4]]
    assert all(_flag(w, "--cpu-threads") == "1" for w in workers.values())
    services = [c for c in cluster.children if c.role in ("store", "router")]
    assert len(services) == 2 and all(c.cpus == [7] for c in services)
    unpinned = launcher.plan(_args(*TWO_TP2_PREFILL_ONE_DECODE, "--device", "cpu",
                                   "--no-cpu-pinning"), "/m")
    assert all(c.cpus is None for c in unpinned.children)


def test_io_cores_come_from_the_environment(monkeypatch) -> None:
    from pdserve import envs

    monkeypatch.delenv("PDSERVE_IO_CORES", raising=False)
    assert envs.io_cores() == []
    monkeypatch.setenv("PDSERVE_IO_CORES", "1,3")
    assert envs.io_cores() == [1, 3]
    monkeypatch.setenv("PDSERVE_IO_CORES", "1-3")
    with pytest.raises(ValueError, match="PDSERVE_IO_CORES must be core numbers"):
        envs.io_cores()


def test_the_advertised_address_reaches_every_child() -> None:
    cluster = launcher.plan(_args("--advertise-address", "node-7.example"), "/m", gpus=[])
    assert [_flag(c, "--advertise-address") for c in cluster.children] == [
        "node-7.example"] * len(cluster.children)
    assert all("--advertise-address" not in c.argv
               for c in launcher.plan(_args(), "/m", gpus=[]).children)


def test_without_a_gpu_driver_the_gpus_are_counted_without_importing_torch(monkeypatch):
    """No nvidia-smi and no driver: 0 GPUs, and no `import torch` subprocess (seconds of CPU
    before the first child starts); a driver but no nvidia-smi: torch counts them."""
    ran: list[list[str]] = []

    def run(argv, **kwargs):
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="2\n")

    monkeypatch.setattr(launcher.placement.shutil, "which", lambda name: None)
    monkeypatch.setattr(launcher.placement.subprocess, "run", run)
    monkeypatch.setattr(launcher.placement, "_gpu_driver_loaded", lambda: False)
    assert launcher.placement._count_gpus() == 0 and ran == []
    monkeypatch.setattr(launcher.placement, "_gpu_driver_loaded", lambda: True)
    assert launcher.placement._count_gpus() == 2 and "import torch" in ran[0][-1]
