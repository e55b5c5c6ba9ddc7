"""Which kernel implements each op in this process: the engine's one call into the kernel
registry (pdserve/kernels/registry.py) for the ops outside attention (norm, SiLU, rotary, linear
products). The attention ops go by backend (pdserve/serve/layers/attention.py).

The process's CPU path (`CpuPath`: how linear weights are packed, whether a decode step runs
the fused layer loop, whether AMX multiplies) names the candidates, best first; the registry
chooses among them (the first this machine can run):

    linear    amx (path.amx), cpu (PDSERVE_CPU_KERNELS), onednn, torch
    prepack   cpu: pdserve's panels (path.prepack "panels"), or onednn ("onednn"); none
    others    cpu (PDSERVE_CPU_KERNELS), torch

The path is chosen by measuring every candidate on the machine at hand
(pdserve/serve/executor/cpu_tuning.py) and set with `use_path`; until then the default path runs.
The environment's switches (PDSERVE_CPU_PREPACK, PDSERVE_FUSED_DECODE, PDSERVE_CPU_AMX) only take a
path out of the running, for experiments.

A CPU implementation takes every call its reference takes, running the reference where its
kernel does not apply (a CUDA tensor, another dtype), so one choice per process serves
every device. Decided once per process.

A process whose model runs on CUDA (`use_device`, from each rank) never loads the compiled CPU
ops: every op there runs its reference anyway, and the first load would build them (a minute or
more on a machine that never built them, before the first forward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pdserve import envs
from pdserve.kernels import registry


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """pdserve's compiled CPU ops (pdserve/kernels/cpu_ops.py), or None: switched off by
    PDSERVE_CPU_KERNELS=0, a process serving on CUDA (use_device), or not buildable here."""
    if not envs.cpu_kernels() or _device_type[-1:] == ["cuda"]:
        return None
    from pdserve.kernels import cpu_ops

    return cpu_ops.load()


PREPACKS = ("panels", "onednn", "none")


@dataclass(frozen=True)
class CpuPath:
    """One way to run a CPU worker's products: the choice the tuner measures and makes."""

    prepack: str = "panels"
    """Linear weights' packed copy: "panels" (pdserve's, pdserve/kernels/csrc/skinny_gemm.cpp),
    "onednn" (torch's matmul library's blocked layout) or "none" (the plain weight only: the
    skinny product for a decode step's rows, torch's matmul past them)."""
    fused_decode: bool = True
    """A decode step's layer loop as one compiled call (pdserve/serve/layers/fused_decode.py)."""
    amx: bool = True
    """bf16 panels multiply on AMX from amx_min_rows rows on, where the CPU has AMX."""
    plain_rows: int = 0
    """Products of at most this many rows (a decode step's few) read the plain weight, the
    skinny product (and the fused loop over the plain weights); more rows read the packed
    copy. 0: every product reads the packed copy. Where a large cache holds the weights, the
    plain stream wins at few rows and the panels at many."""

    def __post_init__(self) -> None:
        if self.prepack not in PREPACKS:
            raise ValueError(f"prepack must be one of {PREPACKS}, got {self.prepack!r}")
        if self.plain_rows < 0 or (self.plain_rows and self.prepack == "none"):
            raise ValueError("plain_rows splits a packed layout's products: >= 0, and 0 when "
                             "nothing is packed")

    @property
    def label(self) -> str:
        on = {True: "on", False: "off"}
        split = f" plain<={self.plain_rows}" if self.plain_rows else ""
        return (f"prepack={self.prepack}{split} fused={on[self.fused_decode]} "
                f"amx={on[self.amx]}")

    def allowed_by_environment(self) -> bool:
        """False where an environment switch turned this path's choice off."""
        return ((envs.cpu_prepack() or self.prepack == "none")
                and (envs.fused_decode() or not self.fused_decode)
                and (envs.cpu_amx() or not self.amx))


_chosen_path: list[CpuPath] = []  # the path use_path set; empty: the default
_device_type: list[str] = []  # the device type use_device set; empty: the CPU


def use_device(device_type: str) -> None:
    """The type of device ("cpu", "cuda") this process's model runs on, set before its first
    forward (pdserve/serve/executor/rank.py); every op is chosen again."""
    _device_type.clear()
    _device_type.append(device_type)
    cpu_kernels.cache_clear()
    use_path(_chosen_path[-1] if _chosen_path else None)


def default_path() -> CpuPath:
    """The path that runs until one is measured: each switch as the environment leaves it,
    pdserve's panels where its kernels built them (AVX-512), else oneDNN's layout."""
    from pdserve.kernels import cpu_linear

    panels = cpu_kernels() is not None and cpu_linear.panel_width() > 0
    prepack = ("panels" if panels else "onednn") if envs.cpu_prepack() else "none"
    return CpuPath(prepack, envs.fused_decode(), envs.cpu_amx())


def path() -> CpuPath:
    """The CPU path this process runs."""
    return _chosen_path[-1] if _chosen_path else default_path()


def use_path(chosen_path: CpuPath | None) -> None:
    """Run `chosen_path` from now on (None: the default); every op is chosen again. The
    caller repacks the weights and rebuilds the fused loop
    (pdserve/serve/executor/cpu_tuning.py apply)."""
    _chosen_path.clear()
    if chosen_path is not None:
        _chosen_path.append(chosen_path)
    for cached in (chosen, kernel):
        cached.cache_clear()


def reads_packed(num_rows: int) -> bool:
    """Whether a product of `num_rows` rows reads the packed copy (where there is one). Asked
    by every product: the default path splits nothing, so it is not derived here."""
    return not _chosen_path or num_rows > _chosen_path[-1].plain_rows


def prepacks() -> bool:
    """Whether linear layers keep a packed copy of their weights
    (pdserve/serve/layers/parallel.py)."""
    return path().prepack != "none"


def candidates(op: str) -> tuple[str, ...]:
    """The implementations of `op` the CPU path allows, best first."""
    current = path()
    names: list[str] = []
    if op == "prepack":
        if cpu_kernels() is not None and current.prepack == "panels":
            names.append("cpu")
        return (*names, "onednn")
    if cpu_kernels() is not None:
        if op == "linear" and current.amx:
            names.append("amx")
        names.append("cpu")
    if op == "linear":
        names.append("onednn")
    return (*names, "torch")


@functools.cache
def chosen(op: str) -> str:
    """The name of the implementation that runs `op` here."""
    return registry.choose(op, candidates(op))


@functools.cache
def kernel(op: str) -> Callable[..., Any]:
    """The function that runs `op` here (its arguments: pdserve/kernels/reference.py's op)."""
    return registry.implementation(op, chosen(op))


def reset() -> None:
    """Forget every choice, the CPU path's too (tests that change the environment's
    switches)."""
    _device_type.clear()
    cpu_kernels.cache_clear()
    use_path(None)

