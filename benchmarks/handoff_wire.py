"""The FP8 hand-off wire (`--handoff-wire fp8`, pdserve/handoff/wire_fp8.py) against the raw one:
what it does to greedy tokens and to the KV, and the bytes it saves.

    python -m benchmarks.handoff_wire

A seeded random Llama (fp32, then bf16) in a temporary directory; a prefill worker's and a
decode worker's request gateways in one process, the prefill's hand-off node served on
127.0.0.1 (no shared memory, no following: every hand-off is read over the node's socket,
as between hosts). Each of --num-prompts seeded random prompts is prefilled, handed off and
decoded greedily (--max-tokens), once with the raw wire and once with FP8:

    identical     prompts whose greedy tokens are the raw run's, all of them
    first diff    the earliest output position where a differing prompt differs
    KV max abs    the largest |decoded - original| over every value handed off (the
                  original: the block the prefill offered; decoded: what decode installs)
    KV max rel    the same over the value's group scale x 448 (its group's largest value)
    wire bytes    the bytes the node offered per raw byte
    FP8 cache     for reference, prompts whose greedy tokens with pdserve's FP8 KV cache
                  (`--kv-cache-dtype fp8`, one scale of 1.0) are a bf16/fp32 cache's, one
                  colocated engine each (and the raw wire's tokens are checked equal to the
                  colocated engine's: raw_wire_equals_colocated)

Prints a table, then the JSON as the last line, and writes it to --output.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.output import add_output_dir, output_path
from pdserve.benchmarks.plots import save_json

BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory instead of the random tiny Llamas "
                             "(--dtypes then ignored); `mid`: the llama-mid-like random "
                             "model of pdserve/benchmarks/offline.py")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="")
    parser.add_argument("--output", default=None, help="the JSON file (default: the run's "
                                                        "output folder)")
    add_output_dir(parser, "handoff_wire")


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prompt_len, args.max_prompt_len + 1, (args.num_prompts,),
                            generator=generator)
    return [torch.randint(3, vocab_size, (int(n),), generator=generator).tolist()
            for n in lengths]


def _drive(gateways, done, timeout_s: float = 600.0) -> list:
    """The two workers' loops without sockets: poll transfers, step, collect outputs."""
    outputs: list = []
    deadline = time.monotonic() + timeout_s
    while not done(outputs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no end after {timeout_s} s: {outputs[-3:]}")
        for gateway in gateways:
            outputs += gateway.poll()
            if gateway.engine.has_unfinished_requests():
                outputs += [w for d in gateway.engine.step()
                            if (w := gateway.to_wire(d)) is not None]
        time.sleep(0.001)
    return outputs


def run_wire(model_dir: Path, prompts: list[list[int]], wire: str, max_tokens: int
             ) -> dict[str, Any]:
    """Every prompt prefilled, handed off over the node's socket with `wire`, decoded
    greedily: the tokens, and (fp8) the KV error of every block handed off."""
    from transformers import AutoTokenizer

    from pdserve.handoff.node import NodeHandoff
    from pdserve.handoff.node_server import HandoffNode
    from pdserve.handoff.wire_fp8 import Fp8Wire, decode_block
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.protocol.worker import GenerateRequest
    from pdserve.serve.config import CacheConfig, ModelConfig
    from pdserve.serve.engine.engine import Engine
    from pdserve.serve.worker.gateway import RequestGateway
    from pdserve.serve.worker.kv_transfer import KVTransfer

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engines = [Engine(ModelConfig(str(model_dir)), CacheConfig(block_size=BLOCK_SIZE,
                                                               num_blocks=512),
                      tokenizer=tokenizer) for _ in range(2)]
    node = HandoffNode("prefill", "127.0.0.1", 512, 30.0, 10.0)
    transfers = [KVTransfer.connect(engines[0].runner, engines[0].block_manager, None,
                                    handoff_node=node, shm=False),
                 KVTransfer.connect(engines[1].runner, engines[1].block_manager, None,
                                    shm=False)]
    connector = transfers[0].connector
    errors = {"max_abs": 0.0, "max_rel": 0.0, "raw_bytes": 0, "wire_bytes": 0}
    if wire == "fp8":
        transport = connector.transport
        assert isinstance(transport, NodeHandoff)
        transport.wire = Fp8Wire.for_block_shape(list(connector.block_shape), connector.dtype)
        encode = transport.wire.encode

        def encode_and_measure(block: torch.Tensor) -> torch.Tensor:
            encoded = encode(block)
            original = block.view(-1).view(connector.dtype).float()
            decoded = decode_block(encoded, block.numel()).view(connector.dtype).float()
            groups = original.view(transport.wire.num_groups, -1)
            largest = groups.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            error = (decoded.view_as(groups) - groups).abs()
            errors["max_abs"] = max(errors["max_abs"], float(error.max()))
            errors["max_rel"] = max(errors["max_rel"], float((error / largest).max()))
            errors["raw_bytes"] += block.numel()
            errors["wire_bytes"] += encoded.numel()
            return encoded

        transport.wire.encode = encode_and_measure  # type: ignore[method-assign]
    prefill = RequestGateway(engines[0], "prefill", "p", transfers[0])
    moved_bytes = 0.0
    decode = RequestGateway(engines[1], "decode", "d", transfers[1])
    tokens: list[list[int] | None] = []  # None: its read failed and decode recomputed it
    try:
        for i, prompt in enumerate(prompts):
            request_id = f"r{i}"
            prefill.add(GenerateRequest(request_id, prompt, greedy))
            [first] = [o for o in _drive([prefill], lambda outs: any(
                o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
            assert first.handoff is not None and first.handoff.block_keys
            decode.add(GenerateRequest(request_id, prompt, greedy, handoff=first.handoff))
            outputs = _drive([prefill, decode], lambda outs, request_id=request_id: any(
                o.request_id == request_id and o.finish_reason not in (None, "handoff")
                for o in outs) and not decode.is_busy and not prefill.is_busy)
            mine = [o for o in outputs if o.request_id == request_id]
            assert all(o.error is None for o in mine), mine
            moved = transfers[1].totals()["handoff_bytes"] > moved_bytes
            moved_bytes = transfers[1].totals()["handoff_bytes"]
            tokens.append(first.token_ids + [t for o in mine for t in o.token_ids]
                          if moved else None)
        assert transfers[1].totals()["in_place_count"] == 0
    finally:
        for transfer in transfers:
            transfer.close()
        node.close()
        for engine in engines:
            engine.shutdown()
    return {"wire": wire, "tokens": tokens, "kv_dtype": str(connector.dtype), **errors}


def cache_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int,
                 kv_cache_dtype: str) -> list[list[int]]:
    """Greedy tokens of one colocated engine whose KV cache is `kv_cache_dtype` (the
    reference: what pdserve's own FP8 cache, one scale of 1.0, does on the same model)."""
    from transformers import AutoTokenizer

    from pdserve.protocol.sampling import SamplingParams
    from pdserve.serve.config import CacheConfig, ModelConfig
    from pdserve.serve.engine.engine import Engine

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = Engine(ModelConfig(str(model_dir)), CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=512, kv_cache_dtype=kv_cache_dtype),
        tokenizer=AutoTokenizer.from_pretrained(model_dir))
    tokens: dict[str, list[int]] = {}
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, greedy, f"r{i}")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    finally:
        engine.shutdown()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def compare(raw: dict[str, Any], fp8: dict[str, Any]) -> dict[str, Any]:
    """How the FP8 run's tokens differ from the raw run's (over the prompts whose KV crossed
    in both runs: a failed read is recomputed, which says nothing of the wire)."""
    pairs = [(x, y) for x, y in zip(raw["tokens"], fp8["tokens"], strict=True)
             if x is not None and y is not None]
    first_diffs = [next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
                   for x, y in pairs if x != y]
    return {"kv_pool_dtype": fp8["kv_dtype"], "num_prompts": len(pairs),
            "num_reads_failed": len(raw["tokens"]) - len(pairs),
            "num_identical": len(pairs) - len(first_diffs),
            "first_diff_positions": first_diffs,
            "kv_max_abs_error": fp8["max_abs"], "kv_max_rel_error": fp8["max_rel"],
            "wire_bytes_per_raw_byte": fp8["wire_bytes"] / max(fp8["raw_bytes"], 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from pdserve.serve.default_model import build_random_model

    results: dict[str, dict[str, Any]] = {}

    def measure(name: str, model_dir: Path) -> None:
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = _prompts(args, vocab_size)
        raw = run_wire(model_dir, prompts, "raw", args.max_tokens)
        fp8 = run_wire(model_dir, prompts, "fp8", args.max_tokens)
        results[name] = compare(raw, fp8)
        cache = [cache_tokens(model_dir, prompts, args.max_tokens, dtype)
                 for dtype in ("auto", "fp8")]
        results[name]["fp8_cache_num_identical"] = sum(
            a == b for a, b in zip(*cache, strict=True))
        results[name]["raw_wire_equals_colocated"] = sum(
            a == b for a, b in zip(raw["tokens"], cache[0], strict=True))

    if args.model is not None:
        from pdserve.benchmarks.offline import mid_model_dir

        model_dir = mid_model_dir() if args.model == "mid" else Path(args.model)
        measure(model_dir.name, model_dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for dtype in args.dtypes:
                measure(dtype, build_random_model(Path(tmp) / dtype, "llama", seed=args.seed,
                                                  dtype=dtype))
    print(f"{'model':>17} {'KV pool':>15} {'identical':>10} {'first diffs':>20} {'KV max abs':>11} "
          f"{'KV max rel':>11} {'wire B/raw B':>13} {'FP8 cache identical':>20}")
    for dtype, r in results.items():
        print(f"{dtype:>17} {r['kv_pool_dtype']:>15} "
              f"{r['num_identical']:>4} / {r['num_prompts']:<3} "
              f"{str(r['first_diff_positions'][:6]):>20} {r['kv_max_abs_error']:>11.4g} "
              f"{r['kv_max_rel_error']:>11.4g} {r['wire_bytes_per_raw_byte']:>13.3f} "
              f"{r['fp8_cache_num_identical']:>13} / {r['num_prompts']:<4}")
    report = {"benchmark": "handoff_wire", "model": args.model or "random llama "
              f"(default_model, seed {args.seed})", "block_size": BLOCK_SIZE,
              "num_prompts": args.num_prompts,
              "prompt_len": [args.min_prompt_len, args.max_prompt_len],
              "max_tokens": args.max_tokens, "note": args.note,
              "load_average_1_5_15": list(os.getloadavg()), "results": results}
    print(json.dumps(report))
    save_json(report, output_path(args, "handoff_wire", "handoff_wire.json", args.output))
    return report


if __name__ == "__main__":
    main()
