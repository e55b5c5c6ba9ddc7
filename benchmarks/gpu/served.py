"""The served part of benchmarks/gpu/run.sh: `pdserve up` on one GPU (colocated, then 1P+1D
sharing it) and, where it is installed, vLLM's CUDA build, each under the same open-loop load.

    python -m benchmarks.gpu.served --output served.json [--rates 4 16] [--no-vllm]

The model is a random ~1B-parameter Llama in bf16 (hidden 2048, 16 layers, 16 heads over 4 KV
heads, intermediate 5632), built once into PDSERVE_CACHE_DIR; prompts are 512 random tokens in
and 128 out, fresh per rate (a seed per rate: nothing is served from a prefix cache). The
client is `vllm bench serve` where vLLM is installed (its own client, the reference), else
pdserve's harness (`pdserve bench`), which reports the same TTFT / TPOT / goodput.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from pdserve.benchmarks import server_process

GPU_MODEL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                 max_position_embeddings=4096)
PORT = 18800


def model_dir() -> Path:
    from pdserve import envs
    from pdserve.serve.default_model import build_random_model

    target = Path(envs.cache_dir()) / "llama-1b-random-bf16"
    if not (target / "config.json").exists():
        build_random_model(target, "llama", seed=0, dtype="bfloat16", **GPU_MODEL)
    return target


def bench(name: str, model: Path, rate: float, args: argparse.Namespace, out: Path) -> dict:
    """One rate against the server on PORT, by vLLM's client where installed, else pdserve's
    harness with the same flags (it mirrors them)."""
    served = httpx.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=10).json()["data"][0]["id"]
    client = ["vllm", "bench", "serve"] if shutil.which("vllm") else [
        sys.executable, "-m", "pdserve.app.cli", "bench"]
    result = f"{name}-{rate:g}.json"
    command = [*client, "--base-url", f"http://127.0.0.1:{PORT}", "--model", served,
               "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len",
               "512", "--random-output-len", "128", "--ignore-eos", "--num-prompts",
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
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args(argv)
    output = Path(args.output)
    work = output.parent / "served-runs"
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    pdserve = [sys.executable, "-m", "pdserve.app.cli", "up", "--model", str(model), "--port",
               str(PORT)]
    servers = {"colocated": [*pdserve, "--mode", "colocated"],
               "disagg": [*pdserve, "--mode", "disagg", "--allow-gpu-sharing"]}
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        servers["vllm"] = ["vllm", "serve", str(model), "--port", str(PORT),
                           "--served-model-name", "vllm", "--dtype", "bfloat16"]
    summary: dict = {"model": GPU_MODEL, "input_len": 512, "output_len": 128,
                     "vllm": "vllm" in servers or "not installed here"}
    for name, command in servers.items():
        try:
            process = server_process.start(command, work / f"{name}.log",
                                           f"http://127.0.0.1:{PORT}/v1/models", args.timeout_s,
                                           poll_s=2)
        except RuntimeError as exc:
            summary[name] = {"error": str(exc)}
            continue
        try:
            summary[name] = {f"{rate:g}": bench(name, model, rate, args, work)
                             for rate in args.rates}
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            summary[name] = {"error": str(exc)}
        finally:
            server_process.stop(process, timeout_s=20)
    output.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
