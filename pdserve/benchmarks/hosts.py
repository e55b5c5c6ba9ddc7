"""Hosts emulated on one machine: each its own network namespace, host name, /dev/shm, IPC
namespace and PID space, linked through a bridge by a veth pair whose two ends `tc tbf`
shapes to a rate (both directions). Studies and tests run pdserve's roles inside them, so KV
bytes between roles on different hosts really cross a link of a known speed.

    with EmulatedHosts(2, rate_mbit=1000) as hosts:
        store = hosts.spawn(0, ["pdserve", "store", "--host", hosts.address(0), ...], cores=[0])
        ...
        before = hosts.link_bytes(1)
        hosts.link_down_for(1, 10.0)          # a cut while a load runs (a thread)
        hosts.set_rate(1, 100)                # the link's rate changed
        moved = hosts.link_bytes(1) - before  # what host 1 sent and received

    host i (netns pdh-<tag>-<i>, hostname h<i+1>)             this machine (the root namespace)
      eth0 10.213.K.(i+1)/24 ═══ veth, tbf each end ═══ phv<tag><i> ─┐
                                                                     ├─ bridge pbr<tag>
      router, client (outside) ──────────────────── 10.213.K.254/24 ─┘

Why every namespace: without the IPC namespace UCX moves bytes between two "hosts" through
SysV shared memory and the link never sees them; without the PID namespace (and /proc mounted
in it) a decode worker could map a prefill's segment through /proc/<pid>/fd; without its own
/dev/shm, POSIX segments are shared. A host is one long-lived process (`unshare --fork
--kill-child ... sleep infinity`, PID 1 of the host's PID namespace) that holds them all; a
role enters them with `nsenter --target`, so the processes of one host share its namespaces
as processes on one machine do. When the holder dies, the kernel kills every process of its
PID namespace: a host is torn down by killing one process.

Needs root (namespaces, veths, tc); `require_root` says so otherwise. Teardown runs on
`close()`, on leaving the `with` block (Ctrl-C included), at interpreter exit, and SIGTERM is
turned into SystemExit while hosts are up; a run killed outright leaves a record in
RECORD_DIR that `python -m pdserve.benchmarks.hosts --cleanup` (or the next EmulatedHosts)
removes. netem is not available on this machine's kernel; tbf is, so links have a rate but
no added delay or loss.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.lifecycle import parent_death_preexec

logger = logging.getLogger(__name__)

RECORD_DIR = Path("/run/pdserve-hosts")
"""One JSON record per live EmulatedHosts (owner pid, namespaces, bridge), for --cleanup."""
NETNS_PREFIX = "pdh-"
INNER_DEVICE = "eth0"
"""Each host's own end of its link, named alike on every host (UCX_NET_DEVICES names it)."""
SUBNET_PREFIX = "10.213"
"""Hosts get 10.213.K.(i+1), the bridge 10.213.K.254: K is the first /24 no route uses."""
REQUIRED_TOOLS = ("ip", "tc", "unshare", "nsenter", "taskset")


class NeedsRootError(RuntimeError):
    """Emulated hosts need root and the tools in REQUIRED_TOOLS."""


def why_unavailable() -> str | None:
    """Why hosts cannot be emulated here (not root, a tool missing), None where they can."""
    if os.geteuid() != 0:
        return ("emulated hosts need root (network namespaces, veth pairs, tc); run as root, "
                "e.g. `sudo -E`")
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} (iproute2, util-linux) on PATH"
    return None


def require_root() -> None:
    reason = why_unavailable()
    if reason is not None:
        raise NeedsRootError(reason)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip()}")
    return result


def tbf_argv(device: str, rate_mbit: float) -> list[str]:
    """`tc` replacing `device`'s root qdisc by a token bucket of `rate_mbit`. The bucket holds
    2 ms at the rate (at least 64 KiB, so a GSO super-packet of a veth always fits) and the
    queue 20 ms more; a rate of 10 Gbit/s or above is no wire this machine's CPU could fill."""
    rate_bytes_s = rate_mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes_s * 0.002))
    return ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate",
            f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "20ms"]


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host sent and received over its link (its veth's counters, read from the
    bridge's end: what the host sends is what that end receives)."""

    sent: int
    received: int

    def __sub__(self, earlier: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - earlier.sent, self.received - earlier.received)

    @property
    def total(self) -> int:
        return self.sent + self.received


@dataclass
class Host:
    index: int
    name: str
    """Its host name (`hostname` inside it)."""
    netns: str
    address: str
    outer_device: str
    """The bridge's end of its link, in this machine's namespace."""
    holder: subprocess.Popen | None = None
    holder_pid: int = 0
    """PID 1 of the host's PID namespace, as this machine sees it (nsenter's target)."""
    rate_mbit: float | None = None


class EmulatedHosts:
    """`num_hosts` emulated hosts on one bridge, each link shaped to `rate_mbit` both ways
    (None: unshaped). See the module docstring."""

    def __init__(self, num_hosts: int, rate_mbit: float | None = None,
                 shm_size: str = "4g") -> None:
        if not 1 <= num_hosts <= 250:
            raise ValueError(f"num_hosts must be in [1, 250], got {num_hosts}")
        self.num_hosts = num_hosts
        self.initial_rate_mbit = rate_mbit
        self.shm_size = shm_size
        self.tag = f"{os.getpid() % 0xFFFF:04x}"
        self.bridge = f"pbr{self.tag}"
        self.hosts: list[Host] = []
        self.bridge_address = ""
        self._processes: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._is_up = False
        self._old_sigterm = None

    # ---- bring-up and teardown ---------------------------------------------------------
    def __enter__(self) -> EmulatedHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> EmulatedHosts:
        require_root()
        cleanup_stale()
        self._is_up = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        subnet = f"{SUBNET_PREFIX}.{_free_subnet_octet()}"
        self.bridge_address = f"{subnet}.254"
        self.hosts = [Host(i, f"h{i + 1}", f"{NETNS_PREFIX}{self.tag}-{i}", f"{subnet}.{i + 1}",
                           f"phv{self.tag}{i}") for i in range(self.num_hosts)]
        self._write_record()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for host in self.hosts:
            self._build_host(host)
            if self.initial_rate_mbit is not None:
                self.set_rate(host.index, self.initial_rate_mbit)

    def _build_host(self, host: Host) -> None:
        ns, inner_tmp = host.netns, f"phi{self.tag}{host.index}"
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", host.outer_device, "type", "veth", "peer", "name",
              inner_tmp])
        _run(["ip", "link", "set", inner_tmp, "netns", ns])
        _run(["ip", "link", "set", host.outer_device, "master", self.bridge])
        _disable_ipv6(host.outer_device)
        _run(["ip", "link", "set", host.outer_device, "up"])
        inside = ["ip", "netns", "exec", ns]
        _run([*inside, "ip", "link", "set", inner_tmp, "name", INNER_DEVICE])
        _run([*inside, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])
        _run([*inside, "ip", "addr", "add", f"{host.address}/24", "dev", INNER_DEVICE])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        _run([*inside, "ip", "link", "set", INNER_DEVICE, "up"])
        _run([*inside, "ip", "route", "add", "default", "via", self.bridge_address])
        # The holder: PID 1 of the host's PID namespace, in its own UTS, IPC and mount
        # namespaces with /proc and a private /dev/shm; killed with unshare (--kill-child).
        setup = (f"hostname {host.name} && mount -t tmpfs -o size={self.shm_size},mode=1777 "
                 f"tmpfs /dev/shm && exec sleep infinity")
        host.holder = subprocess.Popen(
            [*inside, "unshare", "--uts", "--ipc", "--mount", "--pid", "--mount-proc",
             "--kill-child", "--propagation", "private", "sh", "-c", setup],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=parent_death_preexec(os.getpid()))
        host.holder_pid = self._wait_holder(host)

    def _wait_holder(self, host: Host, timeout_s: float = 10.0) -> int:
        """The holder's forked child once it sleeps (its host name and /dev/shm set)."""
        assert host.holder is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if host.holder.poll() is not None:
                error = host.holder.stderr.read().decode() if host.holder.stderr else ""
                raise RuntimeError(f"host {host.name}'s namespaces failed: {error.strip()}")
            children = _children(host.holder.pid)
            if children and _comm(children[0]) == "sleep":
                return children[0]
            time.sleep(0.02)
        raise RuntimeError(f"host {host.name}'s namespaces were not up in {timeout_s:.0f} s")

    def close(self) -> None:
        """Stop every process started in the hosts, remove the namespaces and the bridge.
        Safe to call twice, and after a failed start."""
        with self._lock:
            if not self._is_up:
                return
            self._is_up = False
        for process in self._processes:
            _kill_group(process)
        for host in self.hosts:  # PID 1 of a host ignores SIGTERM; SIGKILL ends the host
            if host.holder is not None:
                _kill_group(host.holder, timeout_s=0.0)
        for host in self.hosts:
            _run(["ip", "netns", "del", host.netns], check=False)
            _run(["ip", "link", "del", host.outer_device], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        (RECORD_DIR / f"{self.tag}.json").unlink(missing_ok=True)
        atexit.unregister(self.close)
        if self._old_sigterm is not None and threading.current_thread() is \
                threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _write_record(self) -> None:
        RECORD_DIR.mkdir(parents=True, exist_ok=True)
        record = {"owner_pid": os.getpid(), "bridge": self.bridge,
                  "netns": [h.netns for h in self.hosts],
                  "links": [h.outer_device for h in self.hosts]}
        (RECORD_DIR / f"{self.tag}.json").write_text(json.dumps(record))

    # ---- what runs where ---------------------------------------------------------------
    def address(self, index: int) -> str:
        """Host `index`'s address, as every other host and this machine reach it."""
        return self.hosts[index].address

    def spawn(self, index: int, argv: Sequence[str], cores: Sequence[int] | None = None,
              env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
        """Run `argv` on host `index` (its network, UTS, IPC, mount and PID namespaces),
        pinned to `cores` (taskset); stdout and stderr to `log` (None: discarded). The
        process leads a session of its own, so `stop` reaches everything it starts."""
        host = self.hosts[index]
        enter = ["nsenter", f"--target={host.holder_pid}", "--net", "--uts", "--ipc",
                 "--mount", "--pid", f"--wd={os.getcwd()}", "--"]
        pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
        env = dict(os.environ if env is None else env)
        # UCX's TCP transport over the host's own link only: not its loopback, which every
        # emulated host has at the same address.
        env.setdefault("UCX_NET_DEVICES", INNER_DEVICE)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            process = subprocess.Popen([*enter, *pin, *argv], env=env, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        finally:
            if log is not None:
                out.close()
        self._processes.append(process)
        return process

    def host_pid(self, process: subprocess.Popen) -> int | None:
        """The program a `spawn` started, as this machine numbers it (nsenter's child), for
        its /proc entries; None once it has gone."""
        children = _children(process.pid)
        return children[0] if children else None

    def run(self, index: int, argv: Sequence[str], timeout_s: float = 30.0
            ) -> subprocess.CompletedProcess:
        """Run a short command on host `index` and return its output (text)."""
        host = self.hosts[index]
        return subprocess.run(["nsenter", f"--target={host.holder_pid}", "--net", "--uts",
                               "--ipc", "--mount", "--pid", "--", *argv],
                              capture_output=True, text=True, timeout=timeout_s)

    def stop(self, process: subprocess.Popen, timeout_s: float = 10.0) -> None:
        """SIGTERM a process `spawn` started (its whole group), SIGKILL after `timeout_s`."""
        _kill_group(process, timeout_s)

    # ---- links -------------------------------------------------------------------------
    def set_rate(self, index: int, rate_mbit: float | None) -> None:
        """Shape host `index`'s link to `rate_mbit` both ways (None: unshaped); safe while
        traffic flows."""
        host = self.hosts[index]
        inside = ["ip", "netns", "exec", host.netns]
        if rate_mbit is None:
            _run(["tc", "qdisc", "del", "dev", host.outer_device, "root"], check=False)
            _run([*inside, "tc", "qdisc", "del", "dev", INNER_DEVICE, "root"], check=False)
        else:
            _run(tbf_argv(host.outer_device, rate_mbit))
            _run([*inside, *tbf_argv(INNER_DEVICE, rate_mbit)])
        host.rate_mbit = rate_mbit

    def set_all_rates(self, rate_mbit: float | None) -> None:
        for host in self.hosts:
            self.set_rate(host.index, rate_mbit)

    def link_down(self, index: int) -> None:
        """Unplug host `index`'s link (its bridge end down): its packets are lost both ways,
        its connections stay open and resume when the link comes back, as a cut cable."""
        _run(["ip", "link", "set", self.hosts[index].outer_device, "down"])

    def link_up(self, index: int) -> None:
        _run(["ip", "link", "set", self.hosts[index].outer_device, "up"])

    def link_down_for(self, index: int, seconds: float) -> threading.Thread:
        """Take host `index`'s link down now and up again after `seconds`, on a thread (the
        load goes on meanwhile); join the thread to wait for the link's return."""
        self.link_down(index)

        def restore() -> None:
            time.sleep(seconds)
            if self._is_up:
                self.link_up(index)

        thread = threading.Thread(target=restore, name=f"link-down-{index}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def link_bytes(self, index: int) -> LinkBytes:
        """Bytes host `index` has sent and received over its link so far (IP and framing
        included)."""
        stats = Path("/sys/class/net") / self.hosts[index].outer_device / "statistics"
        return LinkBytes(sent=int((stats / "rx_bytes").read_text()),
                         received=int((stats / "tx_bytes").read_text()))


# ---- helpers ---------------------------------------------------------------------------
def _sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _disable_ipv6(device: str) -> None:
    """No IPv6 autoconfiguration chatter on a link whose bytes are counted."""
    path = Path("/proc/sys/net/ipv6/conf") / device / "disable_ipv6"
    if path.exists():
        path.write_text("1")


def _free_subnet_octet() -> int:
    used = _run(["ip", "-4", "route", "show"]).stdout
    for octet in range(1, 255):
        if f"{SUBNET_PREFIX}.{octet}." not in used:
            return octet
    raise RuntimeError(f"no free /24 under {SUBNET_PREFIX}.0.0/16")


def _children(pid: int) -> list[int]:
    try:
        text = (Path("/proc") / str(pid) / "task" / str(pid) / "children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _comm(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _kill_group(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process's group (its session), SIGKILL after `timeout_s` (0: at once)."""
    if process.poll() is None and timeout_s > 0:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # what the group still holds (a child that outlived its leader) goes too
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if process.poll() is None:
        process.wait(10)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove what earlier EmulatedHosts whose owner is gone left behind (a run killed
    outright); returns the namespaces removed. Live owners' hosts are left alone."""
    removed: list[str] = []
    if not RECORD_DIR.is_dir():
        return removed
    for path in RECORD_DIR.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _is_alive(int(record.get("owner_pid", 0))):
            continue
        for netns in record.get("netns", []):
            _kill_netns_processes(netns)
            if _run(["ip", "netns", "del", netns], check=False).returncode == 0:
                removed.append(netns)
        for device in [*record.get("links", []), record.get("bridge", "")]:
            if device:
                _run(["ip", "link", "del", device], check=False)
        path.unlink(missing_ok=True)
    return removed


def _kill_netns_processes(netns: str) -> None:
    for pid in _run(["ip", "netns", "pids", netns], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.benchmarks.hosts",
        description="emulated hosts: remove what a killed run left behind")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces and bridges of runs whose owner is gone")
    args = parser.parse_args(argv)
    require_root()
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
