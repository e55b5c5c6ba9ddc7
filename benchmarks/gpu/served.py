"""The served part of benchmarks/gpu/run.sh: `pdserve up` on one GPU (colocated, then 1P+1D
sharing it) and, where it is installed, vLLM's CUDA build, each under the same open-loop load.

    python -m benchmarks.gpu.served --output served.json [--rates 4 16] [--no-vllm]
        [--client auto|vllm|pdserve] [--model DIR] [--work-dir DIR]

The model is a random ~1B-parameter Llama in bf16 (hidden 2048, 16 layers, 16 heads over 4 KV
heads, intermediate 5632), built once into PDSERVE_CACHE_DIR; prompts are 512 random tokens in
and 128 out, fresh per rate (a seed per rate: nothing is served from a prefix cache). The
client is `vllm bench serve` where vLLM's CLI is installed (its own client, the reference), else
pdserve's harness (`pdserve bench`), which mirrors its flags and reports the same TTFT / TPOT /
goodput; the JSON names the one that measured ("client"), and --client vllm refuses to fall
back. Each server's result is written as soon as it is measured (a run cut short keeps them);
a server's log stays in --work-dir, and its tail goes into the JSON where it failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from pdserve.benchmarks import server_process

GPU_MODEL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                 max_position_embeddings=4096)
PORT = 18800
CLIENTS = {"vllm": "vllm bench", "pdserve": "pdserve bench"}


def choose_client(asked: str) -> str:
    """"vllm" (vLLM's CLI, the reference) or "pdserve" (pdserve's harness): `asked` unless it
    is "auto", which takes vLLM's where its CLI is on PATH. Asking for vLLM's where it is
    missing is an error, never a silent swap."""
    if asked == "auto":
        return "vllm" if shutil.which("vllm") else "pdserve"
    if asked == "vllm" and not shutil.which("vllm"):
        raise SystemExit("--client vllm: no `vllm` command here")
    return asked


def model_dir() -> Path:
    from pdserve import envs
    from pdserve.serve.default_model import build_random_model

    target = Path(envs.cache_dir()) / "llama-1b-random-bf16"
    if not (target / "config.json").exists():
        build_random_model(target, "llama", seed=0, dtype="bfloat16", **GPU_MODEL)
    return target


def bench(name: str, model: Path, rate: float, args: argparse.Namespace, out: Path) -> dict:
    """One rate against the server on PORT, by args.client (vLLM's client or pdserve's
    harness with the same flags: it mirrors them)."""
    served = httpx.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=10).json()["data"][0]["id"]
    client = ["vllm", "bench", "serve"] if args.client == "vllm" else [
        sys.executable, "-m", "pdserve.app.cli", "bench"]
    result = f"{name}-{rate:g}.json"
    command = [*client, "--base-url", f"http://127.0.0.1:{PORT}", "--model", served,
               "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len",
               str(args.input_len), "--random-output-len", str(args.output_len),
               "--ignore-eos", "--num-prompts",
               str(args.num_prompts), "--request-rate", str(rate), "--seed", str(int(rate)),
               "--goodput", "ttft:1000", "tpot:100", "--save-result", "--result-dir", str(out),
               "--result-filename", result]
    subprocess.run(command, check=True, timeout=args.timeout_s)
    return json.loads((out / result).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 16.0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM server")
    parser.add_argument("--client", choices=["auto", *CLIENTS], default="auto",
                        help="the load generator (auto: vLLM's where installed)")
    parser.add_argument("--model", default=None, help="default: the random ~1B Llama")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--work-dir", default=None,
                        help="servers' logs and per-rate results (default: a temporary folder)")
    args = parser.parse_args(argv)
    args.client = choose_client(args.client)
    # a time limit's SIGTERM unwinds through the finally below: each server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    output = Path(args.output)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-served-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else model_dir()
    pdserve = [sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(model), "--port",
               str(PORT)]
    servers = {"colocated": [*pdserve, "--mode", "colocated"],
               "disagg": [*pdserve, "--mode", "disagg", "--allow-gpu-sharing"]}
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        servers["vllm"] = ["vllm", "serve", str(model), "--port", str(PORT),
                           "--served-model-name", "vllm", "--dtype", "bfloat16"]
    summary: dict = {"model": str(model) if args.model else GPU_MODEL,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "client": CLIENTS[args.client],
                     "vllm": "vllm" in servers or "not installed here"}
    print(f"client: {CLIENTS[args.client]}", flush=True)
    for name, command in servers.items():
        log = work / f"{name}.log"
        try:
            # /health answers 200 once a worker is ready (/v1/models answers before)
            process = server_process.start(command, log, f"http://127.0.0.1:{PORT}/health",
                                           args.timeout_s, poll_s=2)
        except RuntimeError as exc:
            summary[name] = {"error": str(exc), "log_tail": _tail(log)}
            output.write_text(json.dumps(summary, indent=1))
            continue
        try:
            summary[name] = {"client": CLIENTS[args.client], "rates": {}}
            for rate in args.rates:
                summary[name]["rates"][f"{rate:g}"] = bench(name, model, rate, args, work)
                output.write_text(json.dumps(summary, indent=1))
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            summary[name]["error"] = str(exc)
            summary[name]["log_tail"] = _tail(log)
        finally:
            server_process.stop(process, timeout_s=20)
            output.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary)[:2000])
    return 0 if all(_measured(summary[name]) for name in servers) else 1


def _measured(result: dict) -> bool:
    """Whether a server's every rate completed requests (a rate whose requests all failed, or a
    server that never served, fails the stage)."""
    rates = result.get("rates", {})
    return ("error" not in result and bool(rates)
            and all(rate.get("completed", 0) > 0 for rate in rates.values()))


def _tail(log: Path, num_lines: int = 20) -> str:
    """The last lines of a server's log (the reason it failed), or ""."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
