"""A simulated fleet the study starts for itself: `pdserve up --engine sim`, its processes'
memory, its workers' pids (a forked worker names itself by its worker id), and its counters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks import server_process
from pdserve.serve.default_model import default_model_dir

READY_LINE = "pdserve is ready"


def sim_model_dir(root: Path, num_layers: int = 40, max_len: int = 131072) -> Path:
    """A checkpoint directory without weights, for simulated workers: the embedded default
    model's tokenizer, and a config with `num_layers` layers (OPT-13B's 40 by default, so the
    hand-off moves as many layers as the simulated model) and a context of `max_len` (the
    Mooncake trace's longest prompts fit)."""
    source = default_model_dir()
    target = root / f"sim-model-{num_layers}l-{max_len}"
    if (target / "config.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, max_position_embeddings=max_len)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


@dataclass
class Fleet:
    process: subprocess.Popen
    base_url: str
    log: Path
    started_s: float
    ready_s: float = 0.0
    """Seconds from the launch to `pdserve up`'s ready line."""
    model: str = ""
    """The served model's name."""
    model_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, model_dir: Path, log: Path, port: int, *flags: str,
              timeout_s: float = 300.0, engine: str | None = "sim") -> Fleet:
        """`pdserve up --engine sim <flags>` on `port` (store and workers above it); engine
        None: as the flags say (the model's engine unless they name one)."""
        argv = [sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(model_dir),
                "--port", str(port), "--store-port", str(port + 10),
                "--worker-base-port", str(port + 100),
                *(["--engine", engine] if engine else []), *flags]
        started = time.monotonic()
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        fleet = cls(process, f"http://127.0.0.1:{port}", log, started,
                    model_dir=str(model_dir))
        while time.monotonic() - started < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"pdserve up exited ({process.returncode}): see {log}")
            if READY_LINE in log.read_text(errors="replace"):
                fleet.ready_s = time.monotonic() - started
                fleet.model = httpx.get(f"{fleet.base_url}/v1/models",
                                        timeout=10).json()["data"][0]["id"]
                return fleet
            time.sleep(0.2)
        fleet.stop()
        raise RuntimeError(f"the fleet was not ready in {timeout_s:.0f} s: see {log}")

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.base_url}/status", timeout=30).json()

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=30).text

    def workers(self) -> list[dict[str, Any]]:
        return self.status()["workers"]

    def processes(self) -> dict[str, int]:
        """name -> pid of the launcher's children: workers by worker id, then router, store."""
        out = {}
        for pid in _children(self.process.pid):
            comm = _read(f"/proc/{pid}/comm").strip()
            cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
            role = re.search(r"pdserve\.app\.cli (router|store)\b", cmdline)
            out[role.group(1) if role else comm] = pid
        return out

    def stop(self) -> None:
        server_process.stop(self.process)


def wait_until(predicate, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def memory_mib(pid: int, with_children: bool = True) -> dict[str, float]:
    """Rss, Pss and Private (clean + dirty) of a process (and its children: a worker's UCX
    address prober), in MiB, from /proc/PID/smaps_rollup. Pss divides each shared page among
    the processes that map it: what the fleet's processes sum to."""
    totals = {"rss": 0.0, "pss": 0.0, "private": 0.0}
    for each in [pid, *(_children(pid) if with_children else [])]:
        fields = {}
        for line in _read(f"/proc/{each}/smaps_rollup").splitlines()[1:]:
            name, _, rest = line.partition(":")
            value = rest.split()
            if value and value[0].isdigit():
                fields[name] = int(value[0]) / 1024
        totals["rss"] += fields.get("Rss", 0.0)
        totals["pss"] += fields.get("Pss", 0.0)
        totals["private"] += fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)
    return totals


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return 0.0
    parts = stat.rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def box_busy_seconds() -> float:
    """CPU seconds every core of the host spent busy so far (/proc/stat: all but idle and
    iowait), whoever spent them."""
    fields = [int(v) for v in _read("/proc/stat").splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(processes: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of a fleet's process groups: the router, the store, and the
    workers (with their children: a worker's UCX address prober)."""
    totals = {"router": 0.0, "store": 0.0, "workers": 0.0}
    for name, pid in processes.items():
        group = name if name in ("router", "store") else "workers"
        totals[group] += sum(map(cpu_seconds, [pid, *_children(pid)]))
    return totals


def histogram(text: str, name: str) -> tuple[list[float], list[float]]:
    """(bucket upper bounds, cumulative counts) of an unlabelled Prometheus histogram."""
    bounds, counts = [], []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            bounds.append(float("inf") if le == "+Inf" else float(le))
            counts.append(float(line.split()[-1]))
    return bounds, counts


def histogram_quantile(bounds: list[float], before: list[float], after: list[float],
                       q: float) -> float:
    """The q-quantile of the observations between two scrapes, interpolated linearly inside
    its bucket (Prometheus's histogram_quantile); inf past the last finite bound."""
    counts = [a - b for a, b in zip(after, before or [0.0] * len(after), strict=True)]
    if len(counts) != len(bounds):
        raise ValueError("the two scrapes have different buckets")
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if bound == float("inf"):
                return float("inf")
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return float("inf")


def worker_sum(workers: list[dict[str, Any]], role: str, key: str) -> float:
    return sum(float(w.get("kv_tiers", {}).get(key, 0.0)) for w in workers if w["role"] == role)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def start_etcd(work_dir: Path, client_port: int) -> tuple[subprocess.Popen, str]:
    """One etcd member (from PATH) on loopback; (its process, the discovery URL)."""
    etcd = shutil.which("etcd")
    if etcd is None:
        raise RuntimeError("etcd is not on PATH (Debian: apt-get install etcd-server)")
    endpoint = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{client_port + 1}"
    process = server_process.start(
        [etcd, "--data-dir", str(work_dir / "etcd"), "--listen-client-urls", endpoint,
         "--advertise-client-urls", endpoint, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}"],
        work_dir / "etcd.log", f"{endpoint}/health", timeout_s=30)
    return process, f"etcd://127.0.0.1:{client_port}/simfleet"


def start_router(fleet: Fleet, discovery: str, key: Path, port: int, log: Path
                 ) -> subprocess.Popen:
    """A second router beside `pdserve up`'s, finding the same fleet through etcd."""
    command = [sys.executable, "-m", "pdserve.app.cli", "router", "--model",
               fleet.model_dir, "--port", str(port), "--discovery", discovery]
    return server_process.start(command, log, f"http://127.0.0.1:{port}/health",
                                timeout_s=120, env={"PDSERVE_CLUSTER_KEY_FILE": str(key)})
