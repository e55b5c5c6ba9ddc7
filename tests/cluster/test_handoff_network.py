"""The KV hand-off over the network path, as between two hosts: every shared-memory path off
(--no-handoff-shm, UCX over TCP only), so decode reads each prompt from the prefill
worker's hand-off node over the wire, pulling each layer as the prefill stages it
(pdserve/handoff/layer_pull.py). Different TP degrees on the two sides (each decode rank keeps its
own heads of each layer; an MLA latent goes whole to every rank) give the offline engine's text,
nothing is copied in place, and nothing is left held. A kill of either side while decode
reads (the prefill frozen under the read, then one of the two SIGKILLed) loses no request and
leaves no block, reservation, lease or pin."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from helpers.cluster_util import Roles, complete, start_cluster, wait_until

from pdserve.serve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture
def network_path(monkeypatch):
    """What `pdserve up` and its children inherit: UCX over TCP only."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")


def _served_over_the_network(model_dir, log_dir, expected: list[str], *flags: str) -> None:
    """Decode follows each prefill, pulling its layers as they are staged (each of its TP
    ranks keeping its own heads of each layer)."""
    cluster = start_cluster(model_dir, log_dir, "--mode", "disagg", "--num-kv-blocks", "128",
                            "--handoff-dram-gb", "0.25", "--no-handoff-shm", *flags)
    try:
        for prompt, text in zip(PROMPTS, expected, strict=True):
            body = complete(cluster.base_url, prompt=prompt, max_tokens=10, temperature=0)
            assert body["choices"][0]["text"] == text

        def loads() -> dict:
            (decode,) = [w for w in cluster.status()["workers"] if w["role"] == "decode"]
            return decode.get("kv_transfer", {})

        assert wait_until(lambda: loads().get("load_count") == len(PROMPTS)), loads()
        assert loads().get("in_place_count", 0) == 0  # none out of the prefill's segment
        assert loads().get("pulled_count", 0) == len(PROMPTS)
        assert loads()["loaded_bytes"] > 0
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()


@pytest.mark.parametrize("prefill_tp,decode_tp", [("2", "1"), ("1", "2")])
def test_tp_relayout_over_the_network_path(llama_dir, tmp_path_factory, network_path,
                                           prefill_tp, decode_tp):
    with LLM(llama_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]
    _served_over_the_network(llama_dir, tmp_path_factory.mktemp("net-tp-logs"), expected,
                             "--prefill-tp", prefill_tp, "--decode-tp", decode_tp)


def test_mla_latent_over_the_network_path(make_model_dir, tmp_path_factory, network_path):
    model_dir = make_model_dir("deepseek_v3", seed=3)
    with LLM(model_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]
    _served_over_the_network(model_dir, tmp_path_factory.mktemp("net-mla-logs"), expected,
                             "--prefill-tp", "2", "--decode-tp", "1")


# ---- a kill while decode reads the prompt over the network ----------------------------------
@pytest.fixture(scope="module")
def roles(llama_dir, tmp_path_factory):
    """One prefill and two decode workers, each its own process, every hand-off over the
    network path."""
    with pytest.MonkeyPatch.context() as env:  # for the module: restarted workers too
        env.setenv("UCX_TLS", "tcp,self")
        roles = Roles(llama_dir, tmp_path_factory.mktemp("net-kill-logs"), num_decode=2,
                      router_args=("--heartbeat-timeout-s", "3"),
                      worker_args=("--no-handoff-shm",))
        roles.start_all()
        try:
            roles.wait_ready()
            assert wait_until(lambda: _all_ready(roles), 120)
            yield roles
        finally:
            for process in roles.processes.values():
                if process.poll() is None:
                    os.kill(process.pid, signal.SIGCONT)
            roles.stop()


def _inflight(roles, role: str) -> list[str]:
    return [w["address"] for w in httpx.get(f"{roles.base_url}/status", timeout=5)
            .json()["workers"] if w["role"] == role and w["num_inflight"]]


def _all_ready(roles) -> bool:
    workers = httpx.get(f"{roles.base_url}/status", timeout=5).json()["workers"]
    return sum(w["is_ready"] for w in workers) == 3


def _reference(llama_dir, prompt: str) -> str:
    """The offline engine's text: a served run first would leave the prompt's blocks in a
    decode worker's cache, and the kill's run would then move nothing."""
    with LLM(llama_dir, num_kv_blocks=128) as llm:
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))[0].outputs[0].text


def _read_under_way(roles, prompt: str, pool) -> tuple[object, str]:
    """Both decode workers frozen while the prompt is prefilled and handed off; then the
    prefill frozen and the decode workers thawed: the one given the request starts reading
    from a node that does not answer. Returns (the pending response, that decode worker)."""
    decodes = ["decode", "decode-1"]
    for name in decodes:
        os.kill(roles.processes[name].pid, signal.SIGSTOP)
    try:
        pending = pool.submit(httpx.post, f"{roles.base_url}/v1/completions", timeout=120,
                              json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                    "ignore_eos": True})
        assert wait_until(lambda: _inflight(roles, "decode") != [], 60)  # handed off
        os.kill(roles.processes["prefill"].pid, signal.SIGSTOP)
    finally:
        for name in decodes:
            os.kill(roles.processes[name].pid, signal.SIGCONT)
    (address,) = _inflight(roles, "decode")
    reader = next(n for n in decodes if roles.worker_address(n) == address)
    time.sleep(0.5)  # its read is under way, unanswered
    return pending, reader


def test_a_prefill_killed_while_decode_reads_leaves_nothing_held(llama_dir, roles):
    """The prefill SIGKILLed under the decode worker's read (its pull of the layers, which it
    started as the follower: the hand-off came before any layer had crossed): the pull
    fails, the reservation goes back, decode takes the prompt from the store's write-back
    copy or recomputes it; the text is the undisturbed run's, and no block, reservation,
    lease or pin is left."""
    import concurrent.futures

    prompt = "alpha " * 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending, _ = _read_under_way(roles, prompt, pool)
        roles.kill("prefill")
        os.kill(roles.processes["prefill"].pid, signal.SIGCONT)  # let it die
        r = pending.result()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _reference(llama_dir, prompt)
    logs = "".join(p.read_text(errors="replace") for p in roles.log_dir.glob("decode*.log"))
    assert "pulling staging" in logs  # the read under way was the follower's pull
    roles.start_worker("prefill")
    assert wait_until(lambda: _all_ready(roles), 120)
    roles.assert_nothing_leaked()


def test_a_decode_killed_while_it_reads_leaves_nothing_pinned_on_the_prefill(llama_dir, roles):
    """The decode worker SIGKILLed in its read: the router moves the request to the other
    decode worker (which reads the prefill's still-leased blocks once the prefill is thawed,
    or recomputes), the text is the undisturbed run's, and the prefill's node keeps no lease
    for the dead reader."""
    import concurrent.futures

    prompt = "beta " * 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending, reader = _read_under_way(roles, prompt, pool)
        roles.kill(reader)
        os.kill(roles.processes["prefill"].pid, signal.SIGCONT)
        r = pending.result()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _reference(llama_dir, prompt)
    role, _, index = reader.partition("-")
    roles.start_worker(role, int(index or 0))
    assert wait_until(lambda: _all_ready(roles), 120)
    roles.assert_nothing_leaked()
