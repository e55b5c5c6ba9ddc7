"""How close a simulated fleet comes to the real one it simulates (`python -m benchmarks.sim_fleet
fidelity`; benchmarks/sim_fleet/__main__.py says what it measures)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.sim_fleet import experiments as ex
from benchmarks.sim_fleet.fleet import Fleet
from pdserve.benchmarks.output import output_dir
from pdserve.benchmarks.plots import pyplot, save_figure

VLLM_PEER = Path(__file__).resolve().parents[3] / "shared" / "tools" / "vllm-peer"


def add_fidelity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="the real fleet's checkpoint (default: llama-mid)")
    parser.add_argument("--measured-profile", type=Path, required=True,
                        help="`pdserve profile --served` of --model on this machine")
    parser.add_argument("--decode-profile", type=Path, default=None,
                        help="take the simulated decode model from this profile instead (the "
                             "engine profile `pdserve profile --served` writes beside its "
                             "output, -engine.json: a sim worker runs its own step overheads "
                             "for real, which the served decode factor already counts)")
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=2, help="real and sim alternate")
    parser.add_argument("--client", choices=("vllm", "pdserve"), default="vllm",
                        help="vllm: `vllm bench serve` from ../shared/tools/vllm-peer's venv")


def _bench(args: argparse.Namespace, fleet: Fleet, model_dir: Path, rate: float,
           result: Path) -> dict[str, Any]:
    common = ["--base-url", fleet.base_url, "--model", fleet.model, "--tokenizer",
              str(model_dir), "--dataset-name", "random", "--random-input-len",
              str(args.input_len), "--random-output-len", str(args.output_len),
              "--ignore-eos", "--num-prompts", str(args.num_prompts), "--request-rate",
              str(rate), "--seed", str(args.seed + int(rate * 10)), "--goodput",
              f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}", "--save-result",
              "--result-filename", result.name, "--result-dir", str(result.parent),
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if args.client == "vllm":
        command = [str(VLLM_PEER), "bench", "--backend", "openai", "--endpoint",
                   "/v1/completions", *common]
    else:
        command = [sys.executable, "-m", "pdserve.app.cli", "bench", *common]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(result.read_text())
    return {"ttft_p50_ms": data.get("median_ttft_ms", data.get("p50_ttft_ms")),
            "ttft_p90_ms": data.get("p90_ttft_ms"), "tpot_p50_ms": data.get("median_tpot_ms",
                                                                            data.get("p50_tpot_ms")),
            "goodput": data.get("request_goodput"), "throughput": data.get("request_throughput"),
            "completed": data.get("completed")}


def fidelity(args: argparse.Namespace) -> int:
    """A simulated 1P+1D against the real one it simulates, same client, same workload."""
    from pdserve.benchmarks.offline import mid_model_dir

    model_dir = args.model or mid_model_dir()
    out = output_dir(args, "sim_fleet")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"real": [], "sim": []}
    profile = json.loads(args.measured_profile.read_text())
    if args.decode_profile is not None:
        profile["decode"] = json.loads(args.decode_profile.read_text())["decode"]
        profile["source"] = f"{profile.get('source', '')}; decode from {args.decode_profile}"
    sim_profile = out / "fidelity-sim-profile.json"
    sim_profile.write_text(json.dumps(profile, indent=1))
    for round_no in range(args.rounds):
        for kind in (("real", "sim") if round_no % 2 == 0 else ("sim", "real")):
            flags = ["--num-prefill", "1", "--num-decode", "1"]
            if kind == "sim":
                flags += ["--engine", "sim", "--sim-profile", str(sim_profile)]
            print(f"[fidelity] round {round_no + 1}: {kind}", flush=True)
            fleet = Fleet.start(model_dir, out / f"fidelity-{kind}.log", args.port, *flags,
                                timeout_s=900.0, engine=None)
            try:
                for rate in args.rates:
                    result = out / f"fidelity-{kind}-{round_no}-{rate:g}.json"
                    level = {"round": round_no, "rate": rate,
                             **_bench(args, fleet, model_dir, rate, result)}
                    runs[kind].append(level)
                    print(f"[fidelity] {kind} {rate:g} req/s: {level}", flush=True)
            finally:
                fleet.stop()
    summary = []
    for rate in args.rates:
        row: dict[str, Any] = {"rate": rate}
        for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "goodput"):
            real = statistics.median(r[key] for r in runs["real"] if r["rate"] == rate)
            sim = statistics.median(r[key] for r in runs["sim"] if r["rate"] == rate)
            row[key] = {"real": real, "sim": sim,
                        "sim_vs_real": sim / real - 1 if real else float("nan")}
        summary.append(row)
        print(f"[fidelity] {rate:g} req/s: " + ", ".join(
            f"{k} {row[k]['sim_vs_real']:+.1%}" for k in row if k != "rate"), flush=True)
    report = {"machine": ex._machine(), "client": args.client, "model": str(model_dir),
              "profile": profile,
              "workload": {"input_len": args.input_len, "output_len": args.output_len,
                           "num_prompts": args.num_prompts},
              "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
              "runs": runs, "summary": summary}
    ex._write(args, "fidelity", report)
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    for ax, key in zip(axes, ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "goodput"),
                       strict=True):
        for kind in ("real", "sim"):
            ax.plot(args.rates, [row[key][kind] for row in summary], "o-", label=kind)
        ax.set_title(key)
        ax.set_xlabel("req/s")
    axes[0].legend()
    save_figure(fig, plt, out / "fidelity.png")
    return 0
