"""Host data sent to the device without making the host wait.

A copy from pageable host memory to a CUDA device is staged through a driver buffer while the
host waits (and a blocking one waits for the device's queued work first); from pinned memory
with `non_blocking=True` it is queued on the stream like a kernel. On CPU the "copy" is the
tensor itself.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor built this step, on `device`, from pinned memory on CUDA, not waited for.
    The host tensor must not be changed afterwards (the copy may still be reading it)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
