"""An idle worker lends its cores to the worker of the other role on the same host.

On a small CPU host `pdserve up` splits the cores between the roles (2 cores: prefill 1,
decode 1), so a prompt that arrives while decode has nothing to do still prefills on half the
machine, and a decode step while no prompt is prefilling still runs on the other half. Here
each worker publishes whether it holds any request, and its partner checks before each step
(a prefill also before each layer of its forward): while the lender is idle the borrower runs
on its own cores and the lender's, with as many threads; once the lender holds a request
again the borrower goes back to its own at its next layer (prefill) or step (decode), so the
lender shares its core with a borrowed thread for one layer, or one decode step, at most.

    decode worker ──IdleFlag (one byte in a shared file)──► prefill worker
    prefill worker ─────────────── IdleFlag ───────────────► decode worker
      writes 1 while it holds a request,                     CoreBorrower.update() before
      0 when it holds none                                   each step: cores and threads

Only a one-rank worker borrows (its one process owns every compute thread; a TP rank's
threads live in other processes). Torch's OpenMP threads are pinned one per core on
each change (pdserve/kernels/csrc/threads.cpp): left to the scheduler, the grown team shares a core
for a while, which slows the steps right after a borrow.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_BUSY, _IDLE = b"\x01", b"\x00"


class IdleFlag:
    """One byte in a file that both processes map: the lender's "I hold no request"."""

    def __init__(self, path: str | Path, *, create: bool = False) -> None:
        """create: the lender's end (the file is made, and starts busy); a borrower opens an
        existing file and sees busy until it exists."""
        self.path = Path(path)
        self.is_lender = create
        self._map: mmap.mmap | None = None
        self._written: bytes | None = None
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, 1)
                self._map = mmap.mmap(fd, 1)
            finally:
                os.close(fd)
            self._write(_BUSY)

    def _open(self) -> mmap.mmap | None:
        if self._map is None:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                if os.fstat(fd).st_size < 1:  # the lender is between create and truncate
                    return None
                self._map = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        return self._map

    def is_idle(self) -> bool:
        """The lender said it holds no request (False before it said anything)."""
        flag = self._open()
        return flag is not None and flag[0:1] == _IDLE

    def set_idle(self, idle: bool) -> None:
        """Lender only; writes only on a change."""
        self._write(_IDLE if idle else _BUSY)

    def _write(self, value: bytes) -> None:
        if not self.is_lender or self._map is None:
            raise RuntimeError(f"{self.path}: opened to read, not to write")
        if value != self._written:
            self._map[0:1] = value
            self._written = value

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


@dataclass(frozen=True)
class Lender:
    """Cores a worker may borrow, and the flag that says when."""

    cores: tuple[int, ...]
    flag_path: str

    @classmethod
    def parse(cls, text: str) -> Lender:
        """'CORES@PATH', CORES as in `taskset -c` (e.g. '1' or '2-3,6'); an argparse type."""
        cores_text, sep, path = text.partition("@")
        if not sep or not path:
            raise argparse.ArgumentTypeError(
                f"not CORES@PATH like '1@/dev/shm/decode-0.idle': {text!r}")
        return cls(tuple(parse_core_list(cores_text)), path)


def parse_core_list(text: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3] (an argparse type: a bad list is a usage error)."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a core list like '1' or '0,2-3': {text!r}"
                                         ) from None
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"not a core list like '1' or '0,2-3': {text!r}")
    return sorted(cores)


class CoreBorrower:
    """Runs this process on its own cores plus those of every lender that is idle.

    Start the process on all of them (its own and the lenders'), and make the borrower before
    torch starts any thread: OpenMP counts the cores it may use once, at load, and a team
    larger than that count sleeps at every barrier instead of spinning (libgomp's throttled
    wait), which made a borrowed prefill 20-30% slower than a colocated one. The borrower
    then narrows every thread to the own cores: the start cores less the lenders'."""

    def __init__(self, lenders: Sequence[Lender], main_on_lent: bool = False) -> None:
        """main_on_lent: while borrowing, this thread (OpenMP's thread 0) runs on a lent
        core, not an own one: for a decode worker, whose own cores the router and store
        share (pdserve/app/launcher/placement.py), never a prefill's."""
        start = frozenset(os.sched_getaffinity(0))
        lent = frozenset().union(*(lender.cores for lender in lenders))
        self.own_cores = start - lent
        if not self.own_cores:
            raise ValueError(f"started on cores {sorted(start)}, all of them lent by others "
                             f"({sorted(lent)}): start it on its own cores and the lent ones")
        self._lenders = [(frozenset(lender.cores) & start, IdleFlag(lender.flag_path))
                         for lender in lenders]
        self._main_on_lent = main_on_lent
        self.own_threads: int | None = None
        """torch's threads on the own cores (read at the first borrow: the engine sets it)."""
        self.cores = self.own_cores
        self.num_borrows = 0
        """Times it took a lender's cores (each borrow of one or more lenders counts once)."""
        _pin_all_threads(self.own_cores)

    @property
    def is_borrowing(self) -> bool:
        return self.cores != self.own_cores

    def update(self) -> None:
        """Borrow the idle lenders' cores and give back the busy ones' (a byte read per
        lender; threads move only on a change)."""
        cores = self.own_cores.union(*(cores for cores, flag in self._lenders
                                       if flag.is_idle()))
        if cores != self.cores:
            self._move_to(cores)

    def give_back(self) -> None:
        if self.is_borrowing:
            self._move_to(self.own_cores)

    def _move_to(self, cores: frozenset[int]) -> None:
        import torch

        from pdserve.kernels import cpu_ops

        if self.own_threads is None:
            self.own_threads = torch.get_num_threads()
        if len(cores) > len(self.cores):
            self.num_borrows += 1
            if self.num_borrows == 1:  # then at debug level: it happens per idle spell
                logger.info("borrowed cores %s while the worker lending them is idle (it gets "
                            "them back within a layer or a step once it holds a request; "
                            "pdserve up --no-core-lending turns this off)",
                            ",".join(map(str, sorted(cores - self.own_cores))))
        own, borrowed = sorted(self.own_cores), sorted(cores - self.own_cores)
        torch.set_num_threads(self.own_threads + len(borrowed))
        library = cpu_ops.load()
        if library is not None:
            # OpenMP thread i on one core: the own threads on the own cores (thread 0 is this
            # one, which also runs the engine's Python between parallel regions), then one
            # thread per borrowed core; the other threads stay where they are. main_on_lent
            # puts thread 0 on the first borrowed core instead: with it left on a decode
            # worker's own core, the router and store that share that core waited on it (11
            # req/s, 2 cores: the router's part of TTFT 3.1 -> 7.0 ms, the queue before the
            # prefill 31 -> 46 ms, mean TTFT 117 -> 156-221 ms; on the lent core, 121 ms).
            own_threads = [own[i % len(own)] for i in range(self.own_threads)]
            first = borrowed[:1] if self._main_on_lent else []
            library.pin_openmp_threads(first + own_threads + borrowed[len(first):])
        else:  # without the kernels: every thread may use every core
            _pin_all_threads(cores)
        logger.debug("now on cores %s", sorted(cores))
        self.cores = cores

    def close(self) -> None:
        self.give_back()
        for _, flag in self._lenders:
            flag.close()


def _pin_all_threads(cores: frozenset[int]) -> None:
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
