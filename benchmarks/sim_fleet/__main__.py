"""Fleets of simulated workers on one host (`pdserve up --engine sim`): what only shows at
fleet scale, measured with pdserve's own router, store, hand-off and supervisor.

    python -m benchmarks.sim_fleet scale    [--num-prefill 32 --num-decode 32]
    python -m benchmarks.sim_fleet capacity [--rates 50 100 200 400] [--clients 3]
    python -m benchmarks.sim_fleet routing  [--trace FILE --num-requests 2000]
    python -m benchmarks.sim_fleet chaos    [--num-workers 32 --duration-s 300]
    python -m benchmarks.sim_fleet fidelity --measured-profile P.json [--decode-profile E.json]
    python -m benchmarks.sim_fleet phases   [--num-workers 8 --phase-s 60 --splits 2 4 6]
    python -m benchmarks.sim_fleet placement  [--num-prefill 2 --num-decode 2 --local-tokens 64]
    python -m benchmarks.sim_fleet fleet-size [--rates 12 24 40 --shape 512 64]

scale     starts the fleet, times it to ready, reads every process's memory (Rss, and Pss,
          which shares each page among the processes mapping it: what the fleet sums to),
          checks that /status and /metrics list every worker, and serves a short load.
capacity  open-loop streamed load (48 words, ~110 tokens, in; 16 out; fresh prompts) at rising
          rates from client processes of their own: the router's achieved rate, the clients' TTFT
          and what the router added to each first token (pdserve:first_token_router_added_
          seconds, TTFT less the first worker's phases), and the router's CPU.
routing   the Mooncake conversation trace (lengths scaled to 16-token blocks) over 16 prefill
          workers with each --prefill-routing: prefix tokens reused against one unbounded
          cache's (the ideal), and the busiest worker's prompt tokens against the mean.
fidelity  a real 1P+1D (pdserve up, --model, default llama-mid) against the same fleet
          simulated with --measured-profile, alternated, through vLLM's `bench serve` at each
          rate: TTFT p50/p90, TPOT p50, goodput, throughput, sim against real.
phases    the goodput controller (--controller flip) under a load alternating between
          prefill-heavy and decode-heavy phases, against fixed splits and a per-phase oracle
          (benchmarks/sim_fleet/phases.py).
placement, fleet-size: placement per request against always-remote prefill on a mixed load,
          and the controller's fleet size against a sweep of served fleets
          (benchmarks/sim_fleet/sizing.py).
chaos     a 70%-of-capacity load of greedy requests while a random 10% of the workers is
          SIGKILLed every 30 s (the supervisor restarts them): failures by cause, every stream
          against the same prompt's undisturbed text, and every block, lease and pin free after.

Every fleet simulates DistServe's OPT-13B on A100 profile (bundled) at --speedup; the workers
are forked from the launcher. JSON and plots go to --output-dir; `lscpu`'s model name is
recorded with every result.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.sim_fleet import experiments, fidelity, phases, sizing
from benchmarks.sim_fleet.load import add_client_arguments, run_client
from pdserve.benchmarks.output import add_output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_fleet",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    runs = {**experiments.EXPERIMENTS, "fidelity": fidelity.fidelity, "phases": phases.phases,
            "placement": sizing.placement, "fleet-size": sizing.fleet_size}
    arguments = {**experiments.ARGUMENTS, "fidelity": fidelity.add_fidelity_arguments,
                 "phases": phases.add_phases_arguments,
                 "placement": sizing.add_placement_arguments,
                 "fleet-size": sizing.add_fleet_size_arguments}
    for name, run in runs.items():
        sub = commands.add_parser(name, help=run.__doc__.split("\n")[0].replace("%", "%%"))
        experiments.add_common_arguments(sub)
        arguments[name](sub)
        add_output_dir(sub, "sim_fleet")
    add_client_arguments(commands.add_parser("client", help="one load client (internal)"))
    args = parser.parse_args(argv)
    if args.command == "client":
        return run_client(args)
    return runs[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
