"""Workers that die or hang while they hold a request: the router moves it to another worker of
the pool (pdserve/router/dispatch.py), before its first token or mid-stream, and the client sees the
undisturbed run's text."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from helpers.cluster_util import Roles


@pytest.fixture(scope="module")
def roles(llama_dir, tmp_path_factory):
    roles = Roles(llama_dir, tmp_path_factory.mktemp("failover-logs"), num_decode=2,
                  num_prefill=2, router_args=("--heartbeat-timeout-s", "3"))
    roles.start_all()
    try:
        roles.wait_ready()
        deadline = time.monotonic() + 120  # /health needs one decode worker; wait for both
        while time.monotonic() < deadline:
            workers = httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]
            if sum(w["is_ready"] for w in workers) == 4:
                break
            time.sleep(0.5)
        yield roles
    finally:
        roles.stop()


def test_request_moves_off_a_hung_decode_worker(roles):
    url = f"{roles.base_url}/v1/completions"
    body = {"prompt": "def main():", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reference = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    # Hang the decode worker the router will pick (pdserve/router/policies.py MostFreeKVDecode: most
    # free blocks, then fewest in flight, then the higher address), judged once the statuses
    # stopped changing: the reference request's cached blocks may have left the two unequal.
    previous, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        decode = sorted((w["num_free_blocks"], -w["num_inflight"], w["address"])
                         for w in httpx.get(f"{roles.base_url}/status", timeout=5)
                         .json()["workers"] if w["role"] == "decode")
        if decode == previous:
            break
        previous = decode
        time.sleep(1.0)
    address = decode[-1][2]
    index = [f"tcp://127.0.0.1:{port}" for port in roles.decode_ports].index(address)
    hung = "decode-1" if index else "decode"
    os.kill(roles.processes[hung].pid, signal.SIGSTOP)
    try:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
        workers = httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]
        assert [w["is_alive"] for w in workers if w["address"] == address] == [False]
        router_log = "".join(p.read_text() for p in roles.log_dir.glob("router-*.log"))
        assert f"decode worker {address} died before its first token" in router_log
    finally:
        os.kill(roles.processes[hung].pid, signal.SIGCONT)
    # The hung worker was only stopped: resumed, it must come back alive and idle like the
    # other, and whatever lease it held be released or expire (--kv-lease-ttl-s).
    roles.assert_nothing_leaked()


def _migrations(roles) -> float:
    """pdserve:request_migrations_total{role="decode",resumed="true"} from /metrics."""
    text = httpx.get(f"{roles.base_url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:request_migrations_total{")
               and 'role="decode"' in line and 'resumed="true"' in line)


def _restart(roles, name: str) -> None:
    role, _, index = name.partition("-")
    roles.start_worker(role, int(index or 0))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        workers = httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]
        if sum(w["is_ready"] for w in workers) == 4:
            roles.killed.discard(name)
            return
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not come back")


@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 1.0, "top_p": 0.9, "seed": 1234},
                                      {"temperature": 1.0, "seed": 99, "n": 2}],
                         ids=["greedy", "seeded", "seeded-n2"])
def test_stream_survives_its_decode_worker_killed_mid_stream(roles, sampling):
    """SIGKILL the decode worker after it streamed some tokens: the router resumes the
    request on the other decode worker from prompt + those tokens (n = 2: each choice after
    its own), and the client's text is the undisturbed run's, with no gap and no repeat
    (seeded sampling at the same draws)."""
    url = f"{roles.base_url}/v1/completions"
    body = {"prompt": "def fibonacci(n):", "max_tokens": 1200, "ignore_eos": True, **sampling}
    reference = [c["text"] for c in sorted(
        httpx.post(url, json=body, timeout=120).json()["choices"], key=lambda c: c["index"])]
    before = _migrations(roles)
    pieces: dict[int, list[str]] = {}
    killed = None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if not chunk["choices"]:  # (a usage chunk)
                continue
            choice = chunk["choices"][0]
            pieces.setdefault(choice["index"], []).append(choice["text"])
            if sum(map(len, pieces.values())) == 8 * len(reference) and killed is None:
                busy = [w["address"] for w in httpx.get(f"{roles.base_url}/status", timeout=5)
                        .json()["workers"] if w["role"] == "decode" and w["num_inflight"]]
                assert len(busy) == 1, busy
                killed = ("decode-1" if busy[0].endswith(str(roles.decode_ports[1]))
                          else "decode")
                roles.kill(killed)
    assert killed is not None
    assert ["".join(pieces[i]) for i in sorted(pieces)] == reference
    assert _migrations(roles) == before + 1
    _restart(roles, killed)
    roles.assert_nothing_leaked()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_request_moves_off_a_worker_killed_holding_it(roles, role):
    """Both workers of a pool frozen, the request goes to one; that one is SIGKILLed with the
    request in hand (a prefill mid-prompt; a decode with the hand-off, before its load) and
    the other thawed: the router sends it there (a decode reads the prefill's still-leased
    blocks), the text is the undisturbed run's, and no block, pin or lease is left."""
    import concurrent.futures

    url = f"{roles.base_url}/v1/completions"
    body = {"prompt": "word " * 300, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reference = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    names = [role, f"{role}-1"]
    for name in names:
        os.kill(roles.processes[name].pid, signal.SIGSTOP)
    victim = None
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url, json=body, timeout=120)
            deadline = time.monotonic() + 30
            while victim is None and time.monotonic() < deadline:
                for w in httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]:
                    if w["role"] == role and w["num_inflight"]:
                        victim = names[[roles.worker_address(n) for n in names]
                                       .index(w["address"])]
                time.sleep(0.05)
            assert victim is not None, f"the request never reached a {role} worker"
            roles.kill(victim)
            os.kill(roles.processes[victim].pid, signal.SIGCONT)  # let it die
            survivor = next(n for n in names if n != victim)
            os.kill(roles.processes[survivor].pid, signal.SIGCONT)
            r = pending.result()
    finally:
        for name in names:
            if roles.processes[name].poll() is None:
                os.kill(roles.processes[name].pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    _restart(roles, victim)
    roles.assert_nothing_leaked()
