"""A/B of the weights on 4 KiB against 2 MiB pages, inside one engine: the fused decode loop's
weights swapped between two copies every round (interleaved), medians of the rounds.

    python benchmarks/results/step-roofline-5dec-hugepages/huge_pages_ab.py BATCH CONTEXT

The engine loads onto huge pages (serve/huge_pages.py); the 4 KiB copy is made here."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pdserve.benchmarks.step_roofline import mid_model_dir
from pdserve.serve import LLM, SamplingParams
from pdserve.serve.fused_decode import FusedDecode


def main() -> None:
    batch, context = int(sys.argv[1]), int(sys.argv[2])
    seen: list[FusedDecode] = []
    call = FusedDecode.__call__

    def record(self: FusedDecode, *args: object) -> object:
        seen.append(self)
        return call(self, *args)

    FusedDecode.__call__ = record  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1)
    with LLM(str(mid_model_dir()), block_size=16, num_kv_blocks=batch * (context // 16 + 20) + 64,
             max_num_seqs=batch, max_model_len=context + 400, enable_prefix_caching=False) as llm:
        torch.set_num_threads(2)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=330, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(torch.randint(10, 1000, (context,), generator=gen).tolist(), params)
        while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                              for r in engine.scheduler.running):
            engine.step()
        engine.step()
        fused = seen[-1]
        huge = list(fused._weights)
        small = [w.clone() if w.numel() * w.element_size() >= 1 << 20 else w for w in huge]
        medians: dict[str, list[float]] = {"4 KiB pages": [], "2 MiB pages": []}
        for _ in range(16):
            for name, weights in (("4 KiB pages", small), ("2 MiB pages", huge)):
                fused._weights = weights
                engine.step()
                engine.step()
                times = []
                for _ in range(8):
                    start = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start)
                medians[name].append(statistics.median(times))
        for name, values in medians.items():
            print(f"{batch} x {context} {name}: {statistics.median(values) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
