"""A/B of two builds of pdserve's CPU kernels on the llama-mid-like model's four products, 8
layers, panels on huge pages: both builds loaded in one process, interleaved, 5 rounds.

    python benchmarks/results/step-roofline-5dec-hugepages/panel_prefetch_ab.py A B [ROWS ...]

A, B: the suffix of a build in ~/.cache/torch_extensions/py311_cpu/pdserve_cpu_ops_<HASH>."""

from __future__ import annotations

import glob
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from pdserve.serve.huge_pages import huge_page_buffer
from pdserve.serve.parallel import pack_panels

SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)]  # qkv, o, gate_up, down
BUILDS = Path.home() / ".cache/torch_extensions/py311_cpu"


def build(suffix: str) -> ModuleType:
    path = glob.glob(str(BUILDS / f"pdserve_cpu_ops_{suffix}" / "*.so"))[0]
    spec = importlib.util.spec_from_file_location(f"pdserve_cpu_ops_{suffix}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    torch.set_num_threads(2)
    a, b = build(sys.argv[1]), build(sys.argv[2])
    gen = torch.Generator().manual_seed(0)
    panels = [pack_panels(torch.randn(n, k, generator=gen), 48)
              for _ in range(8) for n, k in SHAPES]
    buffer = huge_page_buffer(sum(p.numel() + 16 for p in panels) * 4).view(torch.float32)
    offset, layers = 0, []
    for p in panels:
        home = buffer[offset:offset + p.numel()]
        home.copy_(p)
        layers.append(home)
        offset += p.numel() + (-p.numel()) % 16

    def run(ops: ModuleType, rows: int) -> float:
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        for i, w in enumerate(layers):
            ops.panel_linear(xs[i % 4], w, None)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for i, w in enumerate(layers):
                ops.panel_linear(xs[i % 4], w, None)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for rows in [int(r) for r in sys.argv[3:]] or [8, 12, 16, 24, 32]:
        ta, tb = [], []
        for _ in range(5):
            ta.append(run(a, rows))
            tb.append(run(b, rows))
        ma, mb = statistics.median(ta), statistics.median(tb)
        print(f"{rows:3d} rows: A {ma * 1e3:.2f} ms  B {mb * 1e3:.2f} ms  B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
