"""A server with scripted latencies for checking a benchmark client against another: every
request gets its first token after TTFT_S and the rest ITL_S apart (the tests' ScriptedSSEServer,
tests/bench_util.py), so two clients that read the same stream must report the same numbers.

    python benchmarks/results/scripted_server.py PORT TTFT_S ITL_S MODEL
    CLIENT_CPUS=1 benchmarks/results/bench_vs_vllm_client.sh http://127.0.0.1:PORT MODEL OUT_DIR
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from bench_util import ScriptedSSEServer, TokenScript  # noqa: E402


async def serve(port: int, ttft_s: float, itl_s: float, model: str) -> None:
    scripted = ScriptedSSEServer(
        lambda body: TokenScript(ttft_s, (itl_s,) * (int(body.get("max_tokens") or 16) - 1)),
        model=model)
    server = await asyncio.start_server(scripted._handle, "127.0.0.1", port)
    print(f"serving {model} on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    asyncio.run(serve(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
