"""What leaves for the host: every tensor read out with .cpu(), .tolist(), .item() or .numpy()
while a block runs, recorded as (method, number of elements). On a GPU each is a copy the
device must finish first; a step that reads only small tensors never waits for the device
mid-step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def host_reads() -> Iterator[list[tuple[str, int]]]:
    """Records (method, number of elements) of every tensor read out to the host."""
    seen: list[tuple[str, int]] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "tolist", "item",
                                                                 "numpy")}

    def recorder(name):
        def record(tensor, *args, **kwargs):
            seen.append((name, tensor.numel()))
            return originals[name](tensor, *args, **kwargs)
        return record

    for name in originals:
        setattr(torch.Tensor, name, recorder(name))
    try:
        yield seen
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
