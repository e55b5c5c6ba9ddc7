"""Fleet scaling through etcd discovery: requests/s and TTFT as decode workers join one by one.

    python -m benchmarks.fleet_scale --model DIR [--max-decode 3] \\
        [--num-prompts 48]

On this host it starts etcd (from PATH, in a temporary data dir), one prefill worker and one
router, every one with `--discovery`; the router is given no worker list. Then, for k = 1 .. max
decode workers, it starts one more decode worker, waits until the router holds it (the time
from the process's start to that is the join time), and runs the same closed-loop load through
the router with the project's bench client (`pdserve bench`: random prompts, ignore_eos, a fixed
concurrency, a fixed seed, warm-up requests first). It prints a table and writes JSON and a
plot (fleet_scale.{json,png} in --output-dir).

Every process runs on this one host: on a box with few cores the decode workers share them,
so the curve shows what joining costs and what the extra workers can add here, not a
multi-host fleet's scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.benchmarks import server_process
from pdserve.benchmarks.output import add_output_dir, output_path

READY_TIMEOUT_S = 300.0


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class Processes:
    """The benchmark's children; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = dict(os.environ, PDSERVE_LOG_LEVEL="INFO")
        self.children[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                               env=env)

    def check_alive(self) -> None:
        for name, process in self.children.items():
            if process.poll() is not None:
                log = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited ({process.returncode}):\n{log}")

    def stop(self) -> None:
        server_process.stop_all(list(reversed(self.children.values())))


def _wait(predicate, processes: Processes, what: str, timeout_s: float = READY_TIMEOUT_S
          ) -> float:
    """Seconds until `predicate()` held; RuntimeError past timeout_s or if a child died."""
    started = time.monotonic()
    while not predicate():
        processes.check_alive()
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - started


def _num_ready_decode(base_url: str) -> int:
    try:
        workers = httpx.get(f"{base_url}/status", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1
    return sum(1 for w in workers if w["role"] == "decode" and w["is_ready"])


def _etcd_up(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _bench(args: argparse.Namespace, base_url: str, out_dir: Path, step: int) -> dict:
    name = f"step-{step}.json"
    argv = [sys.executable, "-m", "pdserve.app.cli", "bench", "--base-url", base_url,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", "inf", "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", "0", "--num-warmups", "2", "--save-result",
            "--result-dir", str(out_dir), "--result-filename", name, "--no-plots",
            "--disable-tqdm"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.step_timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve bench failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads((out_dir / name).read_text())


def run_fleet(args: argparse.Namespace, work_dir: Path) -> list[dict]:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise RuntimeError("etcd is not on PATH (Debian: apt-get install etcd-server)")
    client_port, peer_port, router_port, *worker_ports = _free_ports(3 + 1 + args.max_decode)
    processes = Processes(work_dir)
    endpoint = f"http://127.0.0.1:{client_port}"
    url = f"etcd://127.0.0.1:{client_port}/bench"
    discovery = ["--discovery", url, "--discovery-ttl-s", "5"]
    worker = ["--model", args.model, "--num-kv-blocks", str(args.num_kv_blocks),
              "--cpu-threads", "1", "--discovery-store-wait-s", "0", "--insecure-plaintext",
              *discovery]
    cli = [sys.executable, "-m", "pdserve.app.cli"]
    base_url = f"http://127.0.0.1:{router_port}"
    steps = []
    try:
        processes.start("etcd", [
            etcd, "--data-dir", str(work_dir / "etcd"),
            "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"])
        _wait(lambda: _etcd_up(endpoint), processes, "etcd", 30)
        processes.start("prefill", [*cli, "prefill", "--port", str(worker_ports[0]), *worker])
        processes.start("router", [*cli, "router", "--model", args.model, "--port",
                                   str(router_port), "--insecure-plaintext", *discovery])
        for k in range(1, args.max_decode + 1):
            processes.start(f"decode-{k}", [*cli, "decode", "--port", str(worker_ports[k]),
                                            *worker])
            join_s = _wait(lambda k=k: _num_ready_decode(base_url) == k, processes,
                           f"decode worker {k} to join")
            result = _bench(args, base_url, work_dir, k)
            step = {"num_decode": k, "join_s": round(join_s, 2),
                    **{key: result[key] for key in (
                        "completed", "failed", "duration", "request_throughput",
                        "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                        "mean_tpot_ms", "p99_tpot_ms") if key in result}}
            steps.append(step)
            print(f"{k} decode: {step['request_throughput']:.2f} req/s, TTFT mean "
                  f"{step['mean_ttft_ms']:.0f} ms p99 {step['p99_ttft_ms']:.0f} ms, "
                  f"{step['failed']} failed (joined in {join_s:.1f} s)", flush=True)
    finally:
        processes.stop()
    return steps


def plot(steps: list[dict], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [s["num_decode"] for s in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ks, [s["request_throughput"] for s in steps], "o-")
    left.set(xlabel="decode workers", ylabel="requests/s", title="Throughput", xticks=ks)
    right.plot(ks, [s["mean_ttft_ms"] for s in steps], "o-", label="mean")
    right.plot(ks, [s["p99_ttft_ms"] for s in steps], "s--", label="p99")
    right.set(xlabel="decode workers", ylabel="TTFT (ms)", title="Time to first token",
              xticks=ks)
    right.legend()
    fig.suptitle(f"1 prefill + k decode workers joined through etcd ({note})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--max-decode", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--step-timeout-s", type=float, default=300.0)
    parser.add_argument("--note", default="one host, every process on its cores",
                        help="what the run's box was like (goes into the JSON and the plot)")
    parser.add_argument("--out", default=None,
                        help="JSON path, the plot beside it as .png (default: fleet_scale.json "
                             "in --output-dir)")
    add_output_dir(parser, "fleet_scale")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet_scale", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.max_decode < 1:
        parser.error("--max-decode must be >= 1")
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp:
        steps = run_fleet(args, Path(tmp))
    out = output_path(args, "fleet_scale", "fleet_scale.json", args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "fleet_scale", "note": args.note,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "workload": {"dataset": "random", "input_len": args.input_len,
                     "output_len": args.output_len, "num_prompts": args.num_prompts,
                     "concurrency": args.concurrency, "request_rate": "inf", "seed": 0,
                     "ignore_eos": True, "num_warmups": 2},
        "fleet": {"prefill": 1, "router": 1, "discovery": "etcd (--discovery-ttl-s 5)",
                  "worker_cpu_threads": 1, "num_kv_blocks": args.num_kv_blocks},
        "steps": steps,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(steps, out.with_suffix(".png"), args.note)
    print(f"{'decode':>6} {'req/s':>7} {'TTFT mean':>10} {'TTFT p99':>9} {'TPOT mean':>10} "
          f"{'failed':>6} {'join s':>6}")
    for s in steps:
        print(f"{s['num_decode']:>6} {s['request_throughput']:>7.2f} {s['mean_ttft_ms']:>10.0f} "
              f"{s['p99_ttft_ms']:>9.0f} {s.get('mean_tpot_ms', 0):>10.1f} {s['failed']:>6} "
              f"{s['join_s']:>6.1f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
