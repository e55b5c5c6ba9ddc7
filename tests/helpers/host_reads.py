"""What leaves for the host while a block runs, recorded as (what, number of elements). On a
GPU each is a read the device must finish first; a step that reads only small tensors never
waits for the device mid-step.

Two ways to record, one list of reads:

- `host_reads()`: every tensor read out with .cpu(), .tolist(), .item() or .numpy(), or
  turned into a Python number (int(), float(), bool(), an index), on any thread. On CPU every
  tensor is both host and device, so copies (`.to`, `copy_`) cannot be told apart here.
- `host_reads(logits, ...)`: the given tensors, and every tensor computed from them or made
  with an explicit `device=`, count as on the device; everything else is on the host. On the
  calling thread it records, besides the reads above of device tensors: `.to(device)` and
  `.cpu()` to the host, `copy_` into a host tensor, blocking copies to the device (`.to` or
  `copy_` without non_blocking, `torch.tensor(data, device=...)`), indexing a device tensor
  with a Python list, a boolean mask or a host tensor, `nonzero` and the other ops whose
  output size depends on the data (`masked_select`, `unique`, `bincount`, ...), and host
  tensors of more than one element mixed into a device op (an error on a GPU). Copies to the
  device that do not wait (`non_blocking=True`) are not reads; they are kept apart in
  `.uploads` (what, number of elements), so a test can bound their size. A tensor meant for
  the host is made without `device=`; one meant for the device with it, or sent down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

READS = ("cpu", "tolist", "item", "numpy")
NUMBERS = {"__int__": "int", "__float__": "float", "__bool__": "bool", "__index__": "index",
           "__complex__": "complex"}
# outputs whose size depends on the data: the host reads that size before it can go on
DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
              "bincount", "equal", "allclose", "is_nonzero"}
TEXT = {"__repr__", "__str__", "__format__", "__array__"}
FACTORIES_FROM_DATA = {"tensor", "as_tensor", "asarray", "from_numpy"}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


class HostReads(list):
    """[(what, number of elements)] read back to the host; `.uploads`: copies sent to the
    device without waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: list[tuple[str, int]] = []


@contextlib.contextmanager
def host_reads(*device_tensors: torch.Tensor) -> Iterator[HostReads]:
    """Records every read to the host (see the module docstring)."""
    seen = HostReads()
    if device_tensors:
        with _DeviceMode(seen, device_tensors):
            yield seen
        return
    patched = {name: getattr(torch.Tensor, name) for name in (*READS, *NUMBERS)}

    def recorder(name: str):
        def record(tensor, *args, **kwargs):
            seen.append((NUMBERS.get(name, name), tensor.numel()))
            return patched[name](tensor, *args, **kwargs)
        return record

    for name in patched:
        setattr(torch.Tensor, name, recorder(name))
    try:
        yield seen
    finally:
        for name, method in patched.items():
            setattr(torch.Tensor, name, method)


class _DeviceMode(TorchFunctionMode):
    """Tags the device tensors, follows them through every torch call on this thread, and
    records what would make the host wait for them."""

    def __init__(self, seen: HostReads, device_tensors: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.seen = seen
        self.tagged: dict[int, torch.Tensor] = {}  # strong references keep the ids unique
        for tensor in device_tensors:
            self._tag(tensor)

    def _tag(self, tensor: torch.Tensor) -> None:
        self.tagged[id(tensor)] = tensor

    def on_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self.tagged

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device_inputs = [t for t in tensors if self.on_device(t)]
        makes_device = bool(device_inputs)
        receiver = args[0] if args else None
        if name in FACTORIES_FROM_DATA:
            if kwargs.get("device") is not None:
                out = func(*args, **kwargs)
                self.seen.append(("tensor_to_device", out.numel()))
                self._tag(out)
                return out
            makes_device = False
        elif kwargs.get("device") is not None and not device_inputs:
            makes_device = name not in ("to", "cuda")  # a factory on the device
        if name in ("to", "cuda", "cpu") and isinstance(receiver, torch.Tensor):
            makes_device = self._move(name, receiver, args[1:], kwargs)
        elif name == "copy_":
            self._copy(args[0], args[1], bool(kwargs.get("non_blocking", args[2:3] == (True,))))
            makes_device = False
        elif device_inputs:
            self._check(name, receiver, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if makes_device:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and not (
                        leaf is receiver and not self.on_device(receiver)
                        and name.endswith("_") and name != "to"):
                    self._tag(leaf)
        return out

    def _move(self, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        """.to / .cuda / .cpu: whether the result is on the device."""
        target = kwargs.get("device")
        for arg in args:
            if isinstance(arg, (str, torch.device)):
                target = arg
            elif isinstance(arg, torch.Tensor):
                target = "device" if self.on_device(arg) else "cpu"
        if name == "cpu" or (name == "to" and target is not None and target != "device"
                             and self.on_device(tensor)):
            if self.on_device(tensor):
                self.seen.append(("to_host" if name == "to" else "cpu", tensor.numel()))
            return False
        if self.on_device(tensor):
            return True
        if name == "cuda" or target is not None:  # host -> device
            if kwargs.get("non_blocking", False):
                self.seen.uploads.append(("to_device", tensor.numel()))
            else:
                self.seen.append(("to_device_blocking", tensor.numel()))
            return True
        return False

    def _copy(self, dst: torch.Tensor, src: Any, non_blocking: bool) -> None:
        if not isinstance(src, torch.Tensor) or self.on_device(dst) == self.on_device(src):
            return
        if self.on_device(src):  # device -> host: the host reads it once the copy is done
            self.seen.append(("copy_to_host", src.numel()))
        elif non_blocking:
            self.seen.uploads.append(("copy_to_device", src.numel()))
        else:
            self.seen.append(("copy_to_device_blocking", src.numel()))

    def _check(self, name: str, receiver: Any, args: tuple, kwargs: dict,
               tensors: list[torch.Tensor]) -> None:
        """A call with device inputs: reads, data-sized outputs, host indices and host data."""
        if self.on_device(receiver) and (name in READS or name in TEXT):
            self.seen.append((name, receiver.numel()))
            return
        if self.on_device(receiver) and name in NUMBERS:
            self.seen.append((NUMBERS[name], receiver.numel()))
            return
        if name in DATA_SIZED or (name == "where" and len(args) + len(kwargs) == 1):
            self.seen.append((name, max(t.numel() for t in tensors)))
            return
        if name in INDEXING:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            parts = index if isinstance(index, tuple) or (
                name != "__getitem__" and isinstance(index, list)) else (index,)
            for part in parts:
                if isinstance(part, list):  # sent down from pageable memory, waited for
                    self.seen.append(("list_index", len(part)))
                elif isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8):
                    self.seen.append(("mask_index", part.numel()))  # a nonzero inside
                elif isinstance(part, torch.Tensor) and not self.on_device(part):
                    self.seen.append(("host_index", part.numel()))
            value = args[2] if name == "__setitem__" and len(args) > 2 else None
            if isinstance(value, torch.Tensor) and not self.on_device(value) \
                    and value.numel() > 1:
                self.seen.append(("host_value", value.numel()))
            return
        for tensor in tensors:
            if not self.on_device(tensor) and tensor.numel() > 1:
                self.seen.append(("host_tensor_in_device_op", tensor.numel()))
