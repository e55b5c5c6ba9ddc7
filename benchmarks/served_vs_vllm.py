"""Served latency and goodput against vLLM, every server measured by vLLM's own client.

    python -m benchmarks.served_vs_vllm [--model DIR] [--rates 2 5 8]

Starts vLLM's CPU build, `pdserve up --mode colocated` and `--mode disagg` on the same model,
one at a time (they never share the cores), and runs `vllm bench serve` against each at every
rate: fresh random prompts (a seed per rate, so no rate is served from the prefix cache of the
one before), the same unmeasured warm-up for every server. Then `served_table` prints the table
with pdserve's ratios to vLLM and writes summary.json and served.png beside the runs.
Needs the peer installed once: ../shared/tools/vllm-peer install (venv /tmp/vllm-peer).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pdserve.benchmarks import served_table, server_process
from pdserve.benchmarks.output import add_output_dir, output_dir

PEER = "/work/shared/tools/vllm-peer"
PORT = 18700


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: step_roofline's llama-mid-like model)")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:100"])
    parser.add_argument("--servers", nargs="+", default=["vllm", "colocated", "disagg"],
                        choices=["vllm", "colocated", "disagg"])
    parser.add_argument("--up-args", default="", help="extra `pdserve up` flags")
    parser.add_argument("--peer", default=os.environ.get("VLLM_PEER", PEER),
                        help="the vLLM peer tool (serve, bench)")
    parser.add_argument("--peer-dtype", default=None,
                        help="serve vLLM in this dtype (bfloat16 for a bf16 checkpoint, as "
                             "vLLM's own default would; the peer tool serves float32)")
    add_output_dir(parser, "served_vs_vllm")


def server_command(server: str, model: Path, name: str, args: argparse.Namespace) -> list[str]:
    if server == "vllm" and args.peer_dtype:
        vllm = str(Path(os.environ.get("PEER_VENV", "/tmp/vllm-peer")) / "bin" / "vllm")
        return [vllm, "serve", str(model), "--host", "127.0.0.1", "--port", str(PORT),
                "--served-model-name", name, "--dtype", args.peer_dtype, "--max-model-len", "2048"]
    if server == "vllm":
        return [args.peer, "serve", str(model), str(PORT), name]
    pdserve = shutil.which("pdserve") or "pdserve"
    return [pdserve, "up", "--model", str(model), "--mode", server, "--port", str(PORT),
            "--worker-base-port", str(PORT + 10), "--store-port", str(PORT + 30),
            *args.up_args.split()]


def bench(args: argparse.Namespace, model: Path, name: str, rate: float, num_prompts: int,
          output_len: int, seed: int, save_as: Path | None) -> None:
    command = [args.peer, "bench", "--backend", "openai", "--base-url",
               f"http://127.0.0.1:{PORT}", "--model", name, "--tokenizer", str(model),
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
               "--request-rate", f"{rate:g}", "--seed", str(seed), "--ignore-eos",
               "--disable-tqdm"]
    if save_as is not None:
        command += ["--goodput", *args.goodput, "--percentile-metrics", "ttft,tpot,e2el",
                    "--metric-percentiles", "50,99", "--save-result",
                    "--result-dir", str(save_as.parent), "--result-filename", save_as.name]
    subprocess.run(command, check=save_as is not None,
                   stdout=None if save_as is not None else subprocess.DEVNULL,
                   stderr=subprocess.STDOUT)


def run(args: argparse.Namespace) -> int:
    if args.model:
        model = Path(args.model)
    else:
        from pdserve.benchmarks.offline import mid_model_dir

        model = mid_model_dir()
    name = model.name  # pdserve's router serves a checkpoint under its folder's name
    out = output_dir(args, "served_vs_vllm")
    out.mkdir(parents=True, exist_ok=True)
    for server in args.servers:
        # vLLM's CPU start takes 2-3 minutes; pdserve's builds its kernels on a first run
        process = server_process.start(server_command(server, model, name, args),
                                       out / f"serve-{server}.log",
                                       f"http://127.0.0.1:{PORT}/health", 600)
        try:
            bench(args, model, name, 4, 8, 8, 99991, None)  # the same unmeasured warm-up
            for rate in args.rates:
                print(f"== {server} at {rate:g} req/s", flush=True)
                bench(args, model, name, rate, args.num_prompts, args.output_len,
                      int(rate * 791900) + 1, out / f"{server}-rate{rate:g}.json")
        finally:
            server_process.stop(process)
        time.sleep(3)
    return served_table.main([str(out)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
