"""One-sided KV writes through NIXL on this host: what a layer-by-layer push from prefill
straight into decode's registered blocks would cost, beside the transport pdserve uses now.

    python -m benchmarks.nixl_write [--layers 8] [--layer-kib 512]
        [--rounds 20]   # needs `pip install nixl`; UCX_TLS=tcp,self for the two-host path

Two processes, each a NIXL agent with the UCX backend and host (DRAM) buffers: "decode"
registers a pool, "prefill" a source of the same size. For each round the prefill writes every
layer with its own one-sided WRITE (one descriptor a layer, as a layer's blocks finish), the
last carrying a notification; decode times the round from the first write's post (clock shared
through the pipe's start message) to the notification's arrival, then checks the bytes. Then
both sit idle for --idle-s and report the CPU each burned meanwhile (NIXL's progress threads
poll). The agents' metadata and descriptors cross a local pipe, not a socket.

Prints one JSON object: per-round latency (median, p90), the bandwidth it implies, and the idle
CPU of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _send(stream: Any, kind: str, payload: bytes = b"") -> None:
    stream.write(json.dumps({"kind": kind, "hex": payload.hex()}).encode() + b"\n")
    stream.flush()


def _receive(stream: Any, kind: str) -> bytes:
    message = json.loads(stream.readline())
    if message.get("kind") != kind:
        raise RuntimeError(f"expected {kind!r}, got {message.get('kind')!r}")
    return bytes.fromhex(message["hex"])


def _agent(name: str, progress_thread: bool) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                              backends=["UCX"]))


def decode_side(args: argparse.Namespace) -> None:
    """The target: register the pool, hand over metadata, time each round to its notice."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")  # the pipe: NIXL and UCX print to stdout, send it to stderr
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    agent = _agent("decode", args.progress_thread)
    layers = torch.zeros(args.layers, args.layer_kib * 1024, dtype=torch.uint8)  # the "pool"
    agent.register_memory(layers)
    descs = agent.get_xfer_descs([layers[i] for i in range(args.layers)])
    _send(out, "meta", agent.get_agent_metadata())
    _send(out, "descs", agent.get_serialized_descs(descs))
    rounds = []
    for r in range(args.rounds):
        start = float(_receive(inp, "start").decode())
        notice = f"done-{r}".encode()
        while True:
            if any(notice in found for found in agent.get_new_notifs().values()):
                break
        rounds.append(time.time() - start)
        if not (layers == (r + 1) % 256).all():
            raise RuntimeError(f"round {r}: the bytes differ")
        _send(out, "ack")
    before = _cpu_s()
    time.sleep(args.idle_s)
    idle = (_cpu_s() - before) / args.idle_s
    _send(out, "result", json.dumps({"rounds_s": rounds, "idle_cores": idle}).encode())


def prefill_side(args: argparse.Namespace, decode: subprocess.Popen) -> dict[str, Any]:
    inp, out = decode.stdout, decode.stdin
    agent = _agent("prefill", args.progress_thread)
    source = torch.zeros(args.layers, args.layer_kib * 1024, dtype=torch.uint8)
    agent.register_memory(source)
    peer = agent.add_remote_agent(_receive(inp, "meta"))
    # prepared once (as a connector would per peer): each write then names its layer's index
    local = agent.prep_xfer_dlist("", agent.get_xfer_descs([source[i]
                                                            for i in range(args.layers)]))
    remote = agent.prep_xfer_dlist(peer, agent.deserialize_descs(_receive(inp, "descs")))
    post_s = []
    for r in range(args.rounds):
        source.fill_((r + 1) % 256)
        start = time.time()
        _send(out, "start", repr(start).encode())
        handles = []
        for i in range(args.layers):  # one WRITE a layer, as each finishes
            notice = f"done-{r}".encode() if i == args.layers - 1 else b""
            handle = agent.make_prepped_xfer("WRITE", local, [i], remote, [i], notice)
            agent.transfer(handle)
            handles.append(handle)
        post_s.append(time.time() - start)
        for handle in handles:
            while agent.check_xfer_state(handle) not in ("DONE", "ERR"):
                pass
            agent.release_xfer_handle(handle)
        _receive(inp, "ack")
    before = _cpu_s()
    time.sleep(args.idle_s)
    idle = (_cpu_s() - before) / args.idle_s
    result = json.loads(_receive(inp, "result"))
    rounds = sorted(result["rounds_s"][1:])  # the first round sets up the endpoints
    nbytes = args.layers * args.layer_kib * 1024
    median = statistics.median(rounds)
    return {"layers": args.layers, "bytes_per_round": nbytes,
            "ucx_tls": os.environ.get("UCX_TLS", "(UCX's choice)"),
            "round_ms_median": median * 1e3,
            "round_ms_p90": rounds[int(0.9 * (len(rounds) - 1))] * 1e3,
            "gb_per_s": nbytes / median / 1e9,
            "post_ms_median": statistics.median(post_s[1:]) * 1e3,
            "progress_thread": args.progress_thread,
            "idle_cores": {"prefill": idle, "decode": result["idle_cores"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layer-kib", type=int, default=512,
                        help="bytes a layer writes (llama-mid: 256 tokens x 2 KiB a layer)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--progress-thread", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="NIXL's own progress thread (it polls); without it, transfers "
                             "progress only while the caller polls their state")
    parser.add_argument("--decode-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_side:
        decode_side(args)
        return 0
    command = [sys.executable, "-m", "benchmarks.nixl_write",
               "--decode-side", "--layers", str(args.layers), "--layer-kib",
               str(args.layer_kib), "--rounds", str(args.rounds), "--idle-s", str(args.idle_s),
               "--progress-thread" if args.progress_thread else "--no-progress-thread"]
    decode = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        result = prefill_side(args, decode)
    finally:
        decode.kill()
        decode.wait(10)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
