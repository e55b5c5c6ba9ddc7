"""pdserve's CPU kernels (pdserve/kernels/csrc/*.cpp): one C++ extension, compiled once per machine.

    paged_last_token_attention   decode attention reading the paged cache in place
                                 (pdserve/kernels/cpu_attention.py wraps it as a backend op)
    add_rms_norm, silu_and_mul,  the small per-layer ops of a decoder block, each one call
    rotary_neox_, write_kv_cache   instead of several torch dispatches (fp32)
    skinny_linear                x W^T for the few rows of a decode step, streaming W from
                                 memory at close to its read speed
                                 (pdserve/serve/layers/parallel.py)
    panel_linear                 x W^T from W packed in panels (fp32, bf16 or fp16; AVX-512)
    amx_panel_linear             x W^T for many rows from bf16 panels on AMX (fp32 results)
    DecodeLoop                   a Llama-family decode step's whole layer loop in one call,
                                 the ops above in the module path's order
                                 (pdserve/serve/layers/fused_decode.py),
                                 in one parallel region where every product has panels
    pin_openmp_threads           torch's OpenMP thread i on core i of a list
    (pdserve/serve/cpu/core_share.py)

Built with torch's C++ extension builder (gcc and ninja; -O3 -march=native, OpenMP through
torch's own runtime) into torch's extension cache (TORCH_EXTENSIONS_DIR), under a name that
carries a hash of the sources and flags: a process whose library is already built imports it
directly (milliseconds, no lock, no compiler). A missing library is built in a child process
with a time limit (the first build takes one to three minutes on 2 cores), so neither a slow
nor a killed build can hang a worker: torch's builder waits without limit on a lock file that
a killed builder leaves behind, and such a lock is removed once no builder holds the build
directory's flock (or it is older than the time limit).
`load()` returns None, with one warning, where the library cannot be had (no compiler, no
ninja, a build past its limit); every caller then keeps its plain-torch path, which is also the
reference the tests compare these kernels with.

A worker that must serve before the build is done (pdserve/serve/executor/cpu_preparation.py)
has another process build the library: between `build_elsewhere()` and `built_elsewhere()`,
`load()` in this process never compiles; it imports the library if it is there and otherwise
returns None without settling on that, so a later call imports what the other process built.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp",
           "skinny_gemm.cpp", "amx_gemm.cpp", "decode_step.cpp", "threads.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 900.0
BUILDER_FLOCK = "builder.flock"


def library_name() -> str:
    """pdserve_cpu_ops_<hash of the sources, their list, header, flags and torch version>."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(SOURCES + CFLAGS + LDFLAGS).encode())  # what is compiled, and how
    return f"pdserve_cpu_ops_{digest.hexdigest()[:12]}"


def _build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _build(name: str, directory: Path, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Compile in a child process, within timeout_s (RuntimeError past it or on a compiler
    error)."""
    lock = directory / "lock"
    if lock.exists() and (not _is_builder_alive(directory)
                          or time.time() - lock.stat().st_mtime > timeout_s):
        logger.warning("removing a stale build lock left by a killed build: %s", lock)
        lock.unlink(missing_ok=True)
    logger.warning("building pdserve's CPU kernels once for this machine (a minute or two)")
    # the builder holds an flock while it builds (the kernel drops it when the builder dies,
    # however it dies): a torch lock file with no builder alive is stale
    script = ("import fcntl, sys; from torch.utils.cpp_extension import load; "
              "held = open(sys.argv[6], 'a'); fcntl.flock(held, fcntl.LOCK_EX); "
              "load(name=sys.argv[1], sources=sys.argv[2].split(','), "
              "extra_include_paths=[sys.argv[3]], extra_cflags=sys.argv[4].split(','), "
              "extra_ldflags=sys.argv[5].split(','), verbose=False)")
    command = [sys.executable, "-c", script, name, ",".join(str(CSRC / s) for s in SOURCES),
               str(CSRC), ",".join(CFLAGS), ",".join(LDFLAGS), str(directory / BUILDER_FLOCK)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as builder:
        try:
            stdout, stderr = builder.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(builder.pid)  # ninja and the compilers too, not the builder alone
            builder.communicate()
            lock.unlink(missing_ok=True)  # the builder we started is gone: its lock is stale
            raise RuntimeError(f"the build took longer than {timeout_s:.0f} s") from None
    if builder.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        raise RuntimeError(lines[-1][:300] if lines else f"exit code {builder.returncode}")


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (as /proc lists them), children first seen."""
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        found.append(parent)
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                pending += [int(child) for child in children.read_text().split()]
            except OSError:  # it ended meanwhile
                pass
    for each in found:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_builder_alive(directory: Path) -> bool:
    """Whether a builder holds the build directory's flock (an older pdserve's builder held
    none: then only the lock's age tells)."""
    try:
        with open(directory / BUILDER_FLOCK, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(held, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return True
    except OSError:  # cannot tell
        return True


_outcome: list[ModuleType | None] = []  # load()'s settled answer, once there is one
_lock = threading.Lock()
_num_elsewhere = [0]  # build_elsewhere() calls not yet ended by built_elsewhere()


def load(build_timeout_s: float = BUILD_TIMEOUT_S) -> ModuleType | None:
    """The compiled extension, or None (logged once) where it cannot be had, built first
    within build_timeout_s where it is missing; while another process builds it
    (build_elsewhere), None until that build is done, never a build here."""
    if _outcome:
        return _outcome[0]
    with _lock:
        if _outcome:
            return _outcome[0]
        try:
            name = library_name()
            directory = _build_directory(name)
            library = directory / f"{name}.so"
            if not _is_complete(directory, library):
                if _num_elsewhere[0]:
                    return None  # not settled: asked again once the other build is done
                _build(name, directory, build_timeout_s)
            module = _import(name, library)
        except Exception as exc:  # no compiler, no ninja, a read-only cache: torch paths stay
            first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
            _settle_unavailable(f"{type(exc).__name__}: {first_line}")
            return None
        _outcome.append(module)
        return module


def is_built() -> bool:
    """Whether load() would import the library at once (it is built, or loaded already)."""
    if _outcome:
        return _outcome[0] is not None
    try:
        name = library_name()
        directory = _build_directory(name)
        return _is_complete(directory, directory / f"{name}.so")
    except Exception:  # whatever keeps load() from finding it: not built
        return False


def _is_complete(directory: Path, library: Path) -> bool:
    """The library is there and no build holds torch's lock: the linker writes it in place,
    so a library beside the lock may be half written."""
    return library.exists() and not (directory / "lock").exists()


def build_elsewhere() -> None:
    """From now until the matching built_elsewhere(), load() builds nothing in this process
    (another process is building the library)."""
    with _lock:
        _num_elsewhere[0] += 1


def built_elsewhere(reason_unavailable: str | None = None) -> None:
    """Ends one build_elsewhere(): the other process's build is done (load() imports it) or
    was stopped; with `reason_unavailable` (that build failed), load() answers None for good
    in this process, logged once."""
    with _lock:
        _num_elsewhere[0] = max(0, _num_elsewhere[0] - 1)
        if reason_unavailable is not None and not _outcome:
            _settle_unavailable(reason_unavailable)


def _settle_unavailable(reason: str) -> None:
    logger.warning("pdserve's CPU kernels are unavailable (%s); the plain-torch paths run "
                   "instead", reason)
    _outcome.append(None)


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
