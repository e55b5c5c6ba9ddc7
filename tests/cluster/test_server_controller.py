"""The goodput controller end to end through `pdserve up --controller flip`: a prefill-bound
load on 1 prefill + 2 decode workers, with no headroom left on the one prefill worker,
makes the router move a decode worker to prefill; greedy outputs are the same before and
after, long answers streaming while the decode worker leaves are handed over and end the
same as offline (a move fails no request), and the flipped worker serves prompts.
"""

from __future__ import annotations

import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.cluster_util import complete, start_cluster

from pdserve.serve import LLM, SamplingParams

FLIP_TIMEOUT_S = 90.0


def _complete(base_url: str, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy completion: (text, number of tokens)."""
    body = complete(base_url, prompt=prompt, max_tokens=max_tokens, temperature=0,
                    ignore_eos=True)
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def _roles(base_url: str) -> dict[str, str]:
    workers = httpx.get(f"{base_url}/status", timeout=5).json()["workers"]
    return {w["worker_id"]: w["role"] for w in workers}


def _prefix_queries(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    pattern = r'pdserve:prefix_cache_queries_total\{[^}]*worker="([^"]+)"[^}]*\} (\S+)'
    return {worker: float(value) for worker, value in re.findall(pattern, text)}


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    cluster = start_cluster(
        llama_dir, tmp_path_factory.mktemp("controller-logs"), "--num-prefill", "1",
        "--num-decode", "2", "--num-kv-blocks", "512", "--controller", "flip",
        "--controller-interval-s", "0.5", "--slo-ttft-ms", "100", "--slo-tpot-ms", "5000")
    yield cluster
    assert cluster.stop() == 0, cluster.log()


def test_prefill_bound_load_flips_a_decode_worker(cluster, llama_dir):
    base = cluster.base_url
    rng = random.Random(0)
    probes = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 130)]
    long_prompt = [rng.randrange(3, 1000) for _ in range(24)]
    before = [_complete(base, p, 8) for p in probes]
    llm = LLM(str(llama_dir), num_kv_blocks=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        offline = [(o.outputs[0].text, len(o.outputs[0].token_ids))
                   for o in llm.generate(probes, params)]
        [answer] = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=64,
                                                              ignore_eos=True))
        long_offline = (answer.outputs[0].text, 64)
    finally:
        llm.shutdown()
    assert before == offline

    # Long prompts, two output tokens, four at a time: under a 100 ms TTFT SLO the one
    # prefill worker serves them without the controller's headroom (or misses it), so it
    # moves a decode worker (the load lasts until it has, or the timeout).
    prompts = ([rng.randrange(3, 1000) for _ in range(rng.randint(1200, 1800))]
               for _ in range(10_000))

    def flipped() -> bool:
        return httpx.get(f"{base}/status", timeout=5).json()["controller"]["num_flips"] >= 1

    # Meanwhile two clients stream long answers, so decode workers hold requests when one
    # of them leaves its pool (it hands them over; they resume on the other).
    long_answers: list[tuple[str, int]] = []
    done = threading.Event()

    def stream_long_answers() -> None:
        while not done.is_set():
            long_answers.append(_complete(base, long_prompt, 64))

    streams = [threading.Thread(target=stream_long_answers) for _ in range(2)]
    for thread in streams:
        thread.start()
    deadline = time.monotonic() + FLIP_TIMEOUT_S
    try:
        with ThreadPoolExecutor(4) as pool:
            while not flipped() and time.monotonic() < deadline:
                list(pool.map(lambda p: _complete(base, p, 2),
                              [next(prompts) for _ in range(4)]))
    finally:
        done.set()
        for thread in streams:
            thread.join(120)
    status = httpx.get(f"{base}/status", timeout=5).json()
    controller = status["controller"]
    assert controller["num_flips"] == 1, (controller, cluster.log()[-3000:])
    assert long_answers and all(a == long_offline for a in long_answers), long_answers
    [move] = controller["last_moves"]
    assert move["to_role"] == "prefill" and move["seconds"] > 0
    assert controller["recommended"] == {"prefill": 2, "decode": 1}
    goodput = controller["goodput_by_num_prefill"]
    assert goodput["2"] >= 1.2 * goodput["1"]
    roles = _roles(base)
    assert sorted(roles.values()) == ["decode", "prefill", "prefill"]
    flipped = next(w for w, role in roles.items() if w.startswith("decode") and role == "prefill")

    # Same greedy tokens after the flip; concurrent fresh prompts reach the new prefill worker.
    assert [_complete(base, p, 8) for p in probes] == before
    queries_before = _prefix_queries(base).get(flipped, 0.0)
    for _ in range(3):  # a round at a time: a busy box may serve one round on one worker
        fresh = [[rng.randrange(3, 1000) for _ in range(300)] for _ in range(6)]
        with ThreadPoolExecutor(6) as pool:
            outputs = list(pool.map(lambda p: _complete(base, p, 4), fresh))
        assert all(n == 4 for _, n in outputs)
        deadline = time.monotonic() + 5
        while (_prefix_queries(base).get(flipped, 0.0) <= queries_before
               and time.monotonic() < deadline):
            time.sleep(0.5)
        if _prefix_queries(base).get(flipped, 0.0) > queries_before:
            break
    assert _prefix_queries(base).get(flipped, 0.0) > queries_before, (
        "the flipped worker served no prompt", queries_before, _prefix_queries(base),
        httpx.get(f"{base}/status", timeout=5).json()["workers"], cluster.log()[-4000:])
    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    assert re.search(r"pdserve:controller_role_flips_total\{[^}]*\} 1\.0", metrics)
    assert re.search(r'pdserve:controller_recommended_workers\{[^}]*role="prefill"\} 2\.0',
                     metrics)

    # Nothing leaks across the flip: every worker's blocks are free, no lease or pin remains.
    cluster.assert_nothing_leaked()

