"""Every environment variable pdserve reads, in one place (all prefixed PDSERVE_, but for
OpenTelemetry's standard OTEL_EXPORTER_OTLP_TRACES_* ones).

Each is read when asked for, never at import, so tests can set them with monkeypatch.
"""

from __future__ import annotations

import os
import warnings


def _flag(name: str, default: str = "1") -> bool:
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def attention_backend() -> str | None:
    """PDSERVE_ATTENTION_BACKEND=triton|cpu|torch overrides the attention dispatch."""
    value = os.environ.get("PDSERVE_ATTENTION_BACKEND")
    if value is not None and value not in ("triton", "cpu", "torch"):
        raise ValueError("PDSERVE_ATTENTION_BACKEND must be 'triton', 'cpu' or 'torch', "
                         f"got {value!r}")
    return value


def cache_dir() -> str:
    """PDSERVE_CACHE_DIR: where the embedded default model and other built artefacts live."""
    return os.environ.get(
        "PDSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    )


def log_level() -> str:
    """PDSERVE_LOG_LEVEL: the root log level of every pdserve process (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def cpu_prepack() -> bool:
    """PDSERVE_CPU_PREPACK=0 keeps linear weights in torch's plain layout on CPU (default 1:
    a packed copy too, pdserve's panels on AVX-512 and oneDNN's layout elsewhere; see
    pdserve/serve/layers/parallel.py prepack)."""
    return _flag("PDSERVE_CPU_PREPACK")


def _deprecated_alias(name: str, flag: str) -> bool | None:
    """A deprecated switch that only sets a flag's default: its value (None: unset), with one
    FutureWarning where it is set (Python shows a warning once per place that raises it)."""
    if name not in os.environ:
        return None
    warnings.warn(f"{name} is deprecated: use the worker flag {flag} / --no-{flag[2:]} "
                  "(the variable only sets that flag's default)", FutureWarning, stacklevel=3)
    return _flag(name)


def handoff_shm_default() -> bool:
    """The default of the worker flag --handoff-shm (True), unless the deprecated alias
    PDSERVE_HANDOFF_SHM=0|1 sets it (warning once). The flag chooses
    (pdserve/handoff/registry.py choose_handoff); the variable only moves its default."""
    alias = _deprecated_alias("PDSERVE_HANDOFF_SHM", "--handoff-shm")
    return True if alias is None else alias


def handoff_follow_default() -> bool:
    """The default of the worker flag --handoff-follow (True), unless the deprecated alias
    PDSERVE_HANDOFF_FOLLOW=0|1 sets it (warning once), as handoff_shm_default."""
    alias = _deprecated_alias("PDSERVE_HANDOFF_FOLLOW", "--handoff-follow")
    return True if alias is None else alias


def cpu_amx() -> bool:
    """PDSERVE_CPU_AMX=0 keeps every product on the panels (default 1: where the CPU has AMX and
    the panels store a half-precision checkpoint's bf16 weights, steps of many rows, a
    prefill's or a decode step's of many sequences, run on AMX,
    pdserve/kernels/csrc/amx_gemm.cpp)."""
    return _flag("PDSERVE_CPU_AMX")


def fused_decode() -> bool:
    """PDSERVE_FUSED_DECODE=0 runs decode steps through the model's modules layer by layer
    (default 1: a Llama-family decode step's layer loop runs as one compiled call on CPU,
    pdserve/serve/layers/fused_decode.py)."""
    return _flag("PDSERVE_FUSED_DECODE")


def cuda_graphs_on_cpu() -> bool:
    """PDSERVE_CUDA_GRAPHS_ON_CPU=1: a one-rank CPU worker runs its decode steps the way CUDA
    graphs do, over the graphs' static, padded buffers, but eagerly (nothing is captured on
    CPU; pdserve/serve/executor/cuda_graphs.py), so tests prove the buffers and padding without a
    GPU (default 0: on CPU a decode step takes the fused C++ loop or the modules)."""
    return _flag("PDSERVE_CUDA_GRAPHS_ON_CPU", "0")


def cpu_tuning() -> bool:
    """PDSERVE_CPU_TUNING=0 serves with the default CPU path instead of the one measured
    fastest on this machine (default 1: a one-rank CPU worker times every candidate path on
    its first start and caches the choice, pdserve/serve/executor/cpu_tuning.py)."""
    return _flag("PDSERVE_CPU_TUNING")


def cpu_kernels() -> bool:
    """PDSERVE_CPU_KERNELS=0 turns pdserve's compiled CPU ops off (fused norm, rotary, SiLU,
    KV writes, in-place decode attention): the plain-torch paths run, as on a
    machine without a compiler. Default 1."""
    return _flag("PDSERVE_CPU_KERNELS")


def io_cores() -> list[int]:
    """PDSERVE_IO_CORES=1,2: the cores a worker's ZeroMQ I/O thread runs on (empty: the
    process's). `pdserve up` sets it for a worker whose first core it keeps for the main
    thread (pdserve/app/launcher/placement.py share_with_services)."""
    value = os.environ.get("PDSERVE_IO_CORES", "")
    try:
        return [int(core) for core in value.split(",") if core.strip()]
    except ValueError:
        raise ValueError(f"PDSERVE_IO_CORES must be core numbers joined by commas, got "
                         f"{value!r}") from None


def take_launcher_pid() -> int | None:
    """PDSERVE_LAUNCHER_PID: set by `pdserve up` in each child's environment; the child exits
    once that process is no longer its parent (pdserve/lifecycle.py). Removed from the
    environment as it is read: it names the parent of this process only, not of the
    processes this one starts."""
    value = os.environ.pop("PDSERVE_LAUNCHER_PID", None)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"PDSERVE_LAUNCHER_PID must be a process id, got {value!r}")
    return int(value)


def otlp_traces_endpoint() -> str | None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (OpenTelemetry's standard variable, honoured as vLLM
    does): the router's --otlp-traces-endpoint when the flag is not given."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None


def otlp_traces_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: pdserve exports http/protobuf only (the default);
    anything else is an error, not a silent switch of wire format."""
    value = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    if value != "http/protobuf":
        raise ValueError("pdserve exports traces over OTLP http/protobuf only; "
                         f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is {value!r}")
    return value


def results_dir() -> str:
    """PDSERVE_RESULTS_DIR: the folder benchmarks write their results under, one sub-folder per
    benchmark (default $XDG_CACHE_HOME/pdserve/results, else ~/.cache/pdserve/results: results
    are data, never written into the checkout)."""
    value = os.environ.get("PDSERVE_RESULTS_DIR")
    if value:
        return os.path.expanduser(value)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pdserve", "results")
